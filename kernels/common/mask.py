"""Masking and biasing of a score accumulator: key-length bound, bottom-right aligned causal mask,
sliding window; softcap and ALiBi.

    apply_mask(acc_S, thr_mma, tile_m, tile_n, m_block, n_block, seqlen_q, seqlen_k,
               mask_seqlen: Constexpr[bool], mask_causal: Constexpr[bool],
               transposed: Constexpr[bool] = False, branchless: Constexpr[bool] = True,
               window: (left, right) Int32 pair or None)

        acc_S   this thread's accumulator of the (tile_m, tile_n) score tile S[m_block, n_block]
                (or of S^T, shape (tile_n, tile_m), when `transposed`), in any layout that
                `layouts.reshape_acc_to_mn` understands.
        thr_mma the thread slice of the tiled MMA that produced acc_S; the coordinates of the
                elements come from partitioning an identity tensor of the tile with it.
        Sets to -inf every score whose key index j >= seqlen_k (mask_seqlen) or, with
        mask_causal, whose key lies right of the diagonal: j > i + seqlen_k - seqlen_q for query
        index i. Rows with i >= seqlen_q are not touched (their outputs are never stored).

        With `window` (flash-attn 2's rule, blocks.py), also every score outside
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (mask_causal is
        then False: causal windows come as right = 0).

Call it only on boundary blocks (see blocks.py); interior blocks need no mask at all.

    apply_softcap(acc_S, softcap_pre)
        acc_S <- tanh(acc_S * softcap_pre) on every score. With softcap_pre = softmax_scale / softcap
        and the softmax run at scale `softcap`, the scores become softcap * tanh(scale * s / softcap),
        flash-attn 2's parametrization. tanh from ex2.approx and rcp.approx (tanh_from_exp2):
        absolute error ~1e-7, where tanh.approx.f32 errs ~5e-4 relative, 0.025 at softcap 50.

    softcap_grad(acc_S) -> fragment of 1 - t^2 for t = acc_S (the backward's dS factor).

    score_scale, mods = kernel_mod_args(window, softcap, alibi, softmax_scale, window_left, window_right,
                                        softcap_value, mAlibiSlopes, dropout, dropout_args)
        Host side: the scale the softmax applies (softcap with softcap, else softmax_scale) and the
        kernel's keyword arguments for the switches that are on (window_left / window_right,
        softcap_pre, mAlibiSlopes with alibi_scale = -1 / score_scale; with dropout philox_seed,
        philox_offset, dropout_threshold, dropout_scale from dropout_args, kernels/common/philox.py).

    apply_alibi(acc_S, thr_mma, tile_m, tile_n, m_block, n_block, seqlen_q, seqlen_k, slope,
                transposed: Constexpr[bool] = False)
        acc_S += slope * |i + seqlen_k - seqlen_q - j| (slope = -alibi_slope / the softmax's scale,
        so the bias is -alibi_slope * |...| once scaled), on every score of a visible block.
Column indices are compared against thread 0's compile-time coordinates shifted by this thread's
offset, so each comparison is against an immediate.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layouts import acc_coordinates, reshape_acc_to_mn
from .softmax import LOG2_E


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
    window=None,
) -> None:
    acc_S_mn = reshape_acc_to_mn(acc_S)
    tile = (tile_m, tile_n) if cutlass.const_expr(not transposed) else (tile_n, tile_m)
    tScS_mn, t0ScS_mn = acc_coordinates(thr_mma, tile)
    Q = 0 if cutlass.const_expr(not transposed) else 1  # coordinate holding the query index
    K = 1 - Q
    num_rows = cute.size(tScS_mn, mode=[0])
    num_cols = cute.size(tScS_mn, mode=[1])
    k_offset = tScS_mn[0][K] + n_block * tile_n  # this thread's first key index
    q_offset = tScS_mn[0][Q] + m_block * tile_m  # this thread's first query index
    # key index of element (r, c) = k_offset + t0 key coordinate (compile time), and likewise
    # for queries; so limits are shifted by the offsets once.
    k_limit_seqlen = seqlen_k - k_offset
    if cutlass.const_expr(window is not None):
        left, right = window
        # key j visible from query i iff lo <= j - i < hi; both sides shifted by the offsets, so
        # that each element compares its compile-time (key - query) coordinate difference
        diag = q_offset + seqlen_k - seqlen_q - k_offset
        lo = diag - left
        hi = diag + right + 1
        for r in cutlass.range_constexpr(num_rows):
            for c in cutlass.range_constexpr(num_cols):
                q_t0 = t0ScS_mn[r, c][Q]
                k_t0 = t0ScS_mn[r, c][K]
                hidden = (k_t0 - q_t0 >= hi) | (k_t0 - q_t0 < lo)
                if cutlass.const_expr(mask_seqlen):
                    hidden = hidden | (k_t0 >= k_limit_seqlen)
                _mask_one(acc_S_mn, r, c, hidden, branchless)
    elif cutlass.const_expr(not mask_causal):
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


def kernel_mod_args(window: bool, softcap: bool, alibi: bool, softmax_scale, window_left, window_right,
                    softcap_value, mAlibiSlopes, dropout: bool = False, dropout_args=(None,) * 4):
    score_scale = softcap_value if softcap else softmax_scale
    mods = {}
    if window:
        mods.update(window_left=window_left, window_right=window_right)
    if softcap:
        mods.update(softcap_pre=softmax_scale / softcap_value)
    if alibi:
        mods.update(mAlibiSlopes=mAlibiSlopes, alibi_scale=-1.0 / score_scale)
    if dropout:
        mods.update(zip(("philox_seed", "philox_offset", "dropout_threshold", "dropout_scale"), dropout_args))
    return score_scale, mods


@cute.jit
def tanh_from_exp2(x: Float32) -> Float32:
    """tanh(x) = 1 - 2 / (exp(2x) + 1): exact at the limits (exp2 overflow gives 1, underflow -1)."""
    return 1.0 - 2.0 * cute.arch.rcp_approx(cute.math.exp2(x * (2.0 * LOG2_E), fastmath=True) + 1.0)


@cute.jit
def apply_softcap(acc_S: cute.Tensor, softcap_pre: Float32) -> None:
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        acc_S[i] = tanh_from_exp2(acc_S[i] * softcap_pre)


@cute.jit
def softcap_grad(acc_S: cute.Tensor) -> cute.Tensor:
    grad = cute.make_rmem_tensor_like(acc_S, Float32)
    grad.store(1.0 - acc_S.load() * acc_S.load())
    return grad


def alibi_head_slope(mAlibiSlopes, alibi_scale, batch, head):
    """(batch, head)'s ALiBi slope times alibi_scale (kernel_mod_args), None for a kernel without
    ALiBi. (nheads,) slopes arrive as one row shared by the batch."""
    if mAlibiSlopes is None:
        return None
    return mAlibiSlopes[cutlass.min(batch, mAlibiSlopes.shape[0] - 1), head] * alibi_scale


@cute.jit
def apply_alibi(
    acc_S: cute.Tensor,
    thr_mma,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    slope: Float32,
    transposed: cutlass.Constexpr[bool] = False,
) -> None:
    acc_S_mn = reshape_acc_to_mn(acc_S)
    tile = (tile_m, tile_n) if cutlass.const_expr(not transposed) else (tile_n, tile_m)
    tScS_mn, t0ScS_mn = acc_coordinates(thr_mma, tile)
    Q = 0 if cutlass.const_expr(not transposed) else 1  # coordinate holding the query index
    K = 1 - Q
    # i + seqlen_k - seqlen_q - j = shift + (compile-time query - key of thread 0's element)
    # (exact in float32 below 2^24)
    shift = Float32((tScS_mn[0][Q] + m_block * tile_m + seqlen_k - seqlen_q) - (tScS_mn[0][K] + n_block * tile_n))
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            distance = shift + float(t0ScS_mn[r, c][Q] - t0ScS_mn[r, c][K])
            acc_S_mn[r, c] = acc_S_mn[r, c] + slope * cutlass.max(distance, -distance)
