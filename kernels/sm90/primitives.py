"""Small device-side pieces of the Hopper kernels: pipeline waits, asm helpers, one wgmma GEMM."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op


# Named barrier ids (0 is __syncthreads). Consumer warp group i waits on TURN_BARRIER_BASE + i for
# its turn to issue GEMMs (ping-pong); EPILOGUE_BARRIER (+ the group's index when each group stores
# its own rows) orders the epilogue's smem use; SPLIT_BARRIER brackets a tail piece's hand-off.
EPILOGUE_BARRIER = 1
TURN_BARRIER_BASE = 4
SPLIT_BARRIER = 8

# L2 eviction priorities of TMA's .L2::cache_hint operand (createpolicy encodings): Q and O pass
# through once, K/V serve every m_block of their head.
L2_EVICT_FIRST = 0x12F0000000000000
L2_EVICT_LAST = 0x14F0000000000000


def l2_hint(enabled: bool, policy: int) -> dict:
    """cute.copy's keyword for a TMA copy's L2 eviction priority (config.cache_hints), else none."""
    return dict(cache_policy=cutlass.Int64(policy)) if const_expr(enabled) else {}


def wait_full(pipe, state, spin: bool):
    """consumer_wait, as a plain try_wait loop (spin_wait) when `spin` (config.spin_waits): the
    DSL's wait carries a suspend-time hint that becomes a NANOSLEEP.SYNCS which wakes late."""
    if const_expr(spin):
        spin_wait(pipe.sync_object_full.get_barrier(state.index), state.phase)
    else:
        pipe.consumer_wait(state)


def acquire_empty(pipe, state, spin: bool):
    """producer_acquire, its empty-slot wait a plain try_wait loop when `spin`."""
    if const_expr(spin):
        spin_wait(pipe.sync_object_empty.get_barrier(state.index), state.phase)
        pipe.producer_acquire(state, True)
    else:
        pipe.producer_acquire(state)


@dsl_user_op
def spin_wait(mbar_ptr: cute.Pointer, phase: Int32, *, loc=None, ip=None) -> None:
    """Wait for the mbarrier phase with mbarrier.try_wait and no suspend-time hint, in a loop (a
    memory clobber keeps the compiler from moving loads of what the barrier guards above it)."""
    llvm.inline_asm(
        None, [mbar_ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred ready;\nwait_again:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [$0], $1;\n"
        "@!ready bra wait_again;\n}",
        "r,r,~{memory}", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def opaque_i32(value: Int32, *, loc=None, ip=None) -> Int32:
    """`value`, through an asm move the compiler cannot see through."""
    return Int32(llvm.inline_asm(
        cutlass.Int32.mlir_type, [Int32(value).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1; // opaque_i32", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def opaque_f32(value: Float32, *, loc=None, ip=None) -> Float32:
    """`value`, through an asm move with side effects: LLVM cannot sink it past later asm."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(value).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1; // opaque_f32", "=f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def f32_after(value: Float32, dependency: Float32, *, loc=None, ip=None) -> Float32:
    """`value` (exactly, for a finite `dependency`), as fma(dependency, 0, value) in asm: code that
    uses the result cannot be scheduled before `dependency` is available, e.g. before the
    wgmma.wait_group that guards an accumulator, which ptxas otherwise places where it likes."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type,
        [Float32(value).ir_value(loc=loc, ip=ip), Float32(dependency).ir_value(loc=loc, ip=ip)],
        "fma.rn.f32 $0, $2, 0f00000000, $1;", "=f,f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def role_namespace(handles: dict | None) -> SimpleNamespace | None:
    """The producer's or the consumers' own namespace of shared handles: the tracer rebinds the
    fields of a namespace that a staged loop carries, and the other role's branch must not see
    values defined inside the first one's loop."""
    return None if handles is None else SimpleNamespace(**handles)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr):
    """Issue one warp-group GEMM (all k-blocks) as one wgmma commit group; does not wait."""
    warpgroup.fence()
    # A fresh atom carries the accumulate flag: setting it on the shared tiled MMA inside a
    # staged loop would leak a loop-local value into later uses of that tiled MMA.
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init or k != 0)
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
    warpgroup.commit_group()
