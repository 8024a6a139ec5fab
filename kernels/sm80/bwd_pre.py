"""FlashAttention-2 backward preprocess for sm_80: per-row statistics for the main kernel.

For every (batch, head, query row i):
    D_i        = rowsum(dO_i * O_i)            (fp32; Algorithm 2, line 4)
    LSElog2_i  = LSE_i * log2(e)               so the main kernel computes P with one exp2 per entry

Both are written to row-padded buffers (length a multiple of every m_block size) so the main
kernel can read whole blocks without bounds checks; a packed variable-length batch (config.varlen,
`call_varlen`) pads each sequence within one packed buffer (layouts.packed_stat_offset). Rows past
seqlen_q, and rows that saw no key (LSE = -inf), get LSElog2 = +inf and D = 0: their
probabilities exp2(s - inf) come out exactly 0. Each CTA also zeroes the main kernel's fp32 dQ
workspace rows that match its statistics rows (one pass over memory instead of a separate fill).
"""

from __future__ import annotations


import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.layouts import STAT_ROW_PAD, VECTOR_BITS, dq_accum_row, packed_stat_offset, sequence_bounds
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

    def __init__(self, config: Sm80BwdPreConfig):
        self.cfg = config
        dtype, head_dim = config.dtype, config.head_dim
        assert head_dim % 8 == 0 and head_dim <= 256
        self.dtype = dtype
        self.head_dim = head_dim
        self.varlen = config.varlen
        # A row's 128-bit chunks are spread over a power-of-two group of lanes (8 at head dim 64 in
        # 16 bits), so no lane idles at head dims from 32; at least 4 lanes per row keep a CTA's
        # rows in one pass of its 128 threads.
        self.vec = VECTOR_BITS // dtype.width
        self.chunks = head_dim // self.vec
        self.lanes_per_row = min(32, max(4, 1 << (self.chunks - 1).bit_length()))
        self.chunks_per_lane = -(-self.chunks // self.lanes_per_row)
        self.rows_per_pass = self.num_threads // self.lanes_per_row
        assert self.rows_per_cta % self.rows_per_pass == 0
        self.acc_row_elems = dq_accum_row(head_dim)
        self.acc_vec = VECTOR_BITS // Float32.width

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
                 mdPsum: cute.Tensor, mdQaccum: cute.Tensor, stream: cuda.CUstream):
        grid = (cute.ceil_div(mLSElog2.shape[2], self.rows_per_cta), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSElog2, mdPsum, mdQaccum, None).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.jit
    def call_varlen(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
                    mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_seqlen_q: cutlass.Int32,
                    stream: cuda.CUstream):
        """Packed sequences: mO, mdO (1, total_q, nheads, head_dim), mLSE (1, nheads, total_q),
        mLSElog2 and mdPsum (1, nheads, total_q + STAT_ROW_PAD * batch), mdQaccum (1, nheads, as many
        rows times the padded head dim)."""
        rows = cute.ceil_div(max_seqlen_q, STAT_ROW_PAD) * STAT_ROW_PAD
        grid = (cute.ceil_div(rows, self.rows_per_cta), mO.shape[2], mCuSeqlensQ.shape[0] - 1)
        self.kernel(mO, mdO, mLSE, mLSElog2, mdPsum, mdQaccum, mCuSeqlensQ).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSElog2: cute.Tensor,
               mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            offset, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            # the sequence's padded rows, up to where the next one's start
            stat_rows = cute.ceil_div(seqlen_q, STAT_ROW_PAD) * STAT_ROW_PAD
            if block * self.rows_per_cta < stat_rows:
                stat_offset = packed_stat_offset(offset, batch)
                self._rows(mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, seqlen_q, stat_rows, tidx, block,
                           (offset, stat_offset))
                # packed_stat_offset is a multiple of STAT_ROW_PAD: the zeros stay 16-byte vectors
                first = cute.assume(stat_offset * self.acc_row_elems, divby=STAT_ROW_PAD * self.acc_row_elems)
                acc = cute.domain_offset((first,), mdQaccum[0, head, None])
                self._zero_workspace(acc, stat_rows * self.acc_row_elems, tidx, block)
        else:
            self._rows(mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, mO.shape[1], mLSElog2.shape[2], tidx, block,
                       None)
            self._zero_workspace(mdQaccum[batch, head, None], mdQaccum.shape[2], tidx, block)

    @cute.jit
    def _rows(self, mO, mdO, mLSE, mLSElog2, mdPsum, batch, head, seqlen_q, stat_rows, tidx, block, offsets):
        """The block's rows of one (sequence, head); rows from seqlen_q up to stat_rows get the
        padding values. offsets: None (dense), or the sequence's first packed row and first row in
        the packed statistics (whose batch index is 0)."""
        lane_in_row = tidx % self.lanes_per_row
        for p in cutlass.range_constexpr(self.rows_per_cta // self.rows_per_pass):
            row = block * self.rows_per_cta + p * self.rows_per_pass + tidx // self.lanes_per_row
            dot = Float32(0.0)
            for c in cutlass.range_constexpr(self.chunks_per_lane):
                chunk = lane_in_row + c * self.lanes_per_row
                if row < seqlen_q and chunk < self.chunks:
                    b, r_o = packed_row(batch, row, offsets, 0)
                    gO = cute.local_tile(mO[b, r_o, head, None], (self.vec,), (chunk,))
                    gdO = cute.local_tile(mdO[b, r_o, head, None], (self.vec,), (chunk,))
                    rO = cute.make_fragment_like(gO)
                    rdO = cute.make_fragment_like(gdO)
                    cute.autovec_copy(gO, rO)
                    cute.autovec_copy(gdO, rdO)
                    prod = rO.load().to(Float32) * rdO.load().to(Float32)
                    dot = dot + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            for step in cutlass.range_constexpr(self.lanes_per_row.bit_length() - 1):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=self.lanes_per_row >> (step + 1))
            if lane_in_row == 0 and row < stat_rows:
                lse_log2 = Float32.inf
                if row < seqlen_q:
                    b, r_o = packed_row(batch, row, offsets, 0)
                    lse = mLSE[b, head, r_o]
                    if lse != -Float32.inf:
                        lse_log2 = lse * LOG2_E
                b, r_s = packed_row(batch, row, offsets, 1)
                mLSElog2[b, head, r_s] = lse_log2
                mdPsum[b, head, r_s] = dot

    @cute.jit
    def _zero_workspace(self, gAccum: cute.Tensor, length, tidx, block):
        """Zero the dQ workspace elements of this CTA's rows (those below `length`): the main kernel
        adds every query block's dQ into them."""
        per_cta = self.rows_per_cta * self.acc_row_elems // self.acc_vec
        zeros = cute.make_rmem_tensor((self.acc_vec,), Float32)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(per_cta // self.num_threads):
            chunk = block * per_cta + i * self.num_threads + tidx
            if chunk * self.acc_vec < length:
                cute.autovec_copy(zeros, cute.local_tile(gAccum, (self.acc_vec,), (chunk,)))
