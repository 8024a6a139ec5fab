"""Split TF32: fp32 products on TF32 tensor cores (mma.sync m16n8k8) with fp32-grade accuracy.

A TF32 operand keeps 10 explicit mantissa bits, so one TF32 product of fp32 inputs errs by about
2^-11 relative. Each fp32 operand x is split into x = hi + lo with hi = tf32(x) (round to nearest,
ties away: `cvt.rna.tf32.f32`) and lo = tf32(x - hi); then

    a b  ~  a_hi b_hi + a_hi b_lo + a_lo b_hi        (the dropped a_lo b_lo is ~2^-22 relative)

three m16n8k8 TF32 MMAs into one fp32 accumulator per pair of fragments. With one product
(`products=1`: torch.get_float32_matmul_precision() "high" or "medium", as torch's own fp32
matmuls take it) only a_hi b_hi runs: plain TF32, ~2^-11 relative per product, a third of the MMAs.

    tiled_mma_tf32(atoms_m, atoms_n) -> cute.TiledMma
        m16n8k8 TF32 mma.sync over atoms_m x atoms_n warps, with each k8 step's k index permuted so
        that a thread's two k values of an A or B fragment are neighbours (k = 2t, 2t + 1 of the
        step) -- the same columns an m16n8 accumulator gives that thread. So an accumulator
        (the forward's P) is the A operand of the next product without any data movement
        (`acc_as_frgA`), and the scalar smem reads of a K-major operand fall on neighbouring words.

    acc_as_frgA(acc) -> cute.Tensor
        An m16n8 accumulator fragment ((2, 2), MMA_M, MMA_N) of this tiled MMA viewed as the A
        operand ((2, 2), MMA_M, MMA_K = MMA_N) of a product over its columns.

    split_tf32(src, hi, lo)
        hi, lo <- the split of the fp32 fragment src (TFloat32 fragments of the same size).

    gemm_split_tf32(tiled_mma, acc, tCsB, tCsA=None, tCrA=None, fresh_sum=False, products=3)
        acc += A @ B^T, three TF32 products per k step (one with products=1); fresh_sum sums them apart from acc first
        (for accumulators carried across many calls: dK, dV over query blocks, O over key blocks).
        B (and A unless tCrA, the fp32 A fragment in registers, is given) is read from smem through the MMA's own partition
        (thr_mma.partition_A / partition_B of the smem tile): 32-bit loads, conflict-free on the
        32-bit swizzle of `layouts.smem_layout_atom`.

    MmaOperandReader(thr_mma, "A" or "B", products=3)
        Stands where a kernel holds an ldmatrix copy for 16-bit operands: its partition_S(tile) is
        the MMA's own partition of the smem tile, the view gemm_split_tf32 reads; it carries the
        product count for the GEMMs that read through it.

    round_tf32(x) -> Float32
        x rounded to TF32 (low 13 mantissa bits zero), as an fp32 value.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, TFloat32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warp
from cutlass.cutlass_dsl import T, dsl_user_op

N_CHUNK = 4  # at most this many B atoms loaded and split together (gemm_split_tf32)


def tiled_mma_tf32(atoms_m: int, atoms_n: int) -> cute.TiledMma:
    # k within an 8-wide step: MMA k index i0 + 4 i1 (thread t holds i0 = t, i1 = 0 and 1) reads
    # column 2 i0 + i1, i.e. thread t holds columns 2t and 2t + 1.
    k_permutation = cute.make_layout((4, 2), stride=(2, 1))
    return cute.make_tiled_mma(
        warp.MmaTF32Op((16, 8, 8)),
        (atoms_m, atoms_n, 1),
        permutation_mnk=(atoms_m * 16, atoms_n * 8, k_permutation),
    )


def acc_as_frgA(acc: cute.Tensor) -> cute.Tensor:
    # Accumulator values (column pair c, row half r) are A values (row half r, k half c): with the
    # k permutation above both name columns 2t + c of rows g + 8r, so only the value mode turns.
    layout = acc.layout
    (c_shape, r_shape), (c_stride, r_stride) = layout.shape[0], layout.stride[0]
    frg = cute.make_layout(
        ((r_shape, c_shape), layout.shape[1], layout.shape[2]),
        stride=((r_stride, c_stride), layout.stride[1], layout.stride[2]),
    )
    return cute.make_tensor(acc.iterator, frg)


class MmaOperandReader:
    def __init__(self, thr_mma, operand: str, products: int = 3):
        assert operand in ("A", "B") and products in (1, 3)
        self.thr_mma = thr_mma
        self.operand = operand
        self.products = products

    def partition_S(self, tile: cute.Tensor) -> cute.Tensor:
        if self.operand == "A":
            return self.thr_mma.partition_A(tile)
        return self.thr_mma.partition_B(tile)


@dsl_user_op
def round_tf32(x: Float32, *, loc=None, ip=None) -> Float32:
    bits = cute.arch.cvt_f32_tf32(Float32(x), loc=loc, ip=ip)
    return Float32(llvm.bitcast(T.f32(), bits, loc=loc, ip=ip))


@cute.jit
def split_tf32(src: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
    for i in cutlass.range_constexpr(cute.size(src)):
        x = src[i]
        x_hi = round_tf32(x)
        hi[i] = TFloat32(x_hi)
        lo[i] = TFloat32(round_tf32(x - x_hi))


@cute.jit
def _tf32_parts(x: cute.Tensor, products: cutlass.Constexpr[int]):
    """The fp32 fragment's TF32 operands: (hi, lo) for split TF32, (x rounded, None) for plain."""
    hi = cute.make_rmem_tensor(x.shape, TFloat32)
    if cutlass.const_expr(products == 1):
        for i in cutlass.range_constexpr(cute.size(x)):
            hi[i] = TFloat32(round_tf32(x[i]))
        return hi, None
    lo = cute.make_rmem_tensor(x.shape, TFloat32)
    split_tf32(x, hi, lo)
    return hi, lo


