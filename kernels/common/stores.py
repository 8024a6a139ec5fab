"""Fp32 accumulator tiles out to memory, shared by the backward kernels of both families: converted
into a swizzled smem tile as pairs of elements (stage_acc_in_smem), then out as 16-byte vectors
(store_smem_tile), or both (store_acc_via_smem); or straight from registers, two elements per
store (store_acc). Rows at or past `rows_left` and columns past `head_dim` are never written."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def store_acc_via_smem(acc: cute.Tensor, sX: cute.Tensor, gX: cute.Tensor, tiled_mma: cute.TiledMma,
                       s2g: cute.TiledCopy, rows_left: Int32, head_dim: cutlass.Constexpr[int], tidx: Int32):
    """An fp32 accumulator tile -> gX (16-bit) through the swizzled smem tile sX: pairs of
    elements into smem in the accumulator layout, then 16-byte vectors out (the accumulator
    layout alone allows only 4-byte global stores). The caller makes sure no thread still reads
    sX; rows at or past `rows_left` and columns past `head_dim` are not written."""
    stage_acc_in_smem(acc, sX, tiled_mma, tidx)
    cute.arch.barrier()
    store_smem_tile(sX, gX, s2g, rows_left, head_dim, tidx)


@cute.jit
def stage_acc_in_smem(acc: cute.Tensor, sX: cute.Tensor, tiled_mma: cute.TiledMma, tidx: Int32):
    """An fp32 accumulator tile, converted, into the smem tile sX as pairs of elements."""
    rX = cute.make_fragment_like(acc, sX.element_type)
    rX.store(acc.load().to(sX.element_type))
    r2s = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sX.element_type, num_bits_per_copy=2 * sX.element_type.width),
        tiled_mma,
    ).get_slice(tidx)
    cute.copy(r2s, r2s.retile(rX), r2s.partition_D(sX))


@cute.jit
def store_smem_tile(sX: cute.Tensor, gX: cute.Tensor, s2g: cute.TiledCopy, rows_left: Int32,
                    head_dim: cutlass.Constexpr[int], tidx: Int32):
    """sX -> gX as 16-byte vectors, without rows at or past `rows_left` or columns past `head_dim`."""
    thr_s2g = s2g.get_slice(tidx)
    tXsX = thr_s2g.partition_S(sX)
    tXgX = thr_s2g.partition_D(gX)
    tXcX = thr_s2g.partition_S(cute.make_identity_tensor(gX.shape))
    for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        for c in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
            coord = tXcX[0, r, c]
            if coord[0] < rows_left and coord[1] < head_dim:
                cute.copy(s2g, tXsX[None, r, c], tXgX[None, r, c])


@cute.jit
def store_acc(acc: cute.Tensor, gX: cute.Tensor, tiled_mma: cute.TiledMma, rows_left: Int32,
              head_dim: cutlass.Constexpr[int], tidx: Int32):
    """An fp32 accumulator tile -> gX in gX's dtype, two elements per store; rows at or past
    `rows_left` and columns past `head_dim` (the padding of the tile) are skipped."""
    out_dtype = gX.element_type
    rX = cute.make_fragment_like(acc, out_dtype)
    rX.store(acc.load().to(out_dtype))
    r2g = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=2 * out_dtype.width),
        tiled_mma,
    ).get_slice(tidx)
    tXrX = r2g.retile(rX)
    tXgX = r2g.partition_D(gX)
    tXcX = r2g.partition_D(cute.make_identity_tensor(gX.shape))
    # One predicate per store: an accumulator holds rows r and r + 8 of each m16 atom, so
    # every (atom_rest, m, n) position is checked on its own.
    pred = cute.make_rmem_tensor(
        cute.make_layout((cute.size(tXgX, mode=[0, 1]), cute.size(tXgX, mode=[1]), cute.size(tXgX, mode=[2]))),
        cutlass.Boolean,
    )
    for v in cutlass.range_constexpr(cute.size(pred, mode=[0])):
        for i in cutlass.range_constexpr(cute.size(pred, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(pred, mode=[2])):
                coord = tXcX[(0, v), i, j]
                pred[v, i, j] = coord[0] < rows_left and coord[1] < head_dim
    cute.copy(r2g, tXrX, tXgX, pred=pred)
