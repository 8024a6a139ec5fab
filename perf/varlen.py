"""`varlen` suite: `flash_attn_varlen_func` on packed batches against our dense kernels on the same
tokens padded to one length, and FlashAttention-4's varlen when it imports.

    python -m cute_flash.perf varlen --out DIR [--seeds 0 1 2]

bf16, head dim 128, 16 heads (hidden 2048), causal and not. Per seed, 16k tokens packed from
sequence lengths drawn uniformly between 128 and 4096 (the last one what is left, also in that range).
Per cell and pass (fwd, bwd):

* ours varlen: TFLOP/s of the real sequences (sum over sequences of 4 * heads * head dim * the
  (query, key) pairs a row sees; the backward 2.5x the forward's FLOPs, FlashAttention's convention);
* ours dense: flash_attn_func on (sequences, longest length) with every sequence zero-padded to the
  longest, TFLOP/s of the work it does (padded FLOPs), and the time it takes;
* fa4: flash_attn.cute's flash_attn_varlen_func on the same packed tensors (a hook: `fa4_varlen`).

Times: CUDA events around ITERS calls after WARMUP calls, median of REPEATS. The bar (issue 50):
ours varlen TFLOP/s >= 0.95x ours dense and >= 1.0x FA4 in each pass.
Writes `varlen-<gpu>-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
from pathlib import Path

import torch

TOKENS = 16384
MIN_LEN, MAX_LEN = 128, 4096
NHEADS, HEAD_DIM = 16, 128
WARMUP, ITERS, REPEATS = 3, 10, 5
BWD_FLOP_FACTOR = 2.5


def lengths_for(seed: int) -> list[int]:
    """Sequence lengths drawn between MIN_LEN and MAX_LEN summing to TOKENS."""
    rng = random.Random(seed)
    lengths, left = [], TOKENS
    while left > MAX_LEN:
        length = rng.randint(MIN_LEN, min(MAX_LEN, left - MIN_LEN))  # leaves at least MIN_LEN
        lengths.append(length)
        left -= length
    lengths.append(left)
    return lengths


def visible_pairs(length: int, causal: bool) -> int:
    return length * (length + 1) // 2 if causal else length * length


def forward_flops(lengths, causal: bool) -> float:
    return 4.0 * NHEADS * HEAD_DIM * sum(visible_pairs(n, causal) for n in lengths)


def timed(fn) -> float:
    """Seconds per call: median over REPEATS of ITERS back-to-back calls after WARMUP."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ITERS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / ITERS)
    return sorted(times)[len(times) // 2]


def fa4_varlen():
    """FlashAttention-4's varlen function when `flash_attn.cute` imports, else None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 (any import failure leaves the peer out)
        return None
    return flash_attn_varlen_func


def _passes(forward, leaves) -> dict:
    """{'fwd': s, 'bwd': s}: the forward alone (no graph), then the backward of one recorded forward."""
    with torch.no_grad():
        fwd = timed(forward)
    out = forward()
    dout = torch.randn_like(out)
    bwd = timed(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return {"fwd": fwd, "bwd": bwd}


def measure(seed: int, causal: bool) -> dict:
    import cute_flash
    from cute_flash import varlen

    varlen.VALUE_CHECKS = False  # a training step trusts its packer: no read-back
    lengths = lengths_for(seed)
    dtype = torch.bfloat16
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    q, k, v = (torch.randn(TOKENS, NHEADS, HEAD_DIM, dtype=dtype, device="cuda") for _ in range(3))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    # the dense peer: every sequence zero-padded to the longest
    padded = [torch.zeros(len(lengths), longest, NHEADS, HEAD_DIM, dtype=dtype, device="cuda") for _ in range(3)]
    for b, n in enumerate(lengths):
        for dense, packed in zip(padded, (q, k, v)):
            dense[b, :n] = packed.detach()[int(cu[b]):int(cu[b]) + n]
    dense_leaves = [t.requires_grad_() for t in padded]

    def ours():
        return cute_flash.flash_attn_varlen_func(*leaves, cu, cu, longest, longest, causal=causal)

    def dense():
        return cute_flash.flash_attn_func(*dense_leaves, causal=causal)

    real = forward_flops(lengths, causal)
    padded_flops = forward_flops([longest] * len(lengths), causal)
    row = dict(seed=seed, causal=causal, lengths=lengths, longest=longest, sequences=len(lengths),
               label=f"seed {seed} ({len(lengths)} seqs, longest {longest}){' causal' if causal else ''}")
    for name, fn, args, flops in (("ours", ours, leaves, real), ("dense", dense, dense_leaves, padded_flops)):
        for pass_, seconds in _passes(fn, args).items():
            factor = BWD_FLOP_FACTOR if pass_ == "bwd" else 1.0
            row[f"{name}_{pass_}_ms"] = seconds * 1e3
            row[f"{name}_{pass_}_tflops"] = flops * factor / seconds / 1e12
    fa4 = fa4_varlen()
    if fa4 is not None:
        def peer():
            result = fa4(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                         causal=causal)
            return result[0] if isinstance(result, tuple) else result
        try:
            for pass_, seconds in _passes(peer, leaves).items():
                factor = BWD_FLOP_FACTOR if pass_ == "bwd" else 1.0
                row[f"fa4_{pass_}_ms"] = seconds * 1e3
                row[f"fa4_{pass_}_tflops"] = real * factor / seconds / 1e12
        except Exception as error:  # noqa: BLE001 (a peer that refuses is reported, not fatal)
            row["fa4_error"] = str(error).splitlines()[0][:200]
    for pass_ in ("fwd", "bwd"):
        ours_rate = row[f"ours_{pass_}_tflops"]
        row[f"{pass_}_vs_dense"] = ours_rate / row[f"dense_{pass_}_tflops"]
        if f"fa4_{pass_}_tflops" in row:
            row[f"{pass_}_vs_fa4"] = ours_rate / row[f"fa4_{pass_}_tflops"]
        row[f"{pass_}_passes"] = row[f"{pass_}_vs_dense"] >= 0.95 and row.get(f"{pass_}_vs_fa4", 1.0) >= 1.0
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| cell | pass | ours varlen TFLOP/s | ms | dense padded TFLOP/s | ms | FA4 varlen TFLOP/s | vs dense | "
             "vs FA4 | bar |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for pass_ in ("fwd", "bwd"):
            fa4 = f"{row[f'fa4_{pass_}_tflops']:.0f}" if f"fa4_{pass_}_tflops" in row else "—"
            vs_fa4 = f"{row[f'{pass_}_vs_fa4']:.2f}" if f"{pass_}_vs_fa4" in row else "—"
            lines.append(
                f"| {row['label']} | {pass_} | {row[f'ours_{pass_}_tflops']:.0f} | {row[f'ours_{pass_}_ms']:.3f} | "
                f"{row[f'dense_{pass_}_tflops']:.0f} | {row[f'dense_{pass_}_ms']:.3f} | {fa4} | "
                f"{row[f'{pass_}_vs_dense']:.2f} | {vs_fa4} | {'pass' if row[f'{pass_}_passes'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_flash.perf varlen", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    stem = args.out / f"varlen-{name}-{datetime.date.today().isoformat()}"
    rows = []
    cells = [(seed, causal) for seed in args.seeds for causal in (False, True)]
    for seed, causal in cells:
        rows.append(measure(seed, causal))
        print(table(rows[-1:]).splitlines()[-2:], flush=True)
        stem.with_suffix(".json").write_text(json.dumps(dict(rows=rows, complete=len(rows) == len(cells)), indent=1))
        stem.with_suffix(".md").write_text(table(rows))
    print(table(rows))
    return 0
