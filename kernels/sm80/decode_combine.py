"""Split-KV merge for the decode kernel (kernels/sm80/decode.py).

Every split s of a query row left its normalized fp32 output O_s and its log-sum-exp L_s. The
row's attention over all keys is

    L = log(sum_s exp(L_s)),    O = sum_s exp(L_s - L) * O_s

(a split that saw no key has L_s = -inf and weighs 0; a row no split saw gets O = 0, L = -inf).
A CTA of config.num_warps warps serves one row on all its warps, or config.rows_per_cta rows on
a warp each (many rows split a few ways: a CTA per row would leave most of its warps idle). Every
warp reads its row's split statistics at once (a lane holds splits lane, lane + 32, ... up to the
config's max_splits, all loads in flight together) and reduces them with shuffles; the row's first
warp leaves each split's weight exp(L_s - L) in shared memory, so the walk's loads are the pieces
alone: the row's warp w of W walks splits w, w + W, ... with each lane holding LANE_COLUMNS columns
and SPLIT_UNROLL pieces' loads in flight; a row's warps meet in shared memory, a warp alone stores
its sums straight to O. The merge waits on memory latency, not bandwidth: one warp walking 256
splits took 14 µs (H200), longer than the decode kernel before it.
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
SPLIT_UNROLL = 4


class FlashDecodeCombineSm80:
    def __init__(self, config: Sm80DecodeCombineConfig):
        if config.rows_per_cta not in (1, config.num_warps):
            raise ValueError("a merge CTA holds one row on all its warps or one row per warp")
        self.cfg = config
        self.dtype = config.dtype
        self.head_dim = config.head_dim
        self.num_warps = config.num_warps
        self.rows_per_cta = config.rows_per_cta
        self.warps_per_row = config.num_warps // config.rows_per_cta
        self.stat_loads = -(-config.max_splits // 32)  # split statistics per lane

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
        self.kernel(mOpart, mLSEpart, mO, mLSE, num_splits, num_rows).launch(
            grid=((num_rows + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1), block=[self.num_warps * 32, 1, 1],
            stream=stream, use_pdl=self.cfg.dependent_launch)

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32, num_rows: Int32):
        if cutlass.const_expr(self.cfg.dependent_launch):
            cute.arch.griddepcontrol_wait()  # the pieces: the decode kernel's last CTAs may still be flushing them
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        row_slot = warp // self.warps_per_row  # the row of this CTA the warp serves
        row_warp = warp % self.warps_per_row  # and its turn among that row's warps
        row = cta * self.rows_per_cta + row_slot
        real = row < num_rows
        row = cutlass.min(row, num_rows - 1)  # the last CTA's spare warps read a real row, write nothing
        batch_count, seqlen_q, num_heads = mO.shape[0], mO.shape[1], mO.shape[2]
        head = row % num_heads
        token = row // num_heads
        q_idx = token % seqlen_q
        batch = token // seqlen_q
        lse_split = cute.make_rmem_tensor((self.stat_loads,), Float32)
        for i in cutlass.range_constexpr(self.stat_loads):
            lse_split[i] = -Float32.inf
            if lane + 32 * i < num_splits:
                lse_split[i] = mLSEpart[(lane + 32 * i) * batch_count + batch, head, q_idx]
        lse_max = -Float32.inf
        for i in cutlass.range_constexpr(self.stat_loads):
            lse_max = cute.arch.fmax(lse_max, lse_split[i])
        lse_max = cute.arch.warp_reduction(lse_max, cute.arch.fmax)
        # every split empty: weigh all by 0 (exp2(-inf)), not by exp2(nan)
        lse_base = Float32(0.0) if lse_max == -Float32.inf else lse_max
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.stat_loads):
            total += cute.math.exp2((lse_split[i] - lse_base) * LOG2_E, fastmath=True)
        total = cute.arch.warp_reduction(total, operator.add)
        lse = -Float32.inf
        if total > 0.0:
            lse = lse_base + cute.math.log2(total, fastmath=True) * math.log(2.0)
        if real and row_warp == 0 and lane == 0:
            mLSE[batch, head, q_idx] = lse
        lse_scale = Float32(0.0) if lse == -Float32.inf else lse

        smem = cutlass.memory.SmemAllocator()
        sWeight = smem.allocate_tensor(
            Float32, cute.make_layout((self.rows_per_cta, 32 * self.stat_loads), stride=(32 * self.stat_loads, 1)),
            byte_alignment=16)
        if row_warp == 0:
            for i in cutlass.range_constexpr(self.stat_loads):
                sWeight[row_slot, lane + 32 * i] = cute.math.exp2((lse_split[i] - lse_scale) * LOG2_E, fastmath=True)
        cute.arch.barrier()
        sPartial = None
        if cutlass.const_expr(self.warps_per_row > 1):
            sPartial = smem.allocate_tensor(
                Float32, cute.make_layout((self.num_warps, self.head_dim), stride=(self.head_dim, 1)), byte_alignment=16)
        for i in cutlass.range_constexpr((self.head_dim + 32 * LANE_COLUMNS - 1) // (32 * LANE_COLUMNS)):
            chunk = lane + 32 * i
            if chunk * LANE_COLUMNS < self.head_dim:
                acc = cute.make_rmem_tensor((LANE_COLUMNS,), Float32)
                acc.fill(0.0)
                for s in cutlass.range(row_warp, num_splits, self.warps_per_row, unroll=SPLIT_UNROLL):
                    piece = s * batch_count + batch
                    gO_s = cute.local_tile(mOpart[piece, q_idx, head, None], (LANE_COLUMNS,), (chunk,))
                    acc.store(acc.load() + gO_s.load() * sWeight[row_slot, s])
                if cutlass.const_expr(self.warps_per_row > 1):
                    cute.local_tile(sPartial[warp, None], (LANE_COLUMNS,), (chunk,)).store(acc.load())
                elif real:  # the warp holds its row's whole sum: straight to O
                    gO = cute.local_tile(mO[batch, q_idx, head, None], (LANE_COLUMNS,), (chunk,))
                    gO.store(acc.load().to(self.dtype))
        if cutlass.const_expr(self.warps_per_row > 1):
            cute.arch.barrier()
            if tidx < self.head_dim:
                column = Float32(0.0)
                for w in cutlass.range_constexpr(self.num_warps):
                    column += sPartial[w, tidx]
                mO[batch, q_idx, head, tidx] = column.to(self.dtype)
