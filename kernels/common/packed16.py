"""Pairs of fp16/bf16 values packed in one 32-bit register, where the DSL's own conversion does not
give the code we need (written as PTX; used by the sm90 forward's P conversion):

    convert_f32_to_16bit(src, dst)   dst <- src rounded to fp16/bf16, pinned where it is written
    cvt_pack_16bit(lo, hi, dtype)    two floats -> one packed pair (lo in bits 0-15)
    as_int32_pairs(t)                a compact 16-bit register fragment seen as its 32-bit pairs
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _pair_type(dtype) -> str:
    return "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"


@dsl_user_op
def cvt_pack_16bit(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Two floats rounded to fp16/bf16 and packed into one 32-bit register (lo in bits 0-15).

    An asm statement with side effects: LLVM keeps it where it is written. A pure conversion is
    sunk to its first use, which in the Hopper forward lies past the next S GEMM and keeps the old
    fp32 S live across it (see `convert_P` in kernels/sm90/fwd.py).
    """
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{_pair_type(dtype)}.f32 $0, $2, $1;",  # the first source goes to the upper half
        "=r,f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def as_int32_pairs(t: cute.Tensor) -> cute.Tensor:
    """The compact 16-bit register fragment `t` as a flat tensor of its packed 32-bit pairs."""
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Int32), cute.make_layout(cute.size(t) // 2))


@cute.jit
def convert_f32_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """dst <- src rounded to dst's 16-bit type, register offset k to register offset k.

    Both are compact register fragments; the P fragment of an RS wgmma has the same register
    order as the S accumulator, so no layout is needed, only the flat offsets.
    """
    n = cute.size(src)
    assert cute.cosize(src.layout) == n and cute.cosize(dst.layout) == n and n % 2 == 0
    src_flat = cute.make_tensor(src.iterator, cute.make_layout(n))
    dst_pairs = as_int32_pairs(dst)
    for i in cutlass.range_constexpr(n // 2):
        dst_pairs[i] = cvt_pack_16bit(src_flat[2 * i], src_flat[2 * i + 1], dst.element_type)
