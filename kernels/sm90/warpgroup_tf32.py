"""A TF32 warp-group MMA (wgmma.mma_async m64nNk8 .f32.tf32.tf32) for the Hopper fp32 forward.

Why this file exists: the CuTe DSL's `cute.nvgpu.warpgroup` offers 16-bit, fp8 and int8 MMA ops
but no TF32 one (TF32 is there only for mma.sync, `warp.MmaTF32Op`, and for tcgen05), and
`hopper_helpers.make_trivial_tiled_mma` rejects TF32. The IR's SM90 MMA atom takes TF32 operands
all the same; `MmaTF32Op` builds that atom the way the DSL's own `MmaF16BF16Op` builds its
16-bit one, with K fixed to 8.

What the hardware allows (PTX ISA, and the DSL's verifier says so too): TF32 operands in shared
memory must be K-major (the transpose bits exist for 16-bit types only); A may come from registers.
The tensor cores read an fp32 word as TF32 by dropping its low 13 mantissa bits (truncation, not
rounding: measured on an H200), so raw fp32 data serves as the "hi" part of a split-TF32 product
and lo = x - trunc13(x) is exact in fp32 (`tf32_lo`).

    tiled_mma_tf32(num_wg, n, a_source) -> cute.TiledMma
        num_wg warp groups stacked along M (64 rows each), N = n, K steps of 8.
    tf32_lo(x) -> Float32
        x minus x with its low 13 mantissa bits cleared: what truncating TF32 leaves out.
    tf32_hi(x) -> Float32
        x with its low 13 mantissa bits cleared (tf32_lo(x) == x - tf32_hi(x), exactly).

This leans on two DSL internals (`MmaAtomSM90Type.get` and subclassing `warpgroup.mma.MmaOp`),
which a DSL release may change: tests/cpu/test_compile_sm90_fwd_tf32.py compiles it.
"""

from __future__ import annotations

import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
from cutlass import Boolean, Float32, TFloat32
from cutlass._mlir.dialects import llvm
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.cute.nvgpu.warpgroup.mma import MmaOp, MmaTraits
from cutlass.cutlass_dsl import dsl_user_op


class MmaTF32Trait(MmaTraits):
    pass


class MmaTF32Op(MmaOp):
    """wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32: shape_mn (64, N), N a multiple of 8 up
    to 256; B (and A from smem) K-major."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, shape_mn, a_src: OperandSource, a_major_mode: OperandMajorMode = OperandMajorMode.K,
                 b_major_mode: OperandMajorMode = OperandMajorMode.K):
        assert a_major_mode == OperandMajorMode.K and b_major_mode == OperandMajorMode.K, "TF32 is K-major only"
        super().__init__(TFloat32, TFloat32, Float32, (shape_mn[0], shape_mn[1], 8), a_src, a_major_mode,
                         b_major_mode)

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type, self.a_src._to_ir(),
        )
        # The atom's one runtime field is the accumulate flag (warpgroup.Field.ACCUMULATE).
        return MmaTF32Trait(make_atom(ty, [Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


def tiled_mma_tf32(num_wg: int, n: int, a_source: OperandSource) -> cute.TiledMma:
    return cute.make_tiled_mma(MmaTF32Op((64, n), a_source), cute.make_layout((num_wg, 1, 1)))


@dsl_user_op
def tf32_lo(x: Float32, *, loc=None, ip=None) -> Float32:
    # Not pure: LLVM would sink a pure split to its use, past a GEMM issued in between, and keep x
    # live across it (the 16-bit forward's convert_P has the same reason).
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 bits;\n.reg .f32 hi;\nmov.b32 bits, $1;\nand.b32 bits, bits, 0xFFFFE000;\n"
        "mov.b32 hi, bits;\nsub.f32 $0, $1, hi;\n}",
        "=f,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def tf32_hi(x: Float32, *, loc=None, ip=None) -> Float32:
    # x with its low 13 mantissa bits cleared: the TF32 value the tensor cores read from x. Used
    # where the hi part must live in registers of its own: a wgmma's register A operand must not
    # share registers with another wgmma's accumulator (P read in place from the S accumulator),
    # or ptxas serializes every wgmma of the kernel (C7511); a plain copy would be coalesced away.
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 bits;\nmov.b32 bits, $1;\nand.b32 bits, bits, 0xFFFFE000;\nmov.b32 $0, bits;\n}",
        "=f,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))
