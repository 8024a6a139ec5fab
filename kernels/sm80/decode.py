"""Attention on a KV cache for decoding (mma.sync, cp.async, ldmatrix; sm80 and newer).

Decoding attends a few query rows per sequence (one new token, a few speculative ones, or a
chunk of a prompt) to a long cache. The work is reading K and V, so the kernel is built to read
each cache byte once and to spread the reading over every SM:

* Packed GQA. The query heads that share one KV head form one tile: packed row
  r = q_idx * group + h (query position q_idx, query head kv_head * group + h), so a CTA reads
  its KV head once for all of them.
* Split-KV. Grid (packed row blocks, splits, batch * kv_heads): split s takes an equal share of
  the sequence's key blocks. With one split the CTA writes O and LSE; with more it writes its
  normalized fp32 O and its LSE to a workspace that kernels/sm80/decode_combine.py merges.
* Per-sequence lengths. Sequence b has mCacheSeqlens[b] + seqlen_new keys, read on the device:
  no host synchronization, and CUDA graphs replay with new lengths.
* Paged or contiguous cache. Every K/V row is gathered on its own: key j of sequence b is row
  j % page_size of page block_table[b, j // page_size] (paged, any page size multiple of 16,
  smaller or larger than the key tile), or row j of cache entry batch_idx[b] (contiguous).

Causal attention is bottom-right aligned as in the other kernels: query q_idx sees key j iff
j <= q_idx + seqlen_k - seqlen_q. Every key block is masked (key bound, causal limit, window
sides): the selects cost nothing next to the loads, and any block of a split may hold the
diagonal. Softcap and ALiBi (`call_with_mods`) come before the masks, as in the forward; a row's
ALiBi slope is its own query head's.

The main loop is the sm80 forward's (kernels/sm80/fwd.py): K and V in separate cp.async groups,
one ahead, S = Q K^T and O += P V with ldmatrix + mma.sync, online softmax in registers. The
warps stack their 16-row MMA atoms along the packed rows, or (config.warps_along_keys, a 16-row
tile) each warp takes its own slice of every key block for all 16 rows: the tile's MMAs then cover
16 rows instead of 64 (a 4-head group at one token fills 4), and the warps' softmax states
(normalized O, LSE per row) merge in shared memory after the loop, as the splits merge.
"""

from __future__ import annotations

import math
from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from ..common.blocks import split_block_range
from ..common.layouts import reshape_acc_to_mn, transpose_view
from ..common.mask import alibi_head_slope, apply_softcap, kernel_mod_args
from ..common.softmax import LOG2_E, OnlineSoftmax
from .config import Sm80DecodeConfig
from .fwd import FlashAttnFwdSm80, tiled_mma_sm80

PAGE_MULTIPLE = 16
"""Supported page sizes are multiples of this (any multiple: rows are gathered one by one)."""


