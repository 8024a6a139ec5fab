"""Grouped-query backward, last step for sm_80: dK and dV of each key/value head as the sum of its
query heads' gradients.

With grouped-query (or multi-query) attention the main kernel (kernels/sm80/bwd.py) runs one CTA
per (key block, query head) and writes that query head's dK and dV in fp32 to per-query-head
workspaces of shape (batch, seqlen_k, nheads, head_dim). Here, for every (batch, key row, kv head):

    dK[b, j, hk] = sum_{g < group} dKaccum[b, j, hk * group + g]      (same for dV)

in fp32, in increasing g (a fixed order: deterministic), rounded once to the input dtype. The
query heads of one kv head are consecutive (kernels/common/blocks.py: kv_head), so a row's group
is one contiguous run of group * head_dim floats when the workspace is (b, j, h, d)-major.

The Python package sums the groups with torch; the C library (cute_flash/export.py) has no torch
and launches this kernel instead. Summing inside the main kernel would need atomics across CTAs
of one group (order-dependent fp32 sums) or a CTA per kv head walking all of its query heads
(group times fewer CTAs); a separate pass over a workspace the main kernel writes anyway keeps the
main kernel as it is and costs one read of the workspace.

Each thread moves vectors of 8 elements: 32 bytes of fp32 in, 16 bytes of the 16-bit dtype out
(the caller's dK / dV strides are multiples of 8 elements, like every 16-bit operand's).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import Sm80BwdGroupSumConfig


class FlashAttnBwdGroupSumSm80:
    num_threads = 128
    rows_per_cta = 32
    vec = 8

    def __init__(self, config: Sm80BwdGroupSumConfig):
        self.cfg = config
        assert config.head_dim % self.vec == 0 and config.head_dim <= 256
        self.dtype = config.dtype
        self.head_dim = config.head_dim

    @cute.jit
    def __call__(self, mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 stream: cuda.CUstream):
        grid = (cute.ceil_div(mdK.shape[1], self.rows_per_cta), mdK.shape[2], mdK.shape[0])
        self.kernel(mdKaccum, mdVaccum, mdK, mdV).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head_kv, batch = cute.arch.block_idx()
        seqlen_k = mdK.shape[1]
        group = mdKaccum.shape[2] // mdK.shape[2]
        # The CTA's rows_per_cta rows as rows_per_cta * vecs_per_row vectors, thread-major: the
        # threads of a warp read consecutive vectors of a row (or of consecutive rows).
        vecs_per_row = self.head_dim // self.vec
        vecs = self.rows_per_cta * vecs_per_row
        for i in cutlass.range_constexpr((vecs + self.num_threads - 1) // self.num_threads):
            idx = i * self.num_threads + tidx
            row = block * self.rows_per_cta + idx // vecs_per_row
            col = idx % vecs_per_row
            if idx < vecs and row < seqlen_k:
                for mAcc, mOut in ((mdKaccum, mdK), (mdVaccum, mdV)):
                    gOut = cute.local_tile(mOut[batch, row, head_kv, None], (self.vec,), (col,))
                    rSum = cute.make_rmem_tensor((self.vec,), Float32)
                    rSum.fill(0.0)
                    rPart = cute.make_rmem_tensor((self.vec,), Float32)
                    for g in cutlass.range(group, unroll=1):
                        gPart = cute.local_tile(mAcc[batch, row, head_kv * group + g, None], (self.vec,), (col,))
                        cute.autovec_copy(gPart, rPart)
                        rSum.store(rSum.load() + rPart.load())
                    rOut = cute.make_fragment_like(gOut)
                    rOut.store(rSum.load().to(self.dtype))
                    cute.autovec_copy(rOut, gOut)
