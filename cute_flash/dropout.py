"""Attention dropout on the host: the Philox (seed, offset) of a call, drawn from torch's CUDA
generator, the kernels' runtime arguments for it, and the keep mask regenerated in torch with the
kernels' own mapping (kernels/common/philox.py describes it), for tests and references.

    rng_state = draw_rng_state(device, batch, nheads)
        int64 (2,) CPU tensor [seed, offset]: the seed of torch's default generator of `device` and
        its Philox offset, which advances by what one call consumes (one counter stream per
        (batch, head), rounded up to torch's multiple of 4), as flash-attn 2 and torch's own
        attention dropout take theirs; so `torch.manual_seed` reproduces a run.
    args = kernel_dropout_args(dropout_p, rng_state)
        (seed, offset, keep threshold, 1 / (1 - dropout_p)) as the kernels take them.
    keep = dropout_keep_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, rng_state, device)
        bool (batch, nheads, seqlen_q, seqlen_k): True where the kernels keep a probability.
    words = philox4x32_10(counter, key)
        Philox4x32-10 on int64 tensors holding 32-bit words: counter (4, ...), key (2, ...).
"""

from __future__ import annotations

import torch

from .kernels.common.philox import PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_OFFSET_ALIGN = 4  # torch's Philox offsets advance in multiples of 4


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a < 2^32 and b's 32-bit words, without int64 overflow:
    b is split into 16-bit halves (each partial product < 2^48)."""
    low = a * (b & 0xFFFF)
    high = a * (b >> 16)
    middle = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (middle >> 32), middle & _MASK32


def philox4x32_10(counter, key) -> list[torch.Tensor]:
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return [c0, c1, c2, c3]


def draw_rng_state(device: torch.device, batch: int, nheads: int) -> torch.Tensor:
    index = torch.device(device).index
    generator = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    seed, offset = generator.initial_seed(), generator.get_offset()
    increment = -(-batch * nheads // _OFFSET_ALIGN) * _OFFSET_ALIGN
    generator.set_offset(offset + increment)
    # torch's seeds are unsigned 64-bit (a fresh one is ≥ 2^63 half the time): stored as their bits
    return torch.tensor([_to_int64(seed), _to_int64(offset)], dtype=torch.int64)


def _to_int64(word: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (the kernels' Int64 argument)."""
    word &= _MASK64
    return word - (1 << 64) if word >> 63 else word


def keep_threshold(dropout_p: float) -> int:
    """floor(dropout_p * 2^32): a word below it drops its element."""
    return min(int(dropout_p * 2.0 ** 32), _MASK32)


def kernel_dropout_args(dropout_p: float, rng_state: torch.Tensor) -> tuple:
    seed, offset = (int(x) for x in rng_state.tolist())
    threshold = keep_threshold(dropout_p)
    return (_to_int64(seed), _to_int64(offset), threshold - (1 << 32) if threshold >> 31 else threshold,
            1.0 / (1.0 - dropout_p))


def dropout_keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      rng_state: torch.Tensor, device=None) -> torch.Tensor:
    seed, offset = (int(x) & _MASK64 for x in rng_state.tolist())
    row_groups = -(-seqlen_q // 16) * 8
    col_pairs = -(-seqlen_k // 2)
    # the (batch, head) streams' 64-bit counters, split in Python (an int64 tensor would overflow)
    streams = [(offset + bh) & _MASK64 for bh in range(batch * nheads)]
    stream_lo, stream_hi = (torch.tensor([(s >> shift) & _MASK32 for s in streams], dtype=torch.int64, device=device)
                            for shift in (0, 32))
    shape = (batch * nheads, row_groups, col_pairs)
    counter = (
        torch.arange(col_pairs, dtype=torch.int64, device=device).view(1, 1, -1).expand(shape),
        torch.arange(row_groups, dtype=torch.int64, device=device).view(1, -1, 1).expand(shape),
        stream_lo.view(-1, 1, 1).expand(shape),
        stream_hi.view(-1, 1, 1).expand(shape),
    )
    words = philox4x32_10(counter, (seed & _MASK32, seed >> 32))
    # word 2 * di + dj of group (g, pair) is element (row (g // 8) * 16 + g % 8 + 8 * di, column 2 * pair + dj)
    grid = torch.stack(words, dim=-1).view(batch * nheads, row_groups // 8, 8, col_pairs, 2, 2)
    grid = grid.permute(0, 1, 4, 2, 3, 5).reshape(batch, nheads, row_groups * 2, col_pairs * 2)
    return grid[:, :, :seqlen_q, :seqlen_k] >= keep_threshold(dropout_p)