@cute.jit
def _load_parts(tCsX_k: cute.Tensor, products: cutlass.Constexpr[int]):
    x = cute.make_rmem_tensor(tCsX_k.shape, Float32)
    cute.autovec_copy(tCsX_k, x)
    return _tf32_parts(x, products)


@cute.jit
def gemm_split_tf32(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCsB: cute.Tensor,
                    tCsA: cute.Tensor | None = None, tCrA: cute.Tensor | None = None, fresh_sum: bool = False,
                    products: cutlass.Constexpr[int] = 3):
    # The tensor cores add into their fp32 accumulator without rounding to nearest, an error that
    # grows with every product added, one way: an accumulator carried over thousands of keys (dK,
    # dV) drifts by ~1e-4 of its size. With fresh_sum this call's products go into a zeroed
    # accumulator, added to acc with one rounded fp32 add each.
    target = acc
    if cutlass.const_expr(fresh_sum):
        target = cute.make_fragment_like(acc)
        target.fill(0.0)
    # B is read and split N_CHUNK atoms at a time: a whole k step of a wide B (P V at d = 256:
    # 32 atoms, 64 values, 128 with hi and lo) would not fit next to acc_O. The backward's dK and
    # dV products (fresh_sum, A from smem) read their whole k step: chunked, the d = 256 kernel for
    # sm_90a spilled 32 bytes; whole, none (ptxas, 2026-11-28). The forward's P V (fresh_sum, A in
    # registers) reads chunks: whole, its 64 x 64 tiles spilled.
    num_n = cute.size(tCsB, mode=[1])
    chunk = num_n if cutlass.const_expr(fresh_sum and tCrA is None) else next(
        c for c in range(min(num_n, N_CHUNK), 0, -1) if num_n % c == 0)
    target_chunks = cute.logical_divide(target, (None, None, chunk))
    tCsB_chunks = cute.logical_divide(tCsB, (None, chunk, None))
    for k in cutlass.range_constexpr(cute.size(tCsB, mode=[2])):
        if cutlass.const_expr(tCrA is not None):
            a_hi, a_lo = _tf32_parts(tCrA[None, None, k], products)
        else:
            a_hi, a_lo = _load_parts(tCsA[None, None, k], products)
        for j in cutlass.range_constexpr(num_n // chunk):
            b_hi, b_lo = _load_parts(tCsB_chunks[None, (None, j), k], products)
            acc_j = target_chunks[None, None, (None, j)]
            if cutlass.const_expr(products == 3):
                # small terms first: they are added before the large one moves the accumulator
                cute.gemm(tiled_mma, acc_j, a_lo, b_hi, acc_j)
                cute.gemm(tiled_mma, acc_j, a_hi, b_lo, acc_j)
            cute.gemm(tiled_mma, acc_j, a_hi, b_hi, acc_j)
    if cutlass.const_expr(fresh_sum):
        acc.store(acc.load() + target.load())