class FlashDecodeSm80(FlashAttnFwdSm80):
    """Shares the forward's launch setup, head-dim predicates, padding and stage ring (`_setup`,
    `_predicate_hdim`, `_zero_hdim_padding`, `_advance`); everything that addresses global memory
    is its own."""

    def __init__(self, config: Sm80DecodeConfig):
        self.cfg = config
        self.dtype = config.dtype
        # fp32 caches: split TF32 products (kernels/common/tf32.py) read from smem through the MMA's
        # own partitions, as in the forward
        self.fp32 = config.dtype is cutlass.Float32
        # fp32 caches: P V straight into O. The forward's block accumulation (Sm80FwdConfig) is not
        # built here yet, so O keeps the tensor cores' truncation bias over a split's keys.
        self.block_accumulator = False
        self.head_dim = config.head_dim
        self.tile_hdim = config.head_dim if config.head_dim % 64 == 0 else (config.head_dim + 31) // 32 * 32
        self.check_hdim = self.tile_hdim != config.head_dim
        self.causal = config.causal
        self.page_size = config.page_size
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_warps = config.num_warps
        self.num_threads = config.num_warps * 32
        self.num_stages = config.num_stages
        self.warps_along_keys = config.warps_along_keys
        # the keys of a block one warp's MMAs cover
        self.warp_keys = config.tile_n // config.num_warps if config.warps_along_keys else config.tile_n

    @staticmethod
    def default_tiles(head_dim: int, fp32: bool = False) -> dict:
        # 4 warps of 16 packed rows: a group of up to 64 query rows shares each K/V read. The
        # key tile halves past head dim 128 so acc_O + acc_S stay in registers; fp32 halves it
        # past 64 and again past 128 (twice the bytes per key, and split TF32's hi / lo fragments).
        if fp32:
            return dict(tile_m=64, tile_n=64 if head_dim <= 64 else 32 if head_dim <= 128 else 16, num_warps=4,
                        num_stages=2)
        return dict(tile_m=64, tile_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)

    @staticmethod
    def can_implement(dtype, head_dim, causal, page_size=0, tile_m=64, tile_n=64, num_warps=4,
                      num_stages=2, warps_along_keys=False) -> bool:
        if page_size < 0 or page_size % PAGE_MULTIPLE:
            return False
        if num_stages < 2:  # the loop issues V[n - 1] and K[n - 2] ahead
            return False
        mma_warps = num_warps
        if warps_along_keys:
            # one 16-row atom per warp, 16-key slices read by ldmatrix (16-bit); the merge's fp32
            # scratch (num_warps x 16 rows x head dim) fits in sK's stages, and the Q copy's 16-byte
            # rows cover the 16-row tile
            if (dtype is cutlass.Float32 or tile_m != 16 or tile_n != 16 * num_warps or head_dim % 64
                    or num_warps * 16 * 4 > tile_n * 2 * num_stages):
                return False
            mma_warps = 1
        # the forward's rules, its shared memory check (sm_80's 163 KB) included
        return FlashAttnFwdSm80.can_implement(dtype, head_dim, causal, tile_m, tile_n, mma_warps, num_stages)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, hd)
        mK: cute.Tensor,  # (cache batch, max_len, nheads_kv, hd) or (pages, page_size, nheads_kv, hd)
        mV: cute.Tensor,
        mO: cute.Tensor,  # like mQ
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) float32
        mOpart: cute.Tensor,  # (splits * batch, seqlen_q, nheads, hd) float32, with more than one split
        mLSEpart: cute.Tensor,  # (splits * batch, nheads, seqlen_q) float32
        mCacheSeqlens: cute.Tensor,  # (batch,) int32: keys of each sequence before the new ones
        mBatchIdx: cute.Tensor,  # (batch,) int32: cache entry of each sequence (contiguous cache)
        mBlockTable: cute.Tensor,  # (batch, max_pages) int32 (paged cache)
        mCacheLeftpad: cute.Tensor | None,  # (batch,) int32: where each sequence's keys start (config.leftpad)
        seqlen_new: Int32,  # keys appended to every sequence by this call (already in the cache)
        softmax_scale: Float32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        self._launch(mQ, mK, mV, mO, mLSE, mOpart, mLSEpart, mCacheSeqlens, mBatchIdx, mBlockTable, mCacheLeftpad,
                     seqlen_new, softmax_scale, num_splits, None, None, None, None, stream)

    @cute.jit
    def call_with_mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpart: cute.Tensor,
        mLSEpart: cute.Tensor,
        mCacheSeqlens: cute.Tensor,
        mBatchIdx: cute.Tensor,
        mBlockTable: cute.Tensor,
        mCacheLeftpad: cute.Tensor | None,
        seqlen_new: Int32,
        softmax_scale: Float32,
        num_splits: Int32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """With score modifications (config.window / softcap / alibi), None for each left out, as
        the forward's call_with_mods (kernels/sm80/fwd.py) takes them."""
        self._launch(mQ, mK, mV, mO, mLSE, mOpart, mLSEpart, mCacheSeqlens, mBatchIdx, mBlockTable, mCacheLeftpad,
                     seqlen_new, softmax_scale, num_splits, window_left, window_right, softcap, mAlibiSlopes, stream)

    @cute.jit
    def _launch(self, mQ, mK, mV, mO, mLSE, mOpart, mLSEpart, mCacheSeqlens, mBatchIdx, mBlockTable, mCacheLeftpad,
                seqlen_new, softmax_scale, num_splits, window_left, window_right, softcap, mAlibiSlopes, stream):
        if cutlass.const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                                   == mO.element_type == self.dtype)):
            raise TypeError("q, k_cache, v_cache, out must all have the kernel's dtype")
        sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma = self._setup()
        if cutlass.const_expr(self.warps_along_keys):
            tiled_mma = tiled_mma_sm80(self.dtype, 32, 1)  # each warp its own 16-row atom
        merge_lse = self.num_warps * self.tile_m if self.warps_along_keys else 1

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sMergeLSE: cute.struct.Align[cute.struct.MemRange[Float32, merge_lse], 16]  # warps_along_keys
        packed_rows = mQ.shape[1] * (mQ.shape[2] // mK.shape[2])
        grid = (cute.ceil_div(packed_rows, self.tile_m), num_splits, mQ.shape[0] * mK.shape[2])
        # with softcap, flash-attn 2's parametrization: scores tanh(s * scale / softcap), softmax at scale softcap
        score_scale, mods = kernel_mod_args(self.cfg.window, self.cfg.softcap, self.cfg.alibi, softmax_scale,
                                            window_left, window_right, softcap, mAlibiSlopes)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mOpart, mLSEpart, mCacheSeqlens, mBatchIdx, mBlockTable,
            seqlen_new, score_scale * LOG2_E, num_splits,
            sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma, SharedStorage, **mods,
            mCacheLeftpad=mCacheLeftpad,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
                 use_pdl=self.cfg.dependent_launch)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpart: cute.Tensor,
        mLSEpart: cute.Tensor,
        mCacheSeqlens: cute.Tensor,
        mBatchIdx: cute.Tensor,
        mBlockTable: cute.Tensor,
        seqlen_new: Int32,
        softmax_scale_log2: Float32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_tiled_copy_QKV: cute.TiledCopy,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        softcap_pre: Float32 | None = None,
        mAlibiSlopes: cute.Tensor | None = None,
        alibi_scale: Float32 | None = None,
        mCacheLeftpad: cute.Tensor | None = None,
    ):
        if cutlass.const_expr(self.cfg.dependent_launch):
            # Q, the cache and its append, the lengths: all written by kernels ahead in the stream
            cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, split, batch_head = cute.arch.block_idx()
        num_heads_kv = mK.shape[2]
        batch = batch_head // num_heads_kv
        head_kv = batch_head - batch * num_heads_kv
        seqlen_q = mQ.shape[1]
        group = mQ.shape[2] // num_heads_kv
        packed_rows = seqlen_q * group
        seqlen_k = mCacheSeqlens[batch] + seqlen_new
        leftpad = None
        if cutlass.const_expr(self.cfg.leftpad):
            # the sequence's keys start at this cache position: key j is cache row leftpad + j
            leftpad = mCacheLeftpad[batch]
            seqlen_k -= leftpad
        cache_batch = Int32(0)
        if cutlass.const_expr(self.page_size == 0):
            cache_batch = mBatchIdx[batch]

        # ---- this CTA's key blocks: an equal share of those the tile's rows see ----
        window = (window_left, window_right) if cutlass.const_expr(self.cfg.window) else None
        n_block_min, n_block_end = split_block_range(m_block, split, num_splits, seqlen_q, seqlen_k, group,
                                                     self.tile_m, self.tile_n, self.causal, window)
        n_block_first = n_block_end - 1

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = transpose_view(sV)
        # the MMAs' thread and smem slices: the CTA's (warps along M), or the warp's own keys
        warp_idx, mma_tidx, warp_key0 = tidx // 32, tidx, 0
        sK_mma, sVt_mma = sK, sVt
        if cutlass.const_expr(self.warps_along_keys):
            mma_tidx, warp_key0 = tidx % 32, warp_idx * self.warp_keys
            sK_mma = cute.local_tile(sK, (self.warp_keys, self.tile_hdim, self.num_stages), (warp_idx, 0, 0))
            sVt_mma = cute.local_tile(sVt, (self.tile_hdim, self.warp_keys, self.num_stages), (0, warp_idx, 0))

        blk_q = (self.tile_m, self.tile_hdim)
        blk_kv = (self.tile_n, self.tile_hdim)
        gmem_thr_copy = gmem_tiled_copy_QKV.get_slice(tidx)
        tQsQ = gmem_thr_copy.partition_D(sQ)
        tKsK = gmem_thr_copy.partition_D(sK)
        tVsV = gmem_thr_copy.partition_D(sV)
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor(blk_q))
        tKVcKV = gmem_thr_copy.partition_S(cute.make_identity_tensor(blk_kv))
        tQpQ = self._predicate_hdim(tQsQ, tQcQ)
        tKVpKV = self._predicate_hdim(tKsK, tKVcKV)

        thr_mma = tiled_mma.get_slice(mma_tidx)
        tSrQ = tSrK = tOrVt = None  # fp32: split TF32 reads its operands through the MMA's partitions
        if cutlass.const_expr(not self.fp32):
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_mma[None, None, 0]))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_mma[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_hdim)), Float32)
        acc_O.fill(0.0)

        smem_thr_copy_Q = smem_thr_copy_K = smem_thr_copy_V = None
        if cutlass.const_expr(not self.fp32):
            ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
            ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
            smem_thr_copy_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, self.dtype),
                                                     tiled_mma).get_slice(mma_tidx)
            smem_thr_copy_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, self.dtype),
                                                     tiled_mma).get_slice(mma_tidx)
            smem_thr_copy_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype),
                                                     tiled_mma).get_slice(mma_tidx)

        # ---- prologue: Q's packed rows, then K/V of the first blocks ----
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            row = m_block * self.tile_m + tQcQ[0, m, 0][0]
            if row < packed_rows:
                q_idx = row // group
                head = head_kv * group + row - q_idx * group
                tQgRow = gmem_thr_copy.partition_S(self._row_tile(mQ[batch, q_idx, head, None], self.tile_m))
                cute.copy(gmem_tiled_copy_QKV, tQgRow[None, m, None], tQsQ[None, m, None],
                          pred=tQpQ[None, m, None] if cutlass.const_expr(self.check_hdim) else None)
            else:
                tQsQ[None, m, None].fill(0.0)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.check_hdim):
            self._zero_hdim_padding(tQsQ, tQpQ)
            self._zero_hdim_padding(tKsK, tKVpKV)
            self._zero_hdim_padding(tVsV, tKVpKV)

        load_kv = partial(self._gather_kv, gmem_tiled_copy_QKV, gmem_thr_copy, tKVcKV, tKVpKV, seqlen_k,
                          batch, head_kv, cache_batch, mBlockTable, n_block_min, leftpad)
        load_kv(mK, tKsK, n_block_first, 0)
        cute.arch.cp_async_commit_group()
        load_kv(mV, tVsV, n_block_first, 0)
        cute.arch.cp_async_commit_group()
        for stage in cutlass.range_constexpr(1, self.num_stages):
            load_kv(mK, tKsK, n_block_first - stage, stage)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(stage < self.num_stages - 1):
                load_kv(mV, tVsV, n_block_first - stage, stage)
                cute.arch.cp_async_commit_group()

        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(reshape_acc_to_mn(acc_O), mode=[0]))
        softmax.reset()

        # ---- main loop over this split's key blocks, last to first ----
        row_slopes = None
        if cutlass.const_expr(self.cfg.alibi):
            row_slopes = self._row_slopes(thr_mma, mAlibiSlopes, alibi_scale, batch, m_block, packed_rows, group,
                                          head_kv)
        mods = (window, softcap_pre, row_slopes)
        step = partial(
            self._step, m_block=m_block, warp_key0=warp_key0, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=group,
            mods=mods,
            thr_mma=thr_mma, tiled_mma=tiled_mma, softmax=softmax, acc_O=acc_O,
            tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, **self._smem_operands(thr_mma, sQ, sK_mma, sVt_mma, smem_thr_copy_Q,
                                                                     smem_thr_copy_K, smem_thr_copy_V),
            smem_thr_copy_Q=smem_thr_copy_Q, smem_thr_copy_K=smem_thr_copy_K, smem_thr_copy_V=smem_thr_copy_V,
            load_kv=load_kv, mK=mK, mV=mV, tKsK=tKsK, tVsV=tVsV,
        )
        smem_read = Int32(0)
        smem_write = Int32(self.num_stages - 1)
        for i in cutlass.range(n_block_end - n_block_min, unroll=1):
            step(n_block_first - i, smem_read, smem_write)
            smem_read = self._advance(smem_read)
            smem_write = self._advance(smem_write)
        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: O / row_sum and LSE, final or one split's piece ----
        row_scale = softmax.finalize()
        softmax.rescale_O(acc_O, row_scale)
        rows = partial(self._packed_row, m_block=m_block, packed_rows=packed_rows, group=group, head_kv=head_kv)
        if cutlass.const_expr(self.warps_along_keys):
            cute.arch.barrier()  # every warp is done reading sK: it holds the merge's partial sums now
            self._merge_warps(acc_O, softmax.row_sum, thr_mma, storage.sMergeLSE.get_tensor(
                cute.make_layout((self.num_warps, self.tile_m), stride=(self.tile_m, 1))), storage.sK.data_ptr(),
                tidx, warp_idx,
                mO, mLSE, mOpart, mLSEpart, num_splits, batch, split * mQ.shape[0] + batch, rows)
        elif num_splits == 1:
            self._store_O_LSE(acc_O, softmax.row_sum, mO, mLSE, sQ, gmem_tiled_copy_O, tiled_mma, thr_mma,
                              tidx, batch, rows)
        else:
            self._store_piece(acc_O, softmax.row_sum, mOpart, mLSEpart, thr_mma, split * mQ.shape[0] + batch, rows)

    def _smem_operands(self, thr_mma, sQ, sK, sVt, smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V) -> dict:
        """The GEMMs' smem views: ldmatrix partitions, or for fp32 the MMA's own (32-bit loads)."""
        if cutlass.const_expr(self.fp32):
            return dict(tSsQ=thr_mma.partition_A(sQ), tSsK=thr_mma.partition_B(sK), tOsVt=thr_mma.partition_B(sVt))
        return dict(tSsQ=smem_thr_copy_Q.partition_S(sQ), tSsK=smem_thr_copy_K.partition_S(sK),
                    tOsVt=smem_thr_copy_V.partition_S(sVt))

    def _row_tile(self, row: cute.Tensor, num_rows: int) -> cute.Tensor:
        """One gmem row seen as a (num_rows, tile_hdim) tile whose every row is that row: the tiled
        copy's partition of it addresses this row's columns at any row index, so each row of an
        smem tile is gathered from its own address with the same copy as a strided tile."""
        return cute.make_tensor(row.iterator, cute.make_layout((num_rows, self.tile_hdim), stride=(0, 1)))

    @cute.jit
    def _packed_row(self, local_row, m_block, packed_rows, group, head_kv):
        """(valid, q_idx, head) of a tile row: packed row r = q_idx * group + h."""
        row = m_block * self.tile_m + local_row
        q_idx = row // group
        return row < packed_rows, q_idx, head_kv * group + row - q_idx * group

    @cute.jit
    def _gather_kv(self, gmem_tiled_copy, gmem_thr_copy, tXcX, tXpX, seqlen_k, batch, head_kv, cache_batch,
                   mBlockTable, n_block_min, leftpad, mX, tXsX, n_block, stage):
        """K or V block n_block into smem stage `stage` (nothing when n_block is outside this split):
        a contiguous cache's block as one strided tile, a paged cache's row by row through the block
        table. Keys at or past seqlen_k become zeros: they meet P = 0. With `leftpad` key j is the
        cache's position leftpad + j."""
        dst = tXsX[None, None, None, stage]
        if n_block >= n_block_min:
            if cutlass.const_expr(self.page_size == 0):
                # one partition for the block: its rows lie at fixed strides
                keys = mX[cache_batch, None, head_kv, None]
                if cutlass.const_expr(leftpad is not None):
                    keys = cute.domain_offset((leftpad, 0), keys)
                tXgX = gmem_thr_copy.partition_S(cute.local_tile(keys, (self.tile_n, self.tile_hdim), (n_block, 0)))
            for n in cutlass.range_constexpr(cute.size(dst.shape[1])):
                key = n_block * self.tile_n + tXcX[0, n, 0][0]
                if key < seqlen_k:
                    if cutlass.const_expr(self.page_size == 0):
                        src = tXgX
                    else:
                        position = key if cutlass.const_expr(leftpad is None) else key + leftpad
                        page_idx = position // self.page_size
                        row = mX[mBlockTable[batch, page_idx], position - page_idx * self.page_size, head_kv, None]
                        src = gmem_thr_copy.partition_S(self._row_tile(row, self.tile_n))
                    cute.copy(gmem_tiled_copy, src[None, n, None], dst[None, n, None],
                              pred=tXpX[None, n, None] if cutlass.const_expr(self.check_hdim) else None)
                else:
                    dst[None, n, None].fill(0.0)

    @cute.jit
    def _row_slopes(self, thr_mma, mAlibiSlopes, alibi_scale, batch, m_block, packed_rows, group, head_kv):
        """ALiBi's slope (times alibi_scale) of each of this thread's packed rows: a row's query head
        is its own (r = q_idx * group + h), so the slope is per row, not per CTA. 0 past the rows."""
        tScS_mn = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.warp_keys))))
        slopes = cute.make_rmem_tensor((cute.size(tScS_mn, mode=[0]),), Float32)
        for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
            valid, _, head = self._packed_row(tScS_mn[r, 0][0], m_block, packed_rows, group, head_kv)
            slopes[r] = Float32(0.0)
            if valid:
                slopes[r] = alibi_head_slope(mAlibiSlopes, alibi_scale, batch, head)
        return slopes

    @cute.jit
    def _mask(self, acc_S, thr_mma, m_block, n_block, warp_key0, seqlen_q, seqlen_k, group, mods):
        """flash-attn 2's order: softcap, ALiBi's -slope * |i - j| (per packed row's head), then
        -inf for keys at or past seqlen_k, right of each packed row's diagonal (causal) and outside
        its window."""
        window, softcap_pre, row_slopes = mods
        if cutlass.const_expr(softcap_pre is not None):
            apply_softcap(acc_S, softcap_pre)
        acc_S_mn = reshape_acc_to_mn(acc_S)
        tScS_mn = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.warp_keys))))
        key_offset = n_block * self.tile_n
        if cutlass.const_expr(self.warps_along_keys):
            key_offset += warp_key0  # this warp's slice of the block
        for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
            limit = seqlen_k - key_offset
            # the row's diagonal key, relative to the block
            diagonal = (m_block * self.tile_m + tScS_mn[r, 0][0]) // group + seqlen_k - seqlen_q - key_offset
            if cutlass.const_expr(self.causal):
                limit = cutlass.min(limit, diagonal + 1)
            first = 0
            if cutlass.const_expr(window is not None):
                limit = cutlass.min(limit, diagonal + window[1] + 1)
                first = diagonal - window[0]
            for c in cutlass.range_constexpr(cute.size(tScS_mn, mode=[1])):
                key = tScS_mn[r, c][1]
                if cutlass.const_expr(row_slopes is not None):
                    distance = Float32(diagonal - key)
                    acc_S_mn[r, c] = acc_S_mn[r, c] + row_slopes[r] * cutlass.max(distance, -distance)
                hidden = key >= limit
                if cutlass.const_expr(window is not None):
                    hidden = hidden | (key < first)
                acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]

    @cute.jit
    def _step(self, n_block, smem_read, smem_write, m_block, warp_key0, seqlen_q, seqlen_k, group, mods, thr_mma,
              tiled_mma, softmax, acc_O, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, smem_thr_copy_Q, smem_thr_copy_K,
              smem_thr_copy_V, load_kv, mK, mV, tKsK, tVsV):
        # the forward's two-wait step (kernels/sm80/fwd.py: _step), every block masked
        wait_groups = self.num_stages * 2 - 2
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.warp_keys)), Float32)
        acc_S.fill(0.0)
        cute.arch.cp_async_wait_group(wait_groups)
        cute.arch.barrier()  # K[n_block] landed; every warp done with the V stage written next
        load_kv(mV, tVsV, n_block - (self.num_stages - 1), smem_write)
        cute.arch.cp_async_commit_group()
        self._gemm_qk(tiled_mma, acc_S, tSrQ, tSrK, tSsK[None, None, None, smem_read], smem_thr_copy_K, tSsQ,
                      smem_thr_copy_Q)
        self._mask(acc_S, thr_mma, m_block, n_block, warp_key0, seqlen_q, seqlen_k, group, mods)
        row_scale = softmax.online_softmax(acc_S, is_first=False, check_inf=True)
        softmax.rescale_O_if_needed(acc_O, row_scale)
        tOrP, _ = self._p_operand(acc_S)
        cute.arch.cp_async_wait_group(wait_groups)
        cute.arch.barrier()  # V[n_block] landed; every warp done with K[smem_read]
        load_kv(mK, tKsK, n_block - self.num_stages, self._advance(smem_write))
        cute.arch.cp_async_commit_group()
        self._gemm_pv(tiled_mma, acc_O, tOrP, tOrVt, tOsVt[None, None, None, smem_read], smem_thr_copy_V)

    @cute.jit
    def _store_O_LSE(self, acc_O, lse, mO, mLSE, sQ, gmem_tiled_copy_O, tiled_mma, thr_mma, tidx, batch, rows):
        """The final O (staged through sQ for 16-byte stores, each row to its own address) and LSE."""
        taccOcO = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdim))))
        if taccOcO[0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                valid, q_idx, head = rows(taccOcO[r, 0][0])
                if valid:
                    mLSE[batch, head, q_idx] = lse[r]
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier()  # every warp is done reading sQ
        smem_copy_atom_O = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sQ))
        cute.arch.barrier()
        s2g = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = s2g.partition_S(sQ)
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        tOcO = s2g.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdim)))
        tOpO = self._predicate_hdim(tOsO, tOcO)
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            valid, q_idx, head = rows(tOcO[0, m, 0][0])
            if valid:
                tOgRow = s2g.partition_D(self._row_tile(mO[batch, q_idx, head, None], self.tile_m))
                cute.copy(gmem_tiled_copy_O, tOrO[None, m, None], tOgRow[None, m, None],
                          pred=tOpO[None, m, None] if cutlass.const_expr(self.check_hdim) else None)

    @cute.jit
    def _store_piece(self, acc_O, lse, mOpart, mLSEpart, thr_mma, piece, rows):
        """One split's normalized fp32 O and its LSE, from registers, for the combine kernel."""
        acc_O_mn = reshape_acc_to_mn(acc_O)
        taccOcO = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdim))))
        for r in cutlass.range_constexpr(cute.size(lse)):
            valid, q_idx, head = rows(taccOcO[r, 0][0])
            if valid:
                if taccOcO[0][1] == 0:
                    mLSEpart[piece, head, q_idx] = lse[r]
                gRow = mOpart[piece, q_idx, head, None]
                for c in cutlass.range(cute.size(acc_O_mn, mode=[1]), unroll_full=True):
                    col = taccOcO[r, c][1]
                    if cutlass.const_expr(self.check_hdim):
                        if col < self.head_dim:
                            gRow[col] = acc_O_mn[r, c]
                    else:
                        gRow[col] = acc_O_mn[r, c]

    @cute.jit
    def _merge_warps(self, acc_O, lse, thr_mma, sMergeLSE, scratch, tidx, warp_idx, mO, mLSE, mOpart, mLSEpart,
                     num_splits, batch, piece, rows):
        """warps_along_keys: each warp's normalized O and LSE per row into shared memory (O in the
        fp32 scratch over sK), then per row L = log sum_w exp(L_w) and O = sum_w exp(L_w - L) O_w,
        written as the final O and LSE or as this split's piece; each thread takes one row's
        run of columns."""
        sAcc = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32),
                                cute.make_layout((self.num_warps, self.tile_m, self.tile_hdim),
                                                 stride=(self.tile_m * self.tile_hdim, self.tile_hdim, 1)))
        acc_O_mn = reshape_acc_to_mn(acc_O)
        taccOcO = reshape_acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdim))))
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = taccOcO[r, 0][0]
            if taccOcO[0][1] == 0:
                sMergeLSE[warp_idx, row] = lse[r]
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                sAcc[warp_idx, row, taccOcO[r, c][1]] = acc_O_mn[r, c]
        cute.arch.barrier()
        threads_per_row = self.num_threads // self.tile_m
        columns = self.tile_hdim // threads_per_row
        row = tidx // threads_per_row
        part = tidx % threads_per_row
        lse_max = -Float32.inf
        for w in cutlass.range_constexpr(self.num_warps):
            lse_max = cute.arch.fmax(lse_max, sMergeLSE[w, row])
        # no warp saw a key of this row: weigh all by 0 (exp2(-inf)), not by exp2(nan)
        lse_base = Float32(0.0) if lse_max == -Float32.inf else lse_max
        weights = cute.make_rmem_tensor((self.num_warps,), Float32)
        total = Float32(0.0)
        for w in cutlass.range_constexpr(self.num_warps):
            weights[w] = cute.math.exp2((sMergeLSE[w, row] - lse_base) * LOG2_E, fastmath=True)
            total += weights[w]
        row_lse = -Float32.inf
        inv_total = Float32(0.0)
        if total > 0.0:
            row_lse = lse_base + cute.math.log2(total, fastmath=True) * math.log(2.0)
            inv_total = cute.arch.rcp_approx(total)
        out = cute.make_rmem_tensor((columns,), Float32)
        for j in cutlass.range_constexpr(columns):
            acc = Float32(0.0)
            for w in cutlass.range_constexpr(self.num_warps):
                acc += weights[w] * sAcc[w, row, part * columns + j]
            out[j] = acc * inv_total
        valid, q_idx, head = rows(row)
        if valid:
            if num_splits == 1:
                if part == 0:
                    mLSE[batch, head, q_idx] = row_lse
                cute.local_tile(mO[batch, q_idx, head, None], (columns,), (part,)).store(out.load().to(self.dtype))
            else:
                if part == 0:
                    mLSEpart[piece, head, q_idx] = row_lse
                cute.local_tile(mOpart[piece, q_idx, head, None], (columns,), (part,)).store(out.load())
