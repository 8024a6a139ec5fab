"""Host side of the sm_80 backward: workspaces, compiled kernels, three launches.

    preprocess   D = rowsum(dO * O), LSE * log2(e)           (kernels/sm80/bwd_pre.py)
    main         dK, dV per key block; dQ into fp32 accum     (kernels/sm80/bwd.py)
    postprocess  dQ = scale * dQaccum in the input dtype      (kernels/sm80/bwd_post.py)

With grouped-query attention the main kernel writes per-query-head fp32 dK/dV and the groups are
summed here (a fixed-order torch reduction, so deterministic mode stays bit-reproducible).
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from cute_flash.cache import get_or_compile
from cute_flash.dispatch import CUTLASS_DTYPES, target_arch
from cute_flash.kernels.common.layouts import round_up
from cute_flash.kernels.sm80.bwd import FlashAttnBwdSm80
from cute_flash.kernels.sm80.bwd_post import FlashAttnBwdPostprocessSm80
from cute_flash.kernels.sm80.bwd_pre import FlashAttnBwdPreprocessSm80
from cute_flash.tensors import fake_bshd, fake_rowstat, fake_stream


# Row statistics are padded to a multiple of every m_block size the main kernel may use.
ROW_PAD = 128


def fake_semaphore() -> cute.Tensor:
    """(batch, nheads, num_m_blocks) int32 counters for the deterministic dQ ordering."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    return make_fake_tensor(cutlass.Int32, shape, (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def fake_dq_accum() -> cute.Tensor:
    """(batch, nheads, query blocks * block elements) float32 dQ workspace (see kernels/sm80/bwd.py)."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)
    return make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=16)


def main_kernel_fake_args(dtype, head_dim: int, gqa: bool) -> tuple:
    """Fake arguments of FlashAttnBwdSm80.__call__, in order."""
    dkv_dtype = cutlass.Float32 if gqa else dtype
    return (
        fake_bshd(dtype, head_dim), fake_bshd(dtype, head_dim), fake_bshd(dtype, head_dim),
        fake_bshd(dtype, head_dim), fake_rowstat(), fake_rowstat(), fake_dq_accum(),
        fake_bshd(dkv_dtype, head_dim), fake_bshd(dkv_dtype, head_dim), fake_semaphore(),
        cutlass.Float32(1.0), fake_stream(),
    )


def pre_kernel_fake_args(dtype, head_dim: int) -> tuple:
    return (fake_bshd(dtype, head_dim), fake_bshd(dtype, head_dim), fake_rowstat(), fake_rowstat(),
            fake_rowstat(), fake_stream())


def post_kernel_fake_args(dtype, head_dim: int) -> tuple:
    return (fake_dq_accum(), fake_bshd(dtype, head_dim), cutlass.Float32(1.0), fake_stream())


def main_kernel_key(dtype, head_dim: int, causal: bool, deterministic: bool, gqa: bool, tiles: dict) -> tuple:
    return ("sm80", "bwd_main", dtype.__name__, head_dim, causal, deterministic,
            "dkv_f32" if gqa else "dkv_same", tuple(sorted(tiles.items())))


def backward_builds(dtype, head_dim: int, causal: bool, deterministic: bool, gqa: bool, arch: str):
    """(cache key, build) of the preprocess, main and postprocess kernels of one backward variant
    compiled for `arch`; `build()` returns (kernel object, fake arguments)."""
    tiles = FlashAttnBwdSm80.default_tiles(dtype, head_dim, causal, arch, gqa)
    return (
        (("sm80", "bwd_pre", dtype.__name__, head_dim),
         lambda: (FlashAttnBwdPreprocessSm80(dtype, head_dim), pre_kernel_fake_args(dtype, head_dim))),
        (main_kernel_key(dtype, head_dim, causal, deterministic, gqa, tiles),
         lambda: (FlashAttnBwdSm80(dtype, head_dim, causal, deterministic, **tiles),
                  main_kernel_fake_args(dtype, head_dim, gqa))),
        (("sm80", "bwd_post", dtype.__name__, head_dim, tiles["m_block_size"], tiles["atom_m_dq"], tiles["dq_chunks"]),
         lambda: (FlashAttnBwdPostprocessSm80(dtype, head_dim, tiles["m_block_size"], tiles["atom_m_dq"],
                                              tiles["dq_chunks"]),
                  post_kernel_fake_args(dtype, head_dim))),
    )


def backward_kernels(dtype, head_dim: int, causal: bool, deterministic: bool, gqa: bool, arch: str):
    """The three compiled kernels of one backward variant (from the cache, compiling if needed)."""
    return tuple(
        get_or_compile(key, build, arch)
        for key, build in backward_builds(dtype, head_dim, causal, deterministic, gqa, arch)
    )


def backward_sm80(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
                  deterministic: bool) -> None:
    """Gradients of attention w.r.t. q, k, v, written into dq, dk, dv (shapes/strides as q, k, v)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dtype = CUTLASS_DTYPES[q.dtype]
    gqa = nheads != nheads_kv
    device = q.device
    f32 = torch.float32

    arch = target_arch(device.index)
    tiles = FlashAttnBwdSm80.default_tiles(dtype, head_dim, causal, arch, gqa)
    m_block = tiles["m_block_size"]
    seqlen_q_pad = round_up(seqlen_q, ROW_PAD)
    lse_log2 = torch.empty(batch, nheads, seqlen_q_pad, dtype=f32, device=device)
    dpsum = torch.empty(batch, nheads, seqlen_q_pad, dtype=f32, device=device)
    num_m_blocks = (seqlen_q + m_block - 1) // m_block
    dq_accum = torch.zeros(batch, nheads, num_m_blocks * m_block * round_up(head_dim, 32), dtype=f32, device=device)
    if deterministic:
        semaphore = torch.zeros(batch, nheads, num_m_blocks, dtype=torch.int32, device=device)
    else:
        semaphore = torch.empty(1, 1, 1, dtype=torch.int32, device=device)  # never read
    if gqa:
        dk_out = torch.empty(batch, seqlen_k, nheads, head_dim, dtype=f32, device=device)
        dv_out = torch.empty(batch, seqlen_k, nheads, head_dim, dtype=f32, device=device)
    else:
        dk_out, dv_out = dk, dv

    pre, main, post = backward_kernels(dtype, head_dim, causal, deterministic, gqa, arch)
    # TVM-FFI entry points: torch tensors as they are, the stream is the current torch stream.
    pre(out, dout, lse, lse_log2, dpsum)
    main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, semaphore, softmax_scale)
    post(dq_accum, dq, softmax_scale)
    if gqa:
        group = nheads // nheads_kv
        dk.copy_(dk_out.view(batch, seqlen_k, nheads_kv, group, head_dim).sum(3))
        dv.copy_(dv_out.view(batch, seqlen_k, nheads_kv, group, head_dim).sum(3))
