"""Attention dropout: a counter-based RNG (Philox4x32-10, Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC 2011) and the keep mask it draws over a score tile.

The mask of element (batch b, query head h, query row i, key column j) is a pure function of those
coordinates and of the call's (seed, offset), so the forward and the backward (different tilings,
different threads) draw the same bits and nothing of size seqlen_q x seqlen_k is ever stored.
One Philox call gives four 32-bit words, used for the four elements

    (i, j), (i, j + 1), (i + 8, j), (i + 8, j + 1)    with i % 16 < 8 and j even

that one thread of an m16n8 MMA accumulator holds (both passes' score GEMMs are built of m16n8
atoms, 16-bit and TF32 alike, whose C fragment has this shape). Its counter and key:

    counter = (j // 2, (i // 16) * 8 + i % 8, lo32(offset + b * nheads + h), hi32(offset + b * nheads + h))
    key     = (lo32(seed), hi32(seed))

and the word for element (i + 8 * di, j + dj) is word[2 * di + dj]. An element is kept iff its
word >= threshold (unsigned), threshold = floor(dropout_p * 2^32): probability 1 - dropout_p
within 2^-32. cute_flash/dropout.py is the same mapping in torch (tests regenerate the mask with
it) and draws (seed, offset) from torch's CUDA generator.

    rng = DropoutRng.create(philox_seed, philox_offset, threshold, batch * nheads + head)   # per CTA
    apply_dropout(acc_S, thr_mma, tile_m, tile_n, m_block, n_block, rng, encode_in_sign)
    apply_dropout_transposed(acc_St, thr_mma, tile_n, tile_m, n_block, m_block, rng)
        Dropped scores become 0 (forward: P's row sums are taken before, so LSE is unchanged and
        the 1 / (1 - p) rescale goes with the final 1 / row_sum), or -P with encode_in_sign (the
        backward: dV's 16-bit P takes max(P, 0), and dS needs P of dropped entries too).
        The second form takes S^T (the Hopper backward's), sign-encoded.
    dropout_dS(p_signed, dp, dpsum, scale)
        The backward's dS of one element from its sign-encoded P: P * (dP / (1 - p) - D) if
        kept, -P * D if dropped (D = rowsum(dO * O) of the dropped-and-rescaled O).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from .layouts import acc_coordinates, reshape_acc_to_mn

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (golden ratio, sqrt(3) - 1)
PHILOX_ROUNDS = 10


@cute.jit
def philox4x32(c0: Uint32, c1: Uint32, c2: Uint32, c3: Uint32, k0: Uint32, k1: Uint32):
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1): four 32-bit words."""
    for _ in cutlass.range_constexpr(PHILOX_ROUNDS):
        hi0 = cute.arch.mul_hi(Uint32(PHILOX_M0), c0)
        lo0 = Uint32(PHILOX_M0) * c0
        hi1 = cute.arch.mul_hi(Uint32(PHILOX_M1), c2)
        lo1 = Uint32(PHILOX_M1) * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + Uint32(PHILOX_W0)
        k1 = k1 + Uint32(PHILOX_W1)
    return c0, c1, c2, c3


@dataclass(frozen=True)
class DropoutRng:
    """One CTA's Philox key, the high half of its counters (its (batch, head) stream) and the
    keep threshold."""

    k0: Uint32
    k1: Uint32
    c2: Uint32
    c3: Uint32
    threshold: Uint32

    @staticmethod
    def create(philox_seed: Int64, philox_offset: Int64, threshold: Int32, stream: Int32) -> "DropoutRng":
        counter_hi = philox_offset + Int64(stream)
        return DropoutRng(Uint32(philox_seed), Uint32(philox_seed >> 32), Uint32(counter_hi),
                          Uint32(counter_hi >> 32), Uint32(threshold))


@cute.jit
def apply_dropout(
    acc_S: cute.Tensor,
    thr_mma,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    m_block: Int32,
    n_block: Int32,
    rng: DropoutRng,
    encode_in_sign: cutlass.Constexpr[bool],
) -> None:
    acc_S_mn = reshape_acc_to_mn(acc_S)
    tScS_mn, t0ScS_mn = acc_coordinates(thr_mma, (tile_m, tile_n))
    # This thread's coordinates are thread 0's (compile time) plus these offsets, which are
    # < 8 mod 16 (rows) and even (columns) in an m16n8 accumulator: an element's place in its
    # group of four is a compile-time property.
    q_offset = tScS_mn[0][0] + m_block * tile_m
    k_offset = tScS_mn[0][1] + n_block * tile_n
    num_rows, num_cols = cute.size(acc_S_mn, mode=[0]), cute.size(acc_S_mn, mode=[1])
    for (row, col), members in _philox_groups(t0ScS_mn, num_rows, num_cols):
        i = q_offset + row
        words = philox4x32(Uint32((k_offset + col) >> 1), Uint32((i >> 4) * 8 + (i & 7)), rng.c2, rng.c3,
                           rng.k0, rng.k1)
        for r, c, w in members:
            keep = words[w] >= rng.threshold
            if cutlass.const_expr(encode_in_sign):
                acc_S_mn[r, c] = acc_S_mn[r, c] if keep else -acc_S_mn[r, c]
            else:
                acc_S_mn[r, c] = acc_S_mn[r, c] if keep else acc_S_mn.element_type(0.0)


