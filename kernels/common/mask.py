"""Masking of a score accumulator: key-length bound and bottom-right aligned causal mask.

    apply_mask(acc_S, thr_mma, tile_m, tile_n, m_block, n_block, seqlen_q, seqlen_k,
               mask_seqlen: Constexpr[bool], mask_causal: Constexpr[bool],
               transposed: Constexpr[bool] = False)

        acc_S   this thread's accumulator of the (tile_m, tile_n) score tile S[m_block, n_block]
                (or of S^T, shape (tile_n, tile_m), when `transposed`), in any layout that
                `layouts.reshape_acc_to_mn` understands.
        thr_mma the thread slice of the tiled MMA that produced acc_S; the coordinates of the
                elements come from partitioning an identity tensor of the tile with it.
        Sets to -inf every score whose key index j >= seqlen_k (mask_seqlen) or, with
        mask_causal, whose key lies right of the diagonal: j > i + seqlen_k - seqlen_q for query
        index i. Rows with i >= seqlen_q are not touched (their outputs are never stored).

Call it only on boundary blocks (see blocks.py); interior blocks need no mask at all.
Column indices are compared against thread 0's compile-time coordinates shifted by this thread's
offset, so each comparison is against an immediate.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layouts import reshape_acc_to_mn


@cute.jit
def apply_mask(
    acc_S: cute.Tensor,
    thr_mma,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_causal: cutlass.Constexpr[bool],
    transposed: cutlass.Constexpr[bool] = False,
    branchless: cutlass.Constexpr[bool] = True,
) -> None:
    acc_S_mn = reshape_acc_to_mn(acc_S)
    tile = (tile_m, tile_n) if cutlass.const_expr(not transposed) else (tile_n, tile_m)
    cS = cute.make_identity_tensor(tile)
    tScS_mn = reshape_acc_to_mn(thr_mma.partition_C(cS))
    t0ScS_mn = reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS))
    Q = 0 if cutlass.const_expr(not transposed) else 1  # coordinate holding the query index
    K = 1 - Q
    num_rows = cute.size(tScS_mn, mode=[0])
    num_cols = cute.size(tScS_mn, mode=[1])
    k_offset = tScS_mn[0][K] + n_block * tile_n  # this thread's first key index
    q_offset = tScS_mn[0][Q] + m_block * tile_m  # this thread's first query index
    # key index of element (r, c) = k_offset + t0 key coordinate (compile time), and likewise
    # for queries; so limits are shifted by the offsets once.
    k_limit_seqlen = seqlen_k - k_offset
    if cutlass.const_expr(not mask_causal):
        if cutlass.const_expr(mask_seqlen):
            if cutlass.const_expr(not transposed):
                for c in cutlass.range_constexpr(num_cols):
                    oob = t0ScS_mn[0, c][K] >= k_limit_seqlen
                    for r in cutlass.range_constexpr(num_rows):
                        _mask_one(acc_S_mn, r, c, oob, branchless)
            else:
                for r in cutlass.range_constexpr(num_rows):
                    oob = t0ScS_mn[r, 0][K] >= k_limit_seqlen
                    for c in cutlass.range_constexpr(num_cols):
                        _mask_one(acc_S_mn, r, c, oob, branchless)
    else:
        # key j visible from query i iff j < i + 1 + seqlen_k - seqlen_q
        diag = q_offset + 1 + seqlen_k - seqlen_q - k_offset
        if cutlass.const_expr(not transposed):
            for r in cutlass.range_constexpr(num_rows):
                k_limit = diag + t0ScS_mn[r, 0][Q]
                if cutlass.const_expr(mask_seqlen):
                    k_limit = cutlass.min(k_limit, k_limit_seqlen)
                for c in cutlass.range_constexpr(num_cols):
                    _mask_one(acc_S_mn, r, c, t0ScS_mn[0, c][K] >= k_limit, branchless)
        else:
            for c in cutlass.range_constexpr(num_cols):
                k_limit = diag + t0ScS_mn[0, c][Q]
                if cutlass.const_expr(mask_seqlen):
                    k_limit = cutlass.min(k_limit, k_limit_seqlen)
                for r in cutlass.range_constexpr(num_rows):
                    _mask_one(acc_S_mn, r, c, t0ScS_mn[r, 0][K] >= k_limit, branchless)


@cute.jit
def _mask_one(acc_S_mn: cute.Tensor, r: int, c: int, hidden, branchless: cutlass.Constexpr[bool]) -> None:
    """acc_S_mn[r, c] = -inf where `hidden`. `branchless` compiles to one select per element,
    which keeps the sm90 forward's score registers few (a branch per element had become a
    chain of selects that kept the unmasked scores live); the sm80 backward, at 255
    registers, allocates better with the branch."""
    if cutlass.const_expr(branchless):
        acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]
    else:
        if hidden:
            acc_S_mn[r, c] = -Float32.inf
