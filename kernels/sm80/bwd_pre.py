"""FlashAttention-2 backward preprocess for sm_80: per-row statistics for the main kernel.

For every (batch, head, query row i):
    D_i        = rowsum(dO_i * O_i)            (fp32; Algorithm 2, line 4)
    LSElog2_i  = LSE_i * log2(e)               so the main kernel computes P with one exp2 per entry

Both are written to row-padded buffers (length a multiple of every m_block size) so the main
kernel can read whole blocks without bounds checks. Rows past seqlen_q, and rows that saw no key
(LSE = -inf), get LSElog2 = +inf and D = 0: their probabilities exp2(s - inf) come out exactly 0.
"""

from __future__ import annotations


import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.softmax import LOG2_E
from .config import Sm80BwdPreConfig


class FlashAttnBwdPreprocessSm80:
    num_threads = 128
    rows_per_cta = 32
    vec = 8  # 128-bit loads of 16-bit elements

    def __init__(self, config: Sm80BwdPreConfig):
        self.cfg = config
        dtype, head_dim = config.dtype, config.head_dim
        assert head_dim % 8 == 0 and head_dim <= 256
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
                 mdPsum: cute.Tensor, stream: cuda.CUstream):
        grid = (cute.ceil_div(mLSElog2.shape[2], self.rows_per_cta), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSElog2, mdPsum).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
               mdPsum: cute.Tensor):
        # One warp per row: lane l owns columns [8l, 8l + 8), so head_dim <= 256 needs one vector.
        lane = cute.arch.lane_idx()
        warp_id = cute.arch.warp_idx()
        block, head, batch = cute.arch.block_idx()
        seqlen_q = mO.shape[1]
        num_warps = self.num_threads // 32
        for r in cutlass.range(self.rows_per_cta // num_warps, unroll=1):
            row = block * self.rows_per_cta + r * num_warps + warp_id
            dot = Float32(0.0)
            if row < seqlen_q and lane * self.vec < self.head_dim:
                gO = cute.local_tile(mO[batch, row, head, None], (self.vec,), (lane,))
                gdO = cute.local_tile(mdO[batch, row, head, None], (self.vec,), (lane,))
                rO = cute.make_fragment_like(gO)
                rdO = cute.make_fragment_like(gdO)
                cute.autovec_copy(gO, rO)
                cute.autovec_copy(gdO, rdO)
                prod = rO.load().to(Float32) * rdO.load().to(Float32)
                dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            for offset in cutlass.range_constexpr(5):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << (4 - offset))
            if lane == 0 and row < mLSElog2.shape[2]:
                lse_log2 = Float32.inf
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    if lse != -Float32.inf:
                        lse_log2 = lse * LOG2_E
                mLSElog2[batch, head, row] = lse_log2
                mdPsum[batch, head, row] = dot
