"""Split-KV merge for the decode kernel (kernels/sm80/decode.py).

Every split s of a query row left its normalized fp32 output O_s and its log-sum-exp L_s. The
row's attention over all keys is

    L = log(sum_s exp(L_s)),    O = sum_s exp(L_s - L) * O_s

(a split that saw no key has L_s = -inf and weighs 0; a row no split saw gets O = 0, L = -inf).
One warp per row. The row's split statistics are spread over the lanes and reduced with shuffles;
then each lane holds 4 columns of 128 and walks the splits with SPLIT_UNROLL pieces' 16-byte loads
in flight at once: the merge waits on memory latency, not bandwidth, and with 128 splits a walk of
one load at a time costs tens of microseconds.
"""

from __future__ import annotations

import math
import operator

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.softmax import LOG2_E
from .config import Sm80DecodeCombineConfig

LANE_COLUMNS = 4
ROWS_PER_CTA = 4  # one warp each
SPLIT_UNROLL = 8


class FlashDecodeCombineSm80:
    def __init__(self, config: Sm80DecodeCombineConfig):
        self.cfg = config
        self.dtype = config.dtype
        self.head_dim = config.head_dim

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # (splits * batch, seqlen_q, nheads, hd) float32
        mLSEpart: cute.Tensor,  # (splits * batch, nheads, seqlen_q) float32
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, hd)
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) float32
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(mO.element_type != self.dtype):
            raise TypeError("out must have the kernel's dtype")
        num_rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOpart, mLSEpart, mO, mLSE, num_splits).launch(
            grid=(cute.ceil_div(num_rows, ROWS_PER_CTA), 1, 1), block=[ROWS_PER_CTA * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        batch_count, seqlen_q, num_heads = mO.shape[0], mO.shape[1], mO.shape[2]
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < batch_count * seqlen_q * num_heads:
            head = row % num_heads
            token = row // num_heads
            q_idx = token % seqlen_q
            batch = token // seqlen_q
            lse_max = -Float32.inf
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                lse_max = cute.arch.fmax(lse_max, mLSEpart[s * batch_count + batch, head, q_idx])
            lse_max = cute.arch.warp_reduction(lse_max, cute.arch.fmax)
            # every split empty: weigh all by 0 (exp2(-inf)), not by exp2(nan)
            lse_base = Float32(0.0) if lse_max == -Float32.inf else lse_max
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                total += cute.math.exp2((mLSEpart[s * batch_count + batch, head, q_idx] - lse_base) * LOG2_E,
                                        fastmath=True)
            total = cute.arch.warp_reduction(total, operator.add)
            lse = -Float32.inf
            if total > 0.0:
                lse = lse_base + cute.math.log2(total, fastmath=True) * math.log(2.0)
            if lane == 0:
                mLSE[batch, head, q_idx] = lse
            lse_scale = Float32(0.0) if lse == -Float32.inf else lse
            for i in cutlass.range_constexpr((self.head_dim + 32 * LANE_COLUMNS - 1) // (32 * LANE_COLUMNS)):
                chunk = lane + 32 * i
                if chunk * LANE_COLUMNS < self.head_dim:
                    acc = cute.make_rmem_tensor((LANE_COLUMNS,), Float32)
                    acc.fill(0.0)
                    for s in cutlass.range(num_splits, unroll=SPLIT_UNROLL):
                        piece = s * batch_count + batch
                        weight = cute.math.exp2((mLSEpart[piece, head, q_idx] - lse_scale) * LOG2_E, fastmath=True)
                        gO_s = cute.local_tile(mOpart[piece, q_idx, head, None], (LANE_COLUMNS,), (chunk,))
                        acc.store(acc.load() + gO_s.load() * weight)
                    gO = cute.local_tile(mO[batch, q_idx, head, None], (LANE_COLUMNS,), (chunk,))
                    gO.store(acc.load().to(self.dtype))
