"""FlashAttention-2 backward main kernel for sm_80 (Algorithm 2), CuTe DSL.

One CTA owns one key block (n_block) of one (batch, query head): K_j and V_j stay in shared memory
while the CTA walks the query blocks m_block that can see them, recomputing the probabilities from
the saved log-sum-exp instead of storing anything of size seqlen_q x seqlen_k:

    S   = Q_i K_j^T                         (mma.sync, ldmatrix from swizzled smem)
    P   = exp2(S * scale * log2(e) - LSE_i * log2(e))
    dV_j += P^T dO_i
    dP  = dO_i V_j^T
    dS  = P * (dP - D_i)                    D_i = rowsum(dO_i * O_i), from the preprocess kernel;
                                            fp32 from the 16-bit P, rounded once
    dK_j += dS^T Q_i
    dQ_i += dS K_j                          fp32 atomics into a workspace (postprocess scales it)

The dQ workspace is thread-major: element i of thread t's dQ accumulator for query block m_block
(for column chunk c of it, with dq_chunks) lives at m_block * tile + c * chunk + i * num_threads + t
of its (batch, head) row (dq_accum_offset), so each warp-wide reduction
covers 32 consecutive floats (4 full sectors) and every address is one base register plus an
immediate. Only the postprocess, which partitions the same tiled MMA, knows where (row, col) is.

dK and dV live in registers for the whole walk and are written once at the end (dK scaled by
softmax_scale because dS is the gradient w.r.t. the scaled scores). With grouped-query attention
the host passes fp32 per-query-head dK/dV workspaces and sums the groups itself.

fp32 inputs run every GEMM as split TF32 (kernels/common/tf32.py) with P and dS in fp32 in smem,
on their own tiles (config.py: `_bwd_fp32_tiles`).

Deterministic mode orders the dQ accumulation: the CTAs touching one query block add their dQ
tile in increasing n_block order, gated by a per-(batch, head, m_block) counter.

Score modifications (config.window / softcap / alibi) as in the forward (`call_with_mods`): a
window walks only the query blocks that see the key block and masks only those crossing its edges;
with softcap the scores are t = tanh(s * scale / softcap) and dS picks up dt/ds's factor
(1 - t^2), taken from t recomputed with P (the softmax's own scale, softcap, is in dS already).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warp

from cute_flash.kernels.common.blocks import BlockRanges, kv_head
from cute_flash.kernels.common.entry_points import BackwardEntryPoints
from cute_flash.kernels.common.layouts import (
    dq_accum_row,
    gmem_tiled_copy,
    packed_stat_offset,
    reshape_acc_to_mn,
    sequence_bounds,
    sequence_rows,
    sequence_stat,
    smem_layout_atom,
    transpose_view,
)
from cute_flash.kernels.common.philox import DropoutRng, apply_dropout, dropout_dS
from cute_flash.kernels.common.softmax import LOG2_E
from cute_flash.kernels.common.stores import store_acc, store_acc_via_smem
from cute_flash.kernels.common.mask import (
    alibi_head_slope, apply_alibi, apply_mask, apply_softcap, kernel_mod_args, softcap_grad,
)
from cute_flash.kernels.common.tf32 import MmaOperandReader, gemm_split_tf32
from cute_flash.kernels.sm80.config import BWD_NUM_THREADS, Sm80BwdConfig, bwd_smem_bytes
from cute_flash.kernels.sm80.fwd import tiled_mma_sm80


@cute.jit
def gemm_smem(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, s2r_A, s2r_B, carried=False):
    """acc += A @ B with both operands streamed from smem by ldmatrix, one k-slice ahead; fp32
    operands (s2r_A, s2r_B are MmaOperandReaders) by split TF32, summed apart from acc first where
    acc is `carried` across query blocks (dK, dV: tf32.gemm_split_tf32's fresh_sum)."""
    if cutlass.const_expr(isinstance(s2r_A, MmaOperandReader)):
        gemm_split_tf32(tiled_mma, acc, tCsB, tCsA=tCsA, fresh_sum=carried, products=s2r_A.products)
        return
    tCrA_view = s2r_A.retile(tCrA)
    tCrB_view = s2r_B.retile(tCrB)
    cute.copy(s2r_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(s2r_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    num_k = cute.size(tCsA.shape[2])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            cute.copy(s2r_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(s2r_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


class FlashAttnBwdSm80(BackwardEntryPoints):
    num_threads = BWD_NUM_THREADS
    smem_bytes = staticmethod(bwd_smem_bytes)  # asked by `cute-flash check` and the layout explorer

    def __init__(self, config: Sm80BwdConfig):
        self.cfg = config
        self.dtype = config.dtype
        self.fp32 = config.dtype is cutlass.Float32  # split TF32 (kernels/common/tf32.py), no ldmatrix
        self.head_dim = config.head_dim
        self.head_dim_padded = dq_accum_row(config.head_dim)
        self.causal = config.causal
        self.deterministic = deterministic = config.deterministic
        self.m_block_size = config.m_block_size
        self.n_block_size = config.n_block_size
        self.num_stages_Q = config.num_stages_Q
        self.num_stages_dO = config.num_stages_dO
        self.atom_m_sdp = config.atom_m_sdp
        self.atom_n_dkv = config.atom_n_dkv
        self.atom_m_dq = config.atom_m_dq
        p_in_registers, dq_chunks = config.p_in_registers, config.dq_chunks
        # The ordered dQ semaphore (deterministic) takes the registers the fp32 P needs: 16-24
        # bytes of spill at d64 causal.
        self.p_in_registers = p_in_registers and not deterministic
        # dQ = dS K_j by column chunks of head_dim, each added to the workspace before the next
        # is computed: the accumulator the dQ GEMM adds to dK and dV's registers shrinks by the
        # factor, which at d = 256 leaves room for a second Q buffer without spills.
        self.dq_chunks = dq_chunks
        self.window, self.softcap, self.alibi = config.window, config.softcap, config.alibi
        self.dropout = config.dropout
        self.varlen = config.varlen

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def call_varlen(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        max_seqlen_k: Int32,
        softmax_scale: Float32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """A packed variable-length batch (config.varlen), tensors as the forward's call_varlen;
        mLSElog2, mdPsum (1, nheads, rows) and mdQaccum (1, nheads, rows * head_dim_padded) hold
        sequence b from row layouts.packed_stat_offset(cu_seqlens_q[b], b); mdQsemaphore stays
        (batch, nheads, query blocks of the longest sequence). max_seqlen_k sizes the grid."""
        self.launch(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale,
                    window_left, window_right, softcap, mAlibiSlopes, stream, mCuSeqlensQ, mCuSeqlensK, max_seqlen_k)

    @cute.jit
    def launch(self, mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale: Float32,
               window_left, window_right, softcap, mAlibiSlopes, stream: cuda.CUstream, mCuSeqlensQ=None,
               mCuSeqlensK=None, max_seqlen_k=None, dropout_args=(None,) * 4):
        m, n, d = self.m_block_size, self.n_block_size, self.head_dim_padded
        atom_qk = smem_layout_atom(self.dtype, d)
        sQ_layout = cute.tile_to_shape(atom_qk, (m, d, self.num_stages_Q), (0, 1, 2))
        sdO_layout = cute.tile_to_shape(atom_qk, (m, d, self.num_stages_dO), (0, 1, 2))
        sKV_layout = cute.tile_to_shape(atom_qk, (n, d), (0, 1))
        sPdS_layout = cute.tile_to_shape(smem_layout_atom(self.dtype, n), (m, n), (0, 1))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, m * self.num_stages_Q], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, m * self.num_stages_dO], 128]

        # 128-bit cp.async: each thread moves 8 contiguous 16-bit elements.
        gmem_copy = gmem_tiled_copy(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, self.num_threads,
            cute.size(atom_qk.outer.shape[1]),
        )
        gmem_store = gmem_tiled_copy(
            cute.nvgpu.CopyUniversalOp(), self.dtype, self.num_threads, cute.size(atom_qk.outer.shape[1])
        )

        if cutlass.const_expr(self.varlen):
            # key blocks of the longest sequence; those past a shorter one's end exit at once
            grid = (cute.ceil_div(max_seqlen_k, n), mQ.shape[2], mCuSeqlensQ.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mK.shape[1], n), mQ.shape[2], mQ.shape[0])
        # P's exponent: at scale softcap with softcap (the forward's parametrization)
        score_scale, mods = kernel_mod_args(self.window, self.softcap, self.alibi, softmax_scale, window_left,
                                            window_right, softcap, mAlibiSlopes, self.dropout, dropout_args)
        self.kernel(
            mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore,
            softmax_scale, score_scale * LOG2_E,
            sQ_layout, sdO_layout, sKV_layout, sPdS_layout, gmem_copy, gmem_store,
            *[tiled_mma_sm80(self.dtype, self.num_threads, atom_m)
              for atom_m in (self.atom_m_sdp, self.atom_n_dkv, self.atom_m_dq)],
            SharedStorage, mCuSeqlensQ, mCuSeqlensK, **mods,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor,
        softmax_scale: Float32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        gmem_tiled_copy: cute.TiledCopy,
        gmem_store: cute.TiledCopy,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        softcap_pre: Float32 | None = None,
        mAlibiSlopes: cute.Tensor | None = None,
        alibi_scale: Float32 | None = None,
        philox_seed: Int64 | None = None,
        philox_offset: Int64 | None = None,
        dropout_threshold: Int32 | None = None,
        dropout_scale: Float32 | None = None,
    ):
        """Algorithm 2 for one key block j of one (batch, query head): K_j and V_j into smem, then
        for every query block i that sees them P_ij is recomputed, dV_j and dK_j accumulate in
        registers and dQ_i goes to the workspace; dK_j and dV_j are written at the end."""
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.cfg.shortest_walk_first):
            # a CTA then waits only for CTAs of its query blocks that started before it
            n_block = cute.arch.grid_dim()[0] - 1 - n_block
        key_block = partial(
            self._key_block, mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale,
            scale_log2, sQ_layout, sdO_layout, sKV_layout, sPdS_layout, gmem_tiled_copy, gmem_store, tiled_mma_sdp,
            tiled_mma_dkv, tiled_mma_dq, SharedStorage, window_left, window_right, softcap_pre, mAlibiSlopes,
            alibi_scale, (philox_seed, philox_offset, dropout_threshold, dropout_scale), tidx, n_block, head, batch,
        )
        if cutlass.const_expr(self.varlen):
            offset_q, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            offset_k, seqlen_k = sequence_bounds(mCuSeqlensK, batch)
            # the grid covers the longest sequence: key blocks past this one's end load nothing
            if n_block * self.n_block_size < seqlen_k:
                key_block(seqlen_q, seqlen_k, (offset_q, offset_k, packed_stat_offset(offset_q, batch)))
        else:
            key_block(mQ.shape[1], mK.shape[1], None)

    @cute.jit
    def _key_block(
        self, mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale, scale_log2,
        sQ_layout, sdO_layout, sKV_layout, sPdS_layout, gmem_tiled_copy, gmem_store, tiled_mma_sdp, tiled_mma_dkv,
        tiled_mma_dq, SharedStorage: cutlass.Constexpr, window_left, window_right, softcap_pre, mAlibiSlopes,
        alibi_scale, dropout_args, tidx, n_block, head, batch, seqlen_q, seqlen_k, offsets,
    ):
        """The kernel's work for one key block of a sequence of seqlen_q queries and seqlen_k keys.
        offsets: None for a dense batch, else the sequence's first query row, first key row and
        first row in the packed workspaces."""
        m, n = self.m_block_size, self.n_block_size
        head_kv = kv_head(head, mQ.shape[2], mK.shape[2])

        # Query blocks that see some key of this key block (Algorithm 2, inner loop bounds); the
        # first few of them straddle the causal diagonal and need the mask.
        ranges = BlockRanges(m, n, self.causal)
        window = (window_left, window_right) if cutlass.const_expr(self.window) else None
        m_block_left_mask = None
        if cutlass.const_expr(self.window):
            m_block_min, m_block_max = ranges.m_block_min_max_window(n_block, seqlen_q, seqlen_k, *window)
            # query blocks below the first and from the second cross an edge of the window
            m_block_max_mask, m_block_left_mask = ranges.m_block_window_masks(n_block, seqlen_q, seqlen_k, *window)
        else:
            m_block_min, m_block_max = ranges.m_block_min_max(n_block, seqlen_q, seqlen_k)
            m_block_max_mask = m_block_min
            if cutlass.const_expr(self.causal):
                m_block_max_mask = ranges.m_block_max_causal_mask(n_block, seqlen_q, seqlen_k, m_block_min)
        alibi_slope = alibi_head_slope(mAlibiSlopes, alibi_scale, batch, head)
        rng = None
        if cutlass.const_expr(self.dropout):
            rng = DropoutRng.create(*dropout_args[:3], batch * mQ.shape[2] + head)
        # Where this CTA sits and how far its blocks reach, for the per-block steps and the epilogue.
        cta = SimpleNamespace(
            batch=batch, head=head, n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, tidx=tidx,
            m_block_max=m_block_max, m_block_max_mask=m_block_max_mask, m_block_left_mask=m_block_left_mask,
            last_n_block_partial=(n_block + 1) * n > seqlen_k,
            ranges=ranges, window=window, softcap_pre=softcap_pre, alibi_slope=alibi_slope, rng=rng,
            dropout_scale=dropout_args[3],
            offsets=offsets if cutlass.const_expr(offsets is not None) else (None, None, None),
        )

        g = self.global_tiles(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, cta, head_kv)
        s = self.smem_tiles(SharedStorage, sQ_layout, sdO_layout, sKV_layout, sPdS_layout)
        ld = self.load_partitions(gmem_tiled_copy, g, s, tidx)
        mma = self.mma_partitions(tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, s, tidx)
        # dK_j and dV_j accumulate in registers over the whole walk.
        acc_dK = cute.make_rmem_tensor(mma.acc_shape_dKV, Float32)
        acc_dV = cute.make_rmem_tensor(mma.acc_shape_dKV, Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        if m_block_min < m_block_max:
            # K_j and V_j stay in smem for the whole walk; Q and dO of the first block come with them.
            self.load_tile(gmem_tiled_copy, ld.tKgK, ld.tKsK, ld.tKcK, seqlen_k - n_block * n)
            self.load_tile(gmem_tiled_copy, ld.tVgV, ld.tVsV, ld.tKcK, seqlen_k - n_block * n)
            self.load_Q_LSE(ld, m_block_min, 0, seqlen_q, tidx)
            self.load_dO_dPsum(ld, m_block_min, 0, seqlen_q, tidx)
            cute.arch.cp_async_commit_group()

            stage_q = Int32(0)
            stage_do = Int32(0)
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                self.m_block_step(mma, ld, cta, acc_dK, acc_dV, m_block, stage_q, stage_do, scale_log2,
                                  g.gdQaccum, mdQsemaphore)
                if cutlass.const_expr(self.num_stages_Q > 1):
                    stage_q = 1 - stage_q
                if cutlass.const_expr(self.num_stages_dO > 1):
                    stage_do = 1 - stage_do

        self.store_dK_dV(acc_dK, acc_dV, mdK, mdV, s.sK, s.sV, tiled_mma_dkv, gmem_store, softmax_scale, cta)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def global_tiles(self, mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, cta, head_kv):
        """This CTA's views of global memory: every query block of Q, dO and their row statistics
        (indexed by m_block), the key block n_block of K and V, and the dQ workspace."""
        m, n, d = self.m_block_size, self.n_block_size, self.head_dim_padded
        batch, head, n_block = cta.batch, cta.head, cta.n_block
        offset_q, offset_k, offset_stat = cta.offsets
        gQ = cute.local_tile(sequence_rows(mQ, batch, head, offset_q), (m, d), (None, 0))
        gdO = cute.local_tile(sequence_rows(mdO, batch, head, offset_q), (m, d), (None, 0))
        gK = cute.local_tile(sequence_rows(mK, batch, head_kv, offset_k), (n, d), (n_block, 0))
        gV = cute.local_tile(sequence_rows(mV, batch, head_kv, offset_k), (n, d), (n_block, 0))
        gLSE = cute.local_tile(sequence_stat(mLSElog2, batch, head, offset_stat), (m,), (None,))
        gdPsum = cute.local_tile(sequence_stat(mdPsum, batch, head, offset_stat), (m,), (None,))
        offset_acc = offset_stat * d if cutlass.const_expr(offset_stat is not None) else None
        gdQaccum = cute.local_tile(sequence_stat(mdQaccum, batch, head, offset_acc), (m * d,), (None,))
        return SimpleNamespace(gQ=gQ, gdO=gdO, gK=gK, gV=gV, gLSE=gLSE, gdPsum=gdPsum, gdQaccum=gdQaccum)

    @cute.jit
    def smem_tiles(self, SharedStorage: cutlass.Constexpr, sQ_layout, sdO_layout, sKV_layout, sPdS_layout):
        """The shared-memory tiles (Q and dO with their row statistics in num_stages buffers) and
        the transposed views the dK, dV and dQ GEMMs read them through."""
        m = self.m_block_size
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sdO_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sP = storage.sP.get_tensor(sPdS_layout)
        sdS = storage.sdS.get_tensor(sPdS_layout)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((m, self.num_stages_Q)))
        sdPsum = storage.sdPsum.get_tensor(cute.make_layout((m, self.num_stages_dO)))
        sQt, sdOt, sKt, sPt, sdSt = [transpose_view(t) for t in (sQ, sdO, sK, sP, sdS)]
        return SimpleNamespace(sQ=sQ, sdO=sdO, sK=sK, sV=sV, sP=sP, sdS=sdS, sLSE=sLSE, sdPsum=sdPsum,
                               sQt=sQt, sdOt=sdOt, sKt=sKt, sPt=sPt, sdSt=sdSt)

    @cute.jit
    def load_partitions(self, gmem_tiled_copy: cute.TiledCopy, g, s, tidx: Int32):
        """This thread's share of the gmem -> smem copies (cp.async), with the (row, col) of each
        piece for the bounds checks."""
        m, n, d = self.m_block_size, self.n_block_size, self.head_dim_padded
        gQ, gdO, gK, gV = g.gQ, g.gdO, g.gK, g.gV
        sQ, sdO, sK, sV = s.sQ, s.sdO, s.sK, s.sV
        gmem_thr_copy = gmem_tiled_copy.get_slice(tidx)
        tQgQ = gmem_thr_copy.partition_S(gQ)
        tQsQ = gmem_thr_copy.partition_D(sQ)
        tdOgdO = gmem_thr_copy.partition_S(gdO)
        tdOsdO = gmem_thr_copy.partition_D(sdO)
        tKgK = gmem_thr_copy.partition_S(gK)
        tKsK = gmem_thr_copy.partition_D(sK)
        tVgV = gmem_thr_copy.partition_S(gV)
        tVsV = gmem_thr_copy.partition_D(sV)
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor((m, d)))
        tKcK = gmem_thr_copy.partition_S(cute.make_identity_tensor((n, d)))
        copy_atom_stat = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        return SimpleNamespace(
            gmem_tiled_copy=gmem_tiled_copy, copy_atom_stat=copy_atom_stat, tQgQ=tQgQ, tQsQ=tQsQ, tQcQ=tQcQ,
            tdOgdO=tdOgdO, tdOsdO=tdOsdO, tKgK=tKgK, tKsK=tKsK, tVgV=tVgV, tVsV=tVsV, tKcK=tKcK,
            gLSE=g.gLSE, sLSE=s.sLSE, gdPsum=g.gdPsum, sdPsum=s.sdPsum,
        )

    @cute.jit
    def mma_partitions(self, tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma,
                       tiled_mma_dq: cute.TiledMma, s, tidx: Int32):
        """This thread's MMA fragments and smem partitions of the five GEMMs, the copies of P and
        dS back to smem, and the accumulator shapes."""
        m, n, d = self.m_block_size, self.n_block_size, self.head_dim_padded
        sQ, sdO, sK, sV, sP, sdS = s.sQ, s.sdO, s.sK, s.sV, s.sP, s.sdS
        sQt, sdOt, sKt, sPt, sdSt = s.sQt, s.sdOt, s.sKt, s.sPt, s.sdSt
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_mma_dkv = tiled_mma_dkv.get_slice(tidx)
        thr_mma_dq = tiled_mma_dq.get_slice(tidx)
        tSrQ = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sK))
        tdPrdO = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sV))
        tdVrPt = thr_mma_dkv.make_fragment_A(thr_mma_dkv.partition_A(sPt))
        tdVrdOt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_mma_dkv.make_fragment_A(thr_mma_dkv.partition_A(sdSt))
        tdKrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sQt[None, None, 0]))
        tdQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS))
        dq_cols = d // self.dq_chunks
        sKt_chunks = cute.local_tile(sKt, (dq_cols, n), (None, 0))
        tdQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt_chunks[None, None, 0]))

        if cutlass.const_expr(self.fp32):
            # split TF32 reads its operands itself, through the MMA's partitions (32-bit loads)
            products = self.cfg.tf32_products
            s2r_sdp_A, s2r_dkv_A, s2r_dq_A = (MmaOperandReader(t, "A", products)
                                              for t in (thr_mma_sdp, thr_mma_dkv, thr_mma_dq))
            s2r_sdp_B, s2r_dkv_B, s2r_dq_B = (MmaOperandReader(t, "B", products)
                                              for t in (thr_mma_sdp, thr_mma_dkv, thr_mma_dq))
        else:
            # smem -> register copies: ldmatrix, transposed where the operand's k is not contiguous.
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
            s2r_sdp_A = cute.make_tiled_copy_A(ldsm, tiled_mma_sdp).get_slice(tidx)
            s2r_sdp_B = cute.make_tiled_copy_B(ldsm, tiled_mma_sdp).get_slice(tidx)
            s2r_dkv_A = cute.make_tiled_copy_A(ldsm_t, tiled_mma_dkv).get_slice(tidx)
            s2r_dkv_B = cute.make_tiled_copy_B(ldsm_t, tiled_mma_dkv).get_slice(tidx)
            s2r_dq_A = cute.make_tiled_copy_A(ldsm, tiled_mma_dq).get_slice(tidx)
            s2r_dq_B = cute.make_tiled_copy_B(ldsm_t, tiled_mma_dq).get_slice(tidx)
        tSsQ = s2r_sdp_A.partition_S(sQ)
        tSsK = s2r_sdp_B.partition_S(sK)
        tdPsdO = s2r_sdp_A.partition_S(sdO)
        tdPsV = s2r_sdp_B.partition_S(sV)
        tdVsPt = s2r_dkv_A.partition_S(sPt)
        tdVsdOt = s2r_dkv_B.partition_S(sdOt)
        tdKsdSt = s2r_dkv_A.partition_S(sdSt)
        tdKsQt = s2r_dkv_B.partition_S(sQt)
        tdQsdS = s2r_dq_A.partition_S(sdS)
        tdQsKt = s2r_dq_B.partition_S(sKt_chunks)
        # P and dS go back to smem as pairs of 16-bit values straight from the accumulator layout.
        r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tPsP = r2s_PdS.partition_D(sP)
        tdSsdS = r2s_PdS.partition_D(sdS)

        # (row, col) of every accumulator element of S/dP, and the rows this thread owns.
        tScS_mn = reshape_acc_to_mn(thr_mma_sdp.partition_C(cute.make_identity_tensor((m, n))))
        return SimpleNamespace(
            tiled_mma_sdp=tiled_mma_sdp, tiled_mma_dkv=tiled_mma_dkv, tiled_mma_dq=tiled_mma_dq,
            thr_mma_sdp=thr_mma_sdp, tScS_mn=tScS_mn, sLSE=s.sLSE, sdPsum=s.sdPsum,
            acc_shape_SdP=thr_mma_sdp.partition_shape_C((m, n)), acc_shape_dKV=thr_mma_dkv.partition_shape_C((n, d)),
            acc_shape_dQ=thr_mma_dq.partition_shape_C((m, dq_cols)),
            tSrQ=tSrQ, tSrK=tSrK, tSsQ=tSsQ, tSsK=tSsK, s2r_sdp_A=s2r_sdp_A, s2r_sdp_B=s2r_sdp_B,
            tdPrdO=tdPrdO, tdPrV=tdPrV, tdPsdO=tdPsdO, tdPsV=tdPsV, r2s_PdS=r2s_PdS, tPsP=tPsP, tdSsdS=tdSsdS,
            tdVrPt=tdVrPt, tdVrdOt=tdVrdOt, tdVsPt=tdVsPt, tdVsdOt=tdVsdOt,
            tdKrdSt=tdKrdSt, tdKrQt=tdKrQt, tdKsdSt=tdKsdSt, tdKsQt=tdKsQt, s2r_dkv_A=s2r_dkv_A, s2r_dkv_B=s2r_dkv_B,
            tdQrdS=tdQrdS, tdQrKt=tdQrKt, tdQsdS=tdQsdS, tdQsKt=tdQsKt, s2r_dq_A=s2r_dq_A, s2r_dq_B=s2r_dq_B,
        )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def m_block_step(self, mma, ld, cta, acc_dK: cute.Tensor, acc_dV: cute.Tensor, m_block: Int32,
                     stage_q: Int32, stage_do: Int32, scale_log2: Float32, gdQaccum: cute.Tensor,
                     mdQsemaphore: cute.Tensor):
        """Query block m_block against K_j, V_j (Algorithm 2, inner loop body), with Q and dO of
        the next block loading into their free buffers meanwhile."""
        seqlen_q, tidx = cta.seqlen_q, cta.tidx
        # Everything for this m_block has landed, and every thread is done with the last one.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        has_next = m_block + 1 < cta.m_block_max
        if cutlass.const_expr(self.num_stages_Q > 1):
            if has_next:
                self.load_Q_LSE(ld, m_block + 1, 1 - stage_q, seqlen_q, tidx)
        if cutlass.const_expr(self.num_stages_dO > 1):
            if has_next:
                self.load_dO_dPsum(ld, m_block + 1, 1 - stage_do, seqlen_q, tidx)
        cute.arch.cp_async_commit_group()

        acc_S, rP = self.compute_P(mma, cta, m_block, stage_q, scale_log2)
        self.compute_dS(mma, acc_S, rP, stage_do, cta.dropout_scale)

        # dV_j += P^T dO_i
        gemm_smem(mma.tiled_mma_dkv, acc_dV, mma.tdVrPt, mma.tdVrdOt, mma.tdVsPt,
                  mma.tdVsdOt[None, None, None, stage_do], mma.s2r_dkv_A, mma.s2r_dkv_B, carried=True)
        if cutlass.const_expr(self.num_stages_dO == 1):
            # dO's only buffer is free once every warp has finished dV.
            self.refill_single_buffer(self.load_dO_dPsum, ld, m_block, has_next, seqlen_q, tidx)

        # dQ_i += dS K_j, accumulated in fp32 global memory.
        for chunk in cutlass.range_constexpr(self.dq_chunks):
            acc_dQ = cute.make_rmem_tensor(mma.acc_shape_dQ, Float32)
            acc_dQ.fill(0.0)
            gemm_smem(mma.tiled_mma_dq, acc_dQ, mma.tdQrdS, mma.tdQrKt, mma.tdQsdS, mma.tdQsKt[None, None, None, chunk],
                      mma.s2r_dq_A, mma.s2r_dq_B)
            self.accumulate_dQ(acc_dQ, gdQaccum[None, m_block], chunk, mdQsemaphore,
                               cta.batch, cta.head, m_block, self.dq_turn(cta, m_block), tidx)

        # dK_j += dS^T Q_i
        gemm_smem(mma.tiled_mma_dkv, acc_dK, mma.tdKrdSt, mma.tdKrQt, mma.tdKsdSt,
                  mma.tdKsQt[None, None, None, stage_q], mma.s2r_dkv_A, mma.s2r_dkv_B, carried=True)
        if cutlass.const_expr(self.num_stages_Q == 1):
            # Q's only buffer is free once every warp has finished dK.
            self.refill_single_buffer(self.load_Q_LSE, ld, m_block, has_next, seqlen_q, tidx)

    @cute.jit
    def dq_turn(self, cta, m_block: Int32):
        """This key block's turn in query block m_block's deterministic dQ order: ascending
        without masks, descending with causal or window ones (Sm80BwdConfig.shortest_walk_first)."""
        turn = cta.n_block
        if cutlass.const_expr(self.cfg.shortest_walk_first):
            turn = cta.ranges.dq_turn_descending(cta.n_block, m_block, cta.seqlen_q, cta.seqlen_k, cta.window)
        return turn

    @cute.jit
    def refill_single_buffer(self, load, ld, m_block: Int32, has_next, seqlen_q: Int32, tidx: Int32):
        """The next block's tile into the only buffer of Q or dO (`load`: load_Q_LSE or
        load_dO_dPsum), which every warp has finished reading once the barrier passes."""
        cute.arch.barrier()
        if has_next:
            load(ld, m_block + 1, 0, seqlen_q, tidx)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def compute_P(self, mma, cta, m_block: Int32, stage_q: Int32, scale_log2: Float32):
        """S = Q_i K_j^T, then P = exp(S * scale - LSE) with masked entries at 0; P also goes to
        smem (16-bit) for the dV GEMM. Returns the fp32 P and its 16-bit copy.

        With softcap, dS's factor 1 - t^2 must outlive the dP GEMM, where registers are scarcest
        (a fragment of it spilled 24-64 bytes at d = 128): with p_in_registers the fp32 P that
        compute_dS takes becomes P * (1 - t^2) (the 16-bit P is in smem already); otherwise the
        factor waits in dS's smem tile as fp16 (relative error 2^-11, on a [0, 1] value)."""
        m, n = self.m_block_size, self.n_block_size
        acc_S = cute.make_rmem_tensor(mma.acc_shape_SdP, Float32)
        acc_S.fill(0.0)
        gemm_smem(mma.tiled_mma_sdp, acc_S, mma.tSrQ, mma.tSrK, mma.tSsQ[None, None, None, stage_q], mma.tSsK,
                  mma.s2r_sdp_A, mma.s2r_sdp_B)
        if cutlass.const_expr(self.softcap):
            apply_softcap(acc_S, cta.softcap_pre)
            dtanh = softcap_grad(acc_S)
        if cutlass.const_expr(self.alibi):
            apply_alibi(acc_S, mma.thr_mma_sdp, m, n, m_block, cta.n_block, cta.seqlen_q, cta.seqlen_k, cta.alibi_slope)
        if cutlass.const_expr(self.window):
            if cta.last_n_block_partial or m_block < cta.m_block_max_mask or m_block >= cta.m_block_left_mask:
                apply_mask(acc_S, mma.thr_mma_sdp, m, n, m_block, cta.n_block, cta.seqlen_q, cta.seqlen_k,
                           mask_seqlen=True, mask_causal=False, branchless=False, window=cta.window)
        elif cta.last_n_block_partial or m_block < cta.m_block_max_mask:
            apply_mask(acc_S, mma.thr_mma_sdp, m, n, m_block, cta.n_block, cta.seqlen_q, cta.seqlen_k,
                       mask_seqlen=True, mask_causal=self.causal, branchless=False)
        acc_S_mn = reshape_acc_to_mn(acc_S)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            lse_log2 = mma.sLSE[mma.tScS_mn[r, 0][0], stage_q]
            acc_S_mn[r, None].store(cute.math.exp2(acc_S_mn[r, None].load() * scale_log2 - lse_log2, fastmath=True))
        if cutlass.const_expr(self.dropout):
            # dropped entries as -P: dV's P is max(P, 0), dS needs P of both kinds (philox.dropout_dS)
            apply_dropout(acc_S, mma.thr_mma_sdp, m, n, m_block, cta.n_block, cta.rng, encode_in_sign=True)
        # P goes to smem before the dP GEMM. dS = P * (dP - D) is computed in fp32 and
        # rounded once: from the fp32 P kept in registers across the dP GEMM where they
        # fit (p_in_registers), else from the 16-bit P read back (fp32 P there made d128
        # spill at 255 registers). (Rounding dP - D to 16 bits first and multiplying in
        # packed 16-bit pairs put dq past twice torch's error on some bf16 d256 inputs.)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        if cutlass.const_expr(self.dropout):
            rP.store(cute.where(acc_S.load() > 0.0, acc_S.load(), 0.0).to(self.dtype))
        else:
            rP.store(acc_S.load().to(self.dtype))
        cute.copy(mma.r2s_PdS, mma.r2s_PdS.retile(rP), mma.tPsP)
        if cutlass.const_expr(self.dropout and not self.p_in_registers):
            # dS's signed P (times softcap's factor) waits in dS's smem tile; the previous block's dS
            # has been read: every warp passed the barrier of m_block_step
            if cutlass.const_expr(self.softcap):
                acc_S.store(acc_S.load() * dtanh.load())
            signed = cute.make_fragment_like(acc_S, self.dtype)
            signed.store(acc_S.load().to(self.dtype))
            cute.copy(mma.r2s_PdS, mma.r2s_PdS.retile(signed), mma.tdSsdS)
        elif cutlass.const_expr(self.softcap):
            if cutlass.const_expr(self.p_in_registers):
                acc_S.store(acc_S.load() * dtanh.load())
            else:
                stash = cute.make_rmem_tensor_like(acc_S, cutlass.Float16)
                stash.store(dtanh.load().to(cutlass.Float16))
                # the previous block's dS has been read: every warp passed the barrier of m_block_step
                cute.copy(mma.r2s_PdS, mma.r2s_PdS.retile(cute.recast_tensor(stash, self.dtype)), mma.tdSsdS)
        return acc_S, rP

    @cute.jit
    def compute_dS(self, mma, acc_S: cute.Tensor, rP: cute.Tensor, stage_do: Int32, dropout_scale: Float32 | None):
        """dP = dO_i V_j^T, then dS = P * (dP - D_i) into smem (16-bit) for the dK and dQ GEMMs,
        which may read it once this returns."""
        acc_dP = cute.make_rmem_tensor(mma.acc_shape_SdP, Float32)
        acc_dP.fill(0.0)
        gemm_smem(mma.tiled_mma_sdp, acc_dP, mma.tdPrdO, mma.tdPrV, mma.tdPsdO[None, None, None, stage_do], mma.tdPsV,
                  mma.s2r_sdp_A, mma.s2r_sdp_B)
        if cutlass.const_expr(self.dropout):
            self.dropout_dS(mma, acc_dP, acc_S, stage_do, dropout_scale)
        else:
            acc_dP_mn = reshape_acc_to_mn(acc_dP)
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                acc_dP_mn[r, None].store(acc_dP_mn[r, None].load() - mma.sdPsum[mma.tScS_mn[r, 0][0], stage_do])
            if cutlass.const_expr(self.p_in_registers):
                acc_dP.store(acc_dP.load() * acc_S.load())
            else:
                cute.copy(mma.r2s_PdS, mma.tPsP, mma.r2s_PdS.retile(rP))  # this thread's own stores: no barrier
                acc_dP.store(acc_dP.load() * rP.load().to(Float32))
                if cutlass.const_expr(self.softcap):
                    stash = cute.make_fragment_like(acc_dP, self.dtype)
                    cute.copy(mma.r2s_PdS, mma.tdSsdS, mma.r2s_PdS.retile(stash))  # this thread's own stores
                    acc_dP.store(acc_dP.load() * cute.recast_tensor(stash, cutlass.Float16).load().to(Float32))
        rdS = cute.make_fragment_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(mma.r2s_PdS, mma.r2s_PdS.retile(rdS), mma.tdSsdS)
        cute.arch.barrier()

    @cute.jit
    def dropout_dS(self, mma, acc_dP: cute.Tensor, acc_S: cute.Tensor, stage_do: Int32, dropout_scale: Float32):
        """dS of the dropped P (philox.dropout_dS) into acc_dP, from the signed P in registers or,
        without p_in_registers, the one compute_P left in dS's smem tile."""
        if cutlass.const_expr(self.p_in_registers):
            p_signed = acc_S
        else:
            stash = cute.make_fragment_like(acc_dP, self.dtype)
            cute.copy(mma.r2s_PdS, mma.tdSsdS, mma.r2s_PdS.retile(stash))  # this thread's own stores
            p_signed = cute.make_rmem_tensor_like(acc_dP, Float32)
            p_signed.store(stash.load().to(Float32))
        acc_dP_mn, p_mn = reshape_acc_to_mn(acc_dP), reshape_acc_to_mn(p_signed)
        for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
            dpsum = mma.sdPsum[mma.tScS_mn[r, 0][0], stage_do]
            for c in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                acc_dP_mn[r, c] = dropout_dS(p_mn[r, c], acc_dP_mn[r, c], dpsum, dropout_scale)

    @cute.jit
    def store_dK_dV(self, acc_dK: cute.Tensor, acc_dV: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                    sK: cute.Tensor, sV: cute.Tensor, tiled_mma_dkv: cute.TiledMma, gmem_store: cute.TiledCopy,
                    softmax_scale: Float32, cta):
        """Epilogue: dK_j (scaled by softmax_scale, as dS is the gradient w.r.t. the scaled scores)
        and dV_j to global memory, rows past seqlen_k and the head-dim padding left out."""
        n, d = self.n_block_size, self.head_dim_padded
        batch, head, n_block, seqlen_k, tidx = cta.batch, cta.head, cta.n_block, cta.seqlen_k, cta.tidx
        acc_dK.store(acc_dK.load() * softmax_scale)
        if cutlass.const_expr(self.dropout):
            acc_dV.store(acc_dV.load() * cta.dropout_scale)  # dV's P is the kept P, not yet rescaled
        if cutlass.const_expr(mdK.element_type == self.dtype):
            # K and V are no longer read: their smem stages dK and dV for 16-byte stores.
            cute.arch.barrier()
            for acc, mX, sX in ((acc_dK, mdK, sK), (acc_dV, mdV, sV)):
                gX = cute.local_tile(sequence_rows(mX, batch, head, cta.offsets[1]), (n, d), (n_block, 0))
                store_acc_via_smem(acc, sX, gX, tiled_mma_dkv, gmem_store, seqlen_k - n_block * n, self.head_dim, tidx)
        else:  # fp32 per-query-head dK/dV of grouped-query attention: straight from registers
            for acc, mX in ((acc_dK, mdK), (acc_dV, mdV)):
                gX = cute.local_tile(sequence_rows(mX, batch, head, cta.offsets[1]), (n, d), (n_block, 0))
                store_acc(acc, gX, tiled_mma_dkv, seqlen_k - n_block * n, self.head_dim, tidx)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_tile(self, gmem_tiled_copy: cute.TiledCopy, tXgX: cute.Tensor, tXsX: cute.Tensor,
                  tXcX: cute.Tensor, rows_left: Int32):
        """Async copy of one (rows, head_dim_padded) tile; rows past the sequence and the head-dim
        padding are zero-filled so they contribute nothing to any product."""
        for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            for c in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
                coord = tXcX[0, r, c]
                if coord[0] < rows_left and coord[1] < self.head_dim:
                    cute.copy(gmem_tiled_copy, tXgX[None, r, c], tXsX[None, r, c])
                else:
                    tXsX[None, r, c].fill(0)

    @cute.jit
    def load_Q_LSE(self, ld, m_block: Int32, stage: Int32, seqlen_q: Int32, tidx: Int32):
        """Q_i and its log-sum-exp into buffer `stage` (`ld`: load_partitions)."""
        self.load_tile(ld.gmem_tiled_copy, ld.tQgQ[None, None, None, m_block], ld.tQsQ[None, None, None, stage],
                       ld.tQcQ, seqlen_q - m_block * self.m_block_size)
        # The row statistics are padded to a multiple of every m_block size by the preprocess.
        if tidx < self.m_block_size:
            cute.copy(ld.copy_atom_stat, cute.local_tile(ld.gLSE[None, m_block], (1,), (tidx,)),
                      cute.local_tile(ld.sLSE[None, stage], (1,), (tidx,)))

    @cute.jit
    def load_dO_dPsum(self, ld, m_block: Int32, stage: Int32, seqlen_q: Int32, tidx: Int32):
        """dO_i and D_i = rowsum(dO_i * O_i) into buffer `stage` (`ld`: load_partitions)."""
        self.load_tile(ld.gmem_tiled_copy, ld.tdOgdO[None, None, None, m_block], ld.tdOsdO[None, None, None, stage],
                       ld.tQcQ, seqlen_q - m_block * self.m_block_size)
        if tidx < self.m_block_size:
            cute.copy(ld.copy_atom_stat, cute.local_tile(ld.gdPsum[None, m_block], (1,), (tidx,)),
                      cute.local_tile(ld.sdPsum[None, stage], (1,), (tidx,)))

    @cute.jit
    def accumulate_dQ(self, acc_dQ: cute.Tensor, gdQaccum_tile: cute.Tensor, chunk: cutlass.Constexpr[int],
                      mdQsemaphore: cute.Tensor, batch: Int32, head: Int32, m_block: Int32, turn: Int32,
                      tidx: Int32):
        """Adds one column chunk of dQ_i to the workspace, thread-major within the chunk; with
        `deterministic`, key blocks take turns per query block (the first chunk waits for this
        block's turn, the last passes it on)."""
        waits_turn = self.deterministic and chunk == 0
        passes_turn = self.deterministic and chunk == self.dq_chunks - 1
        if cutlass.const_expr(waits_turn or passes_turn):
            lock = mdQsemaphore.iterator + cute.crd2idx((batch, head, m_block), mdQsemaphore.layout)
        if cutlass.const_expr(waits_turn):
            # The key blocks that see query block m_block add in n_block order (dq_turn).
            if tidx == 0:
                while cute.arch.load(lock, Int32, sem="acquire", scope="gpu") != turn:
                    pass
            cute.arch.barrier()
        mine = gdQaccum_tile.iterator + dq_accum_offset(chunk, cute.size(acc_dQ), tidx)
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            cute.arch.red(mine + i * self.num_threads, acc_dQ[i], op="add", dtype=Float32, sem="relaxed", scope="gpu")
        if cutlass.const_expr(passes_turn):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(lock, Int32(1), sem="release", scope="gpu")


def dq_accum_offset(chunk: int, chunk_elems: int, tidx: Int32) -> Int32:
    """Where thread `tidx`'s first element of dQ column chunk `chunk` sits in a query block's fp32
    workspace: chunk after chunk, thread-major within each (element i at + i * num_threads). The
    main kernel adds there and the postprocess reads back from there."""
    return chunk * chunk_elems * FlashAttnBwdSm80.num_threads + tidx