@cute.jit
def apply_dropout_transposed(
    acc_St: cute.Tensor,
    thr_mma,
    tile_n: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
    n_block: Int32,
    m_block: Int32,
    rng: DropoutRng,
) -> None:
    """apply_dropout (sign-encoded) on S^T, keys as rows and queries as columns, as the Hopper
    backward computes it: the same Philox words per (query, key) element as the forward.

    A thread holds keys r, r + 8 and, per 16 columns, queries c, c + 1, c + 8, c + 9 (c even); a
    Philox group covers queries (i, i + 8) and keys (j, j + 1), j even, i.e. key rows that lanes 4
    apart hold. So each lane draws one group per query column pair and trades half of its words
    with lane ^ 4: the lane whose first key is even draws the pair (r, r + 1) and keeps key r's
    words, its partner the pair (r + 8, r + 9) and keeps key r + 9's (its own second row)."""
    acc_mn = reshape_acc_to_mn(acc_St)
    tScS_mn, t0ScS_mn = acc_coordinates(thr_mma, (tile_n, tile_m))
    k_offset = tScS_mn[0][0] + n_block * tile_n
    q_offset = tScS_mn[0][1] + m_block * tile_m
    odd = (k_offset & 1) == 1
    for key, query, members in _transposed_groups(t0ScS_mn, cute.size(acc_mn, mode=[0]), cute.size(acc_mn, mode=[1])):
        j = k_offset + key + 7 * (k_offset & 1)
        i = q_offset + query
        w = philox4x32(Uint32(j >> 1), Uint32((i >> 4) * 8 + (i & 7)), rng.c2, rng.c3, rng.k0, rng.k1)
        # words of (query i, key j): w[0]; (i, j + 1): w[1]; (i + 8, j): w[2]; (i + 8, j + 1): w[3]
        kept = (w[1] if odd else w[0], w[3] if odd else w[2])
        traded = (cute.arch.shuffle_sync_bfly(w[0] if odd else w[1], 4),
                  cute.arch.shuffle_sync_bfly(w[2] if odd else w[3], 4))
        # first key row: the even lane's own words, the odd lane's traded ones; the second row the reverse
        words = ((traded[0] if odd else kept[0], traded[1] if odd else kept[1]),
                 (kept[0] if odd else traded[0], kept[1] if odd else traded[1]))
        for second_row, second_col, r, c in members:
            keep = words[second_row][second_col] >= rng.threshold
            acc_mn[r, c] = acc_mn[r, c] if keep else -acc_mn[r, c]


def _transposed_groups(t0ScS_mn, num_rows: int, num_cols: int):
    """Thread 0's S^T elements by Philox group: (key, query) of the group's first element and,
    per member, (second key row, second query column, r, c) (trace time)."""
    at = {tuple(t0ScS_mn[r, c]): (r, c) for r in range(num_rows) for c in range(num_cols)}
    return [(key, query, [(dr, dc) + at[(key + 8 * dr, query + 8 * dc)] for dr in (0, 1) for dc in (0, 1)])
            for (key, query) in at if key % 16 == 0 and query % 16 < 8]


def _philox_groups(t0ScS_mn, num_rows: int, num_cols: int):
    """The (row, column) of each group of four of thread 0's elements, with the (r, c) index and
    Philox word of each member (trace time)."""
    groups = {}
    for r in range(num_rows):
        for c in range(num_cols):
            row, col = t0ScS_mn[r, c]
            di, dj = row % 16 // 8, col % 2
            groups.setdefault((row - 8 * di, col - dj), []).append((r, c, 2 * di + dj))
    return list(groups.items())


@cute.jit
def dropout_dS(p_signed: Float32, dp: Float32, dpsum: Float32, scale: Float32) -> Float32:
    # -0.0 (a dropped P of 0) counts as kept: its dS is 0 either way
    return p_signed * (dp * scale - dpsum if p_signed >= 0.0 else dpsum)
