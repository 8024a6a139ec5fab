"""FlashAttention-2 backward postprocess for sm_80: dQ = softmax_scale * dQaccum in the input dtype.

The main kernel accumulates dQ (w.r.t. the scaled scores) in an fp32 workspace shaped
(batch, seqlen_q_padded, nheads, head_dim_padded); this kernel scales it, converts it and writes
it with the caller's strides.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32


class FlashAttnBwdPostprocessSm80:
    num_threads = 128
    rows_per_cta = 32
    vec = 8

    def __init__(self, dtype, head_dim: int):
        assert head_dim % 8 == 0 and head_dim <= 256
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        grid = (cute.ceil_div(mdQ.shape[1], self.rows_per_cta), mdQ.shape[2], mdQ.shape[0])
        self.kernel(mdQaccum, mdQ, softmax_scale).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        # One warp per row, lane l owns columns [8l, 8l + 8).
        lane = cute.arch.lane_idx()
        warp_id = cute.arch.warp_idx()
        block, head, batch = cute.arch.block_idx()
        num_warps = self.num_threads // 32
        for r in cutlass.range(self.rows_per_cta // num_warps, unroll=1):
            row = block * self.rows_per_cta + r * num_warps + warp_id
            if row < mdQ.shape[1] and lane * self.vec < self.head_dim:
                gAcc = cute.local_tile(mdQaccum[batch, row, head, None], (self.vec,), (lane,))
                gdQ = cute.local_tile(mdQ[batch, row, head, None], (self.vec,), (lane,))
                rAcc = cute.make_fragment_like(gAcc)
                cute.autovec_copy(gAcc, rAcc)
                rdQ = cute.make_fragment_like(gdQ)
                rdQ.store((rAcc.load() * softmax_scale).to(self.dtype))
                cute.autovec_copy(rdQ, gdQ)
