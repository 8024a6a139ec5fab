"""How tensors cross into compiled kernels.

Kernels are compiled once per compile key against *fake* tensors whose batch, sequence and
head extents and strides are symbolic, so one compiled kernel serves every size. Kernels are compiled
with TVM-FFI, so at call time framework tensors (torch, or anything speaking DLPack) are passed
as they are: TVM-FFI checks dtype, rank, static extents, device and alignment and reads the
dynamic extents and strides, in a few microseconds. The head dimension is the one static extent (stride 1); every other stride must be a
multiple of 8 elements (16 bytes) so 128-bit vector copies stay legal.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

VECTOR_BYTES = 16


def _sym_extent() -> cute.typing.SymInt:
    return cute.sym_int32()


def _sym_stride(dtype: type[cutlass.Numeric]) -> cute.typing.SymInt:
    return cute.sym_int64(divisibility=VECTOR_BYTES * 8 // dtype.width)


def fake_bshd(dtype: type[cutlass.Numeric], head_dim: int) -> cute.Tensor:
    """A (batch, seqlen, nheads, head_dim) operand: q, k, v, out and their gradients."""
    shape = (_sym_extent(), _sym_extent(), _sym_extent(), head_dim)
    stride = (_sym_stride(dtype), _sym_stride(dtype), _sym_stride(dtype), 1)
    return make_fake_tensor(dtype, shape, stride, assumed_align=VECTOR_BYTES)


def fake_rowstat(dtype: type[cutlass.Numeric] = cutlass.Float32, align: int = 4) -> cute.Tensor:
    """A (batch, nheads, seqlen) per-row statistic such as the log-sum-exp. `align` 16: a
    row-padded buffer the launcher allocates (TMA reads it: 16-byte base and strides)."""
    shape = (_sym_extent(), _sym_extent(), _sym_extent())
    divisibility = {} if align == 4 else dict(divisibility=align // 4)
    stride = (cute.sym_int64(**divisibility), cute.sym_int64(**divisibility), 1)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_tail_split_workspace(head_dim: int) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
    """The sm90 forward's tail-split workspace: O (pieces, tile_m, head_dim) and LSE (pieces, tile_m)
    of every piece in float32, and the int32 counters: one per split tile, then the dynamic
    schedule's."""
    # Rows of 16-byte vectors (the merge reads them so); head_dim is a multiple of 8.
    o = make_fake_tensor(cutlass.Float32, (_sym_extent(), _sym_extent(), head_dim),
                         (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1), assumed_align=16)
    lse = make_fake_tensor(cutlass.Float32, (_sym_extent(), _sym_extent()), (cute.sym_int64(), 1), assumed_align=4)
    count = make_fake_tensor(cutlass.Int32, (_sym_extent(),), (1,), assumed_align=4)
    return o, lse, count


def fake_stream():
    """The stream parameter. Compiled functions take it from the caller's framework (the current
    torch stream) through TVM-FFI, so it is not passed at call time."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def fake_semaphore() -> cute.Tensor:
    """(batch, nheads, num_m_blocks) int32 counters for the sm80 backward's deterministic dQ order."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    return make_fake_tensor(cutlass.Int32, shape, (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def fake_dq_accum() -> cute.Tensor:
    """(batch, nheads, query blocks * block elements) float32 dQ workspace (kernels/sm80/bwd.py)."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)
    return make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=16)


def fake_score_mods(window: bool, softcap: bool, alibi: bool) -> tuple:
    """`call_with_mods`' window sides, softcap, (1 or batch, nheads) fp32 slopes; None where off."""
    return ((cutlass.Int32(0),) * 2 if window else (None, None)) + (cutlass.Float32(1.0) if softcap else None, (
        make_fake_tensor(cutlass.Float32, (_sym_extent(), _sym_extent()), (cute.sym_int64(), 1), assumed_align=4) if alibi
        else None))


def fake_dropout_args(dropout: bool) -> tuple:
    """`call_with_mods`' dropout arguments: Philox seed and offset, keep threshold, 1 / (1 - p); None where off."""
    return (cutlass.Int64(0), cutlass.Int64(0), cutlass.Int32(0), cutlass.Float32(1.0)) if dropout else (None,) * 4


def fake_int32_vector() -> cute.Tensor:
    """(batch,) int32 per-sequence values: the decode kernel's key counts and cache entries."""
    return make_fake_tensor(cutlass.Int32, (_sym_extent(),), (1,), assumed_align=4)


def fake_block_table() -> cute.Tensor:
    """(batch, max_pages) int32 page indices of a paged KV cache."""
    return make_fake_tensor(cutlass.Int32, (_sym_extent(), _sym_extent()), (cute.sym_int64(), 1), assumed_align=4)


def fake_keys_major(dtype: type[cutlass.Numeric], head_dim: int) -> cute.Tensor:
    """A (batch, nheads_kv, head_dim, seqlen_k padded) operand, keys contiguous: the Hopper fp32
    forward's V^T workspace (kernels/sm90/fwd_tf32_prep.py). TMA reads it: 16-byte strides."""
    shape = (_sym_extent(), _sym_extent(), head_dim, _sym_extent())
    stride = (_sym_stride(dtype), _sym_stride(dtype), _sym_stride(dtype), 1)
    return make_fake_tensor(dtype, shape, stride, assumed_align=VECTOR_BYTES)
