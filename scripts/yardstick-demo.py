#!/usr/bin/env python3
"""On a GPU: what the old error bar and the yardstick (tests/gpu/common.py) say about forward
outputs broken the way kernel bugs break them.

Our kernel's output passes both. Each case then replaces some rows of batch 0, head 0 by what a
flash kernel with one bug computes for them (in float32 from the inputs, rounded once):

  drop-key       one 128-row block with one key left out of P·V (its weight stays in the row
                 sum), as an off-by-one at a block edge would; every --stride-th key the block sees
  stale-rescale  one row with one K/V block's contribution rescaled by exp(m_before - m_after),
                 the step by which that block moved the row's running max (the accumulator's
                 rescale applied to the new block as well); every --stride-th (row, block) pair
                 where a block moved the max

The old bar: max error <= 2 x the max error of torch's same-dtype attention (QK^T rounded to the
input dtype before scaling) + 1e-5. The yardstick: <= 3 x the emulation's worst row-relative error
and <= 2 x its RMS error (docs/testing.md). Per bug the table counts the cases each one fails,
those only the yardstick fails and those only the old bar fails.

    python3 scripts/yardstick-demo.py [--stride 8]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cute_flash  # noqa: E402
from cute_flash import reference_attention  # noqa: E402
from cute_flash.reference import causal_allowed  # noqa: E402
from tests.gpu import common  # noqa: E402

TILE = 128

# (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, dtype)
PROBLEMS = [
    (2, 1023, 1024, 4, 64, True, torch.bfloat16),
    (2, 1000, 1000, 4, 128, False, torch.bfloat16),
    (2, 1023, 1024, 4, 64, True, torch.float16),
    (1, 2000, 2048, 4, 128, True, torch.bfloat16),
]


def same_dtype_attention(q, k, v, softmax_scale, causal):
    """Attention as torch computes it in the inputs' dtype (fp32 softmax): the old bar's yardstick."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float() * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_allowed(q.shape[1], k.shape[1], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, vh).transpose(1, 2)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


class RowBlock:
    """Rows [start, stop) of batch 0, head 0, as a flash kernel computes them in float32."""

    def __init__(self, q, k, v, softmax_scale, causal, index):
        self.start, self.stop = index * TILE, min((index + 1) * TILE, q.shape[1])
        qb, self.vb = q[0, self.start:self.stop, 0].float(), v[0, :, 0].float()
        s = qb @ k[0, :, 0].float().T * softmax_scale
        if causal:
            s = s.masked_fill(~causal_allowed(q.shape[1], k.shape[1], q.device)[self.start:self.stop], float("-inf"))
        self.scores = s
        self.p = torch.exp(s - s.amax(-1, keepdim=True))
        self.row_sum = self.p.sum(-1, keepdim=True)
        self.out = (self.p.to(q.dtype).float() @ self.vb) / self.row_sum

    def seen_keys(self) -> list[int]:
        return torch.nonzero(torch.isfinite(self.scores).any(0)).flatten().tolist()

    def drop_key(self, key):
        """The block's rows with `key` left out of P·V."""
        return self.out - self.p[:, key:key + 1] * self.vb[key] / self.row_sum

    def stale_rescale(self, block):
        """(row, that row's output) for each row whose running max `block` moved: the block's
        contribution rescaled by exp(m_before - m_after). K/V blocks are visited last to first:
        before `block` the running max covers the keys after it, after it the keys from its start on."""
        lo, hi = block * TILE, (block + 1) * TILE
        if hi >= self.scores.shape[1]:
            return []
        before = self.scores[:, hi:].amax(-1, keepdim=True)
        after = self.scores[:, lo:].amax(-1, keepdim=True)
        moved = torch.isfinite(before) & (after > before)
        factor = torch.where(moved, torch.exp(before - after), 1.0)
        result = self.out + (factor - 1) * (self.p[:, lo:hi] @ self.vb[lo:hi]) / self.row_sum
        return [(self.start + row, result[row:row + 1]) for row in torch.nonzero(moved.flatten()).flatten().tolist()]


def run_problem(batch, seqlen_q, seqlen_k, nheads, head_dim, causal, dtype, stride, device="cuda"):
    q, k, v = (torch.randn(batch, n, nheads, head_dim, device=device, dtype=dtype) for n in (seqlen_q, seqlen_k, seqlen_k))
    scale = 1 / math.sqrt(head_dim)
    out, _ = cute_flash.forward(q, k, v, causal=causal)
    ref, _ = reference_attention(q, k, v, softmax_scale=scale, causal=causal)
    emulated, _ = common.emulate_forward(q, k, v, scale, causal)
    old_bar = 2 * max_err(same_dtype_attention(q, k, v, scale, causal), ref) + 1e-5
    # Each case: None (the kernel's output as it is) or (first row, the broken rows from there).
    bugs = {"none (our kernel)": [None], "drop-key": [], "stale-rescale": []}
    for index in range(-(-seqlen_q // TILE)):
        rows = RowBlock(q, k, v, scale, causal, index)
        keys = rows.seen_keys()
        bugs["drop-key"] += [(rows.start, rows.drop_key(key)) for key in keys[index % stride::stride]]
        for block in sorted({key // TILE for key in keys}):
            bugs["stale-rescale"] += rows.stale_rescale(block)
    bugs["stale-rescale"] = bugs["stale-rescale"][::stride]
    name = f"{batch}x{seqlen_q}x{seqlen_k} h{nheads} d{head_dim} {'causal' if causal else 'full'} {str(dtype).split('.')[-1]}"
    print(f"\n{name}: old bar {old_bar:.2e}; broken: rows of batch 0, head 0, one case at a time")
    print(f"  {'bug':18} {'cases':>6} {'fail old bar':>13} {'fail yardstick':>15} {'only yardstick':>15} "
          f"{'only old bar':>13} {'median max error':>17}")
    for bug, cases in bugs.items():
        old_fails, new_fails, errors = [], [], []
        for case in cases:
            broken = out
            if case is not None:
                first_row, broken_rows = case
                broken = out.clone()
                broken[0, first_row:first_row + broken_rows.shape[0], 0] = broken_rows.to(dtype)
            verdict = common.measure("out", broken, emulated, ref, common.FORWARD_FLOOR)
            old_fails.append(verdict.max_err > old_bar)
            new_fails.append(not verdict.passed)
            errors.append(verdict.max_err)
        only_new = sum(new and not old for old, new in zip(old_fails, new_fails))
        only_old = sum(old and not new for old, new in zip(old_fails, new_fails))
        print(f"  {bug:18} {len(cases):6d} {sum(old_fails):13d} {sum(new_fails):15d} {only_new:15d} {only_old:13d} "
              f"{sorted(errors)[len(errors) // 2]:17.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=8, help="test every n-th case of each bug (1: all)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for problem in PROBLEMS:
        run_problem(*problem, args.stride)
    return 0


if __name__ == "__main__":
    sys.exit(main())
