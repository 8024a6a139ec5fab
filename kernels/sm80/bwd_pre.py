"""FlashAttention-2 backward preprocess for sm_80: per-row statistics for the main kernel.

For every (batch, head, query row i):
    D_i        = rowsum(dO_i * O_i)            (fp32; Algorithm 2, line 4)
    LSElog2_i  = LSE_i * log2(e)               so the main kernel computes P with one exp2 per entry

Both are written to row-padded buffers (length a multiple of every m_block size) so the main
kernel can read whole blocks without bounds checks; a packed variable-length batch (config.varlen,
`call_varlen`) pads each sequence within one packed buffer (layouts.packed_stat_offset). Rows past
seqlen_q, and rows that saw no key (LSE = -inf), get LSElog2 = +inf and D = 0: their
probabilities exp2(s - inf) come out exactly 0.
"""

from __future__ import annotations


import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.layouts import STAT_ROW_PAD, packed_stat_offset, sequence_bounds
from ..common.softmax import LOG2_E
from .config import Sm80BwdPreConfig


def packed_row(batch, row, offsets, which: int):
    """(batch index, row) of a sequence's `row`: as given in a dense batch (offsets None), else
    shifted by offsets[which] in a packed tensor (batch index 0). Runs at trace time."""
    if offsets is None:
        return batch, row
    return 0, offsets[which] + row


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
        self.varlen = config.varlen

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
                 mdPsum: cute.Tensor, stream: cuda.CUstream):
        grid = (cute.ceil_div(mLSElog2.shape[2], self.rows_per_cta), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSElog2, mdPsum, None).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.jit
    def call_varlen(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
                    mdPsum: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_seqlen_q: cutlass.Int32,
                    stream: cuda.CUstream):
        """Packed sequences: mO, mdO (1, total_q, nheads, head_dim), mLSE (1, nheads, total_q),
        mLSElog2 and mdPsum (1, nheads, total_q + STAT_ROW_PAD * batch)."""
        rows = cute.ceil_div(max_seqlen_q, STAT_ROW_PAD) * STAT_ROW_PAD
        grid = (cute.ceil_div(rows, self.rows_per_cta), mO.shape[2], mCuSeqlensQ.shape[0] - 1)
        self.kernel(mO, mdO, mLSE, mLSElog2, mdPsum, mCuSeqlensQ).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
               mdPsum: cute.Tensor, mCuSeqlensQ: cute.Tensor | None):
        # One warp per row: lane l owns columns [8l, 8l + 8), so head_dim <= 256 needs one vector.
        lane = cute.arch.lane_idx()
        warp_id = cute.arch.warp_idx()
        block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            offset, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            # the sequence's padded rows, up to where the next one's start
            stat_rows = cute.ceil_div(seqlen_q, STAT_ROW_PAD) * STAT_ROW_PAD
            if block * self.rows_per_cta < stat_rows:
                self._rows(mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, seqlen_q, stat_rows, lane, warp_id, block,
                           (offset, packed_stat_offset(offset, batch)))
        else:
            self._rows(mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, mO.shape[1], mLSElog2.shape[2], lane, warp_id,
                       block, None)

    @cute.jit
    def _rows(self, mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, seqlen_q, stat_rows, lane, warp_id, block,
              offsets):
        """The block's rows of one (sequence, head); rows from seqlen_q up to stat_rows get the
        padding values. offsets: None (dense), or the sequence's first packed row and first row in
        the packed statistics (whose batch index is 0)."""
        num_warps = self.num_threads // 32
        for r in cutlass.range(self.rows_per_cta // num_warps, unroll=1):
            row = block * self.rows_per_cta + r * num_warps + warp_id
            dot = Float32(0.0)
            if row < seqlen_q and lane * self.vec < self.head_dim:
                b, r_o = packed_row(batch, row, offsets, 0)
                gO = cute.local_tile(mO[b, r_o, head, None], (self.vec,), (lane,))
                gdO = cute.local_tile(mdO[b, r_o, head, None], (self.vec,), (lane,))
                rO = cute.make_fragment_like(gO)
                rdO = cute.make_fragment_like(gdO)
                cute.autovec_copy(gO, rO)
                cute.autovec_copy(gdO, rdO)
                prod = rO.load().to(Float32) * rdO.load().to(Float32)
                dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            for offset in cutlass.range_constexpr(5):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << (4 - offset))
            if lane == 0 and row < stat_rows:
                lse_log2 = Float32.inf
                if row < seqlen_q:
                    b, r_o = packed_row(batch, row, offsets, 0)
                    lse = mLSE[b, head, r_o]
                    if lse != -Float32.inf:
                        lse_log2 = lse * LOG2_E
                b, r_s = packed_row(batch, row, offsets, 1)
                mLSElog2[b, head, r_s] = lse_log2
                mdPsum[b, head, r_s] = dot
