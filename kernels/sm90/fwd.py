"""FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.

FlashAttention-2 Algorithm 1, mapped onto Hopper:

* A tile is one (tile_m x head_dim) block of O for one (batch, head). A CTA computes one tile,
  or, persistent (`num_sms` > 0), tiles blockIdx.x, blockIdx.x + gridDim.x, ... with its
  pipelines running on from tile to tile.
* Warp group 0 is the producer: one warp issues TMA loads of Q (once per tile; with `q_by_group`
  in one piece per consumer warp group) and of K, V (one n_block at a time) into a
  `num_stages`-deep shared-memory ring guarded by mbarriers
  (`cutlass.pipeline.PipelineTmaAsync`). It gives most of its registers to the consumers
  (`setmaxnreg`).
* Warp groups 1..num_wg_mma are consumers; each owns 64 rows of the Q tile and runs
  S = Q K^T (wgmma, both operands in smem), the online softmax on the S accumulator, and
  O += P V (wgmma with P straight from registers).
* Intra-warp-group overlap: the S GEMM of the next K/V block is issued together with the PV
  GEMM of the current one, and the softmax of the next block runs while that PV GEMM does.
  Causal-masked blocks overlap too; P's conversion is pinned in place so
  that this fits in registers (see `convert_P`).
* Inter-warp-group ping-pong: named barriers make the consumer warp groups take turns
  issuing GEMMs, so one group's softmax hides behind the other group's GEMMs.
* Epilogue: O is normalized, written to smem (its own buffer where it fits, else Q's) and
  stored by TMA, which clips rows past seqlen_q; LSE is written straight from registers.
* Tail split (persistent, non-causal): when the last round of tiles would leave SMs idle, its
  tiles are cut along the keys into pieces that run side by side; each piece leaves its O and LSE
  in a global workspace and the last piece of a tile to finish merges them (`merge_pieces`).

K/V blocks are visited from the last one down, so the blocks that need masking (the
seqlen_k tail, the causal diagonal, a sliding window's right edge) come first and the rest run
mask-free (but for those crossing a window's left edge, last). Score modifications
(config.window / softcap / alibi) and dropout (config.dropout: the Philox keep mask of
kernels/common/philox.py, a function of each element's coordinates, so the sm80 backward draws the
same one) are compiled in only where the configuration asks; their values come through
`call_with_mods`. Packed variable-length batches (config.varlen) come through `call_varlen`: each
tile's sequence bounds from cu_seqlens (tile_scheduler.py: unit_work), the tensors viewed from
the sequence's first row (`sequence_tensors`), O stored from registers clipped at its last row.

Where things are: the configuration (tiles, schedule, softmax form, epilogue) in config.py, the
tile walk in tile_scheduler.py, the producer's loads in fwd_loads.py, O's and LSE's way out in
epilogue.py, the warp roles and the consumers' main loop here.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.tensor_utils.layout import LayoutEnum

from ..common.blocks import BlockRanges, kv_head
from ..common.layouts import LONGEST_FIRST_MAX_SEQUENCES, gmem_tiled_copy, reshape_acc_to_mn, rows_from
from ..common.mask import alibi_head_slope, apply_alibi, apply_mask, apply_softcap, kernel_mod_args
from ..common.philox import DropoutRng, apply_dropout
from ..common.packed16 import convert_f32_to_16bit
from ..common.softmax import LOG2_E, OnlineSoftmax
from .config import Sm90FwdConfig, smem_bytes
from .epilogue import Epilogue
from .fwd_loads import ForwardLoads
from .primitives import (
    TURN_BARRIER_BASE, f32_after, gemm, opaque_i32, role_namespace, wait_full,
)
from .tile_scheduler import SCHEDULE_STAGES, TailPlan, TileScheduler


class FlashAttnFwdSm90(ForwardLoads):
    """Hopper forward for one configuration (config.py). See the module docstring."""

    # __call__ takes the tail split's workspace and plan after the LSE (cute_flash/launchers.py).
    takes_split_workspace = True

    def __init__(self, config: Sm90FwdConfig):
        self.cfg = config
        self.scheduler = TileScheduler(config)
        self.output = Epilogue(config, self.scheduler)

    def smem_bytes(self, **_) -> int:
        """Dynamic shared memory for Q and the K/V ring (what `cute-flash check` reports)."""
        return smem_bytes(self.cfg)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor,
        mLSEpiece: cute.Tensor,
        mPieceCount: cute.Tensor,
        softmax_scale: cutlass.Float32,
        whole_tiles: Int32,
        split_units: Int32,
        stream: cuda.CUstream,
    ):
        """mOpiece (slots, tile_m, head_dim) and mLSEpiece (slots, tile_m), float32, are the tail
        split's workspace (TailPlan says how much; ignored when split_units is 0, and by kernels
        that never split). The walk's first whole_tiles tiles run whole (the host passes them all
        when it splits none). mPieceCount, int32, holds the counters (zero; the kernel leaves them
        zero again): one per split tile, then the dynamic schedule's; after them the tail plan
        of split_units pieces (TailPlan.words)."""
        self.launch(mQ, mK, mV, mO, mLSE, mOpiece, mLSEpiece, mPieceCount, softmax_scale, whole_tiles, split_units,
                    None, None, None, None, (None,) * 4, stream)

    @cute.jit
    def call_with_mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor,
        mLSEpiece: cute.Tensor,
        mPieceCount: cute.Tensor,
        softmax_scale: cutlass.Float32,
        whole_tiles: Int32,
        split_units: Int32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        philox_seed: cutlass.Int64 | None,
        philox_offset: cutlass.Int64 | None,
        dropout_threshold: Int32 | None,
        dropout_scale: Float32 | None,
        stream: cuda.CUstream,
    ):
        """The entry point of a kernel with score modifications (config.window / softcap / alibi)
        or dropout: __call__'s arguments, then the modifications' values, None for each the
        configuration leaves out (the sm80 forward's order). window_left / window_right: the
        window's sides, an unbounded side given as a bound no row reaches; softcap > 0;
        mAlibiSlopes: (1 or batch, nheads) float32; dropout: Philox seed and offset, the keep
        threshold floor(p * 2^32) and 1 / (1 - p) (kernels/common/philox.py)."""
        self.launch(mQ, mK, mV, mO, mLSE, mOpiece, mLSEpiece, mPieceCount, softmax_scale, whole_tiles, split_units,
                    window_left, window_right, softcap, mAlibiSlopes,
                    (philox_seed, philox_offset, dropout_threshold, dropout_scale), stream)

    @cute.jit
    def call_varlen(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor,
        mLSEpiece: cute.Tensor,
        mPieceCount: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        max_seqlen_q: Int32,
        softmax_scale: cutlass.Float32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """The entry point of a packed variable-length batch (config.varlen), in the sm80
        forward's order: mQ, mO (1, total_q, nheads, head_dim), mK, mV (1, total_k, nheads_kv,
        head_dim), mLSE (1, nheads, total_q); sequence b holds rows cu_seqlens[b] ..
        cu_seqlens[b + 1] - 1 (int32, batch + 1 entries); max_seqlen_q (at least every sequence's
        length) sizes the walk. The workspace as __call__'s (only the dynamic schedule's counter
        is used: no tail is split), score modifications as call_with_mods."""
        self.launch(mQ, mK, mV, mO, mLSE, mOpiece, mLSEpiece, mPieceCount, softmax_scale, Int32(0), Int32(0),
                    window_left, window_right, softcap, mAlibiSlopes, (None,) * 4, stream,
                    varlen_args=(mCuSeqlensQ, mCuSeqlensK, max_seqlen_q))

    @cute.jit
    def launch(self, mQ, mK, mV, mO, mLSE, mOpiece, mLSEpiece, mPieceCount, softmax_scale: Float32,
               whole_tiles: Int32, split_units: Int32, window_left, window_right, softcap, mAlibiSlopes,
               dropout_args, stream: cuda.CUstream, varlen_args=(None,) * 3):
        # (batch, seqlen, heads, d) -> (seqlen, d, heads, batch): the first two modes are what a
        # tile covers; V is viewed transposed, (d, seqlen_k, heads, batch), as the B operand of P V.
        mQ, mK, mO = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mO)
        ]
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.cfg.dtype, self.cfg.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.cfg.num_wg_mma, 1, 1), tiler_mn=(64, self.cfg.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.cfg.dtype, self.cfg.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.cfg.num_wg_mma, 1, 1), tiler_mn=(64, self.cfg.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )

        # Swizzled smem layouts wgmma can read: Q, K are K-major; V^T is MN-major (d contiguous).
        qk_tiler = (self.cfg.tile_m, self.cfg.tile_n, self.cfg.head_dim)
        pv_tiler = (self.cfg.tile_m, self.cfg.head_dim, self.cfg.tile_n)
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tiler, self.cfg.dtype, self.cfg.q_stages)
        sQ_stage_layout = cute.slice_(sQ_layout, (None, None, 0))
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, qk_tiler, self.cfg.dtype, self.cfg.num_stages
        )
        sVt_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, pv_tiler, self.cfg.dtype, self.cfg.num_stages
        )

        # TMA descriptors are built here, from the dynamic-layout tensors of this call.
        # The first `rows` rows within Q's (tile_m, head_dim) smem layout: the box of a piece of Q
        # (q_by_group) and of one warp group's O (wg_tma_store).
        def first_rows(rows):
            return cute.composition(sQ_stage_layout, cute.make_layout((rows, self.cfg.head_dim), stride=(1, self.cfg.tile_m)))

        sQ_piece_layout = first_rows(self.cfg.q_piece_rows)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_piece_layout, (self.cfg.q_piece_rows, self.cfg.head_dim)
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)),
            (self.cfg.tile_n, self.cfg.head_dim),
        )
        tma_atom_V, tma_Vt = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mVt, cute.slice_(sVt_layout, (None, None, 0)),
            (self.cfg.head_dim, self.cfg.tile_n),
        )
        # O's box: a whole tile, or one warp group's 64 rows (wg_tma_store).
        sO_box_layout, o_box_rows = sQ_stage_layout, self.cfg.tile_m
        if const_expr(self.cfg.wg_tma_store):
            sO_box_layout, o_box_rows = first_rows(64), 64
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_box_layout, (o_box_rows, self.cfg.head_dim)
        )
        # Not size_in_bytes: that counts the layout's cosize, and a piece's rows are strided.
        self.tx_bytes_Q = cute.size(sQ_piece_layout) * self.cfg.dtype.width // 8
        self.tx_bytes_KV = cute.size_in_bytes(self.cfg.dtype, cute.slice_(sK_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.q_stages * self.cfg.q_pieces]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.cfg.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.cfg.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.cfg.dtype, cute.cosize(sVt_layout)], 1024]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.cfg.dtype, cute.cosize(sQ_stage_layout) if self.cfg.separate_o else 0], 1024
            ]
            pieces_done: cute.struct.MemRange[Int32, 1]  # the tail split's counter, read back
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * SCHEDULE_STAGES]
            sched_units: cute.struct.MemRange[Int32, SCHEDULE_STAGES]
            # a packed batch's sequences, longest first (TileScheduler.order_sequences)
            seq_order: cute.struct.MemRange[Int32, LONGEST_FIRST_MAX_SEQUENCES if self.cfg.varlen else 0]

        grid_seqlen_q, num_batch = self.scheduler.walk_extent(mQ.shape[0], mQ.shape[3],
                                                              self.scheduler.packed_walk(*varlen_args))
        num_units = self.scheduler.num_units(grid_seqlen_q, mQ.shape[2], num_batch,
                                             SimpleNamespace(whole_tiles=whole_tiles, units=split_units))
        grid_x = num_units
        if const_expr(self.cfg.num_sms > 0):
            grid_x = cutlass.min(num_units, self.cfg.num_sms)
        # With softcap, flash-attn 2's parametrization: scores tanh(s * scale / softcap), softmax at scale softcap.
        score_scale, mods = kernel_mod_args(self.cfg.window, self.cfg.softcap, self.cfg.alibi, softmax_scale,
                                            window_left, window_right, softcap, mAlibiSlopes, self.cfg.dropout,
                                            dropout_args)
        softmax_scale_log2 = score_scale * Float32(LOG2_E)
        gmem_copy_O = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.cfg.dtype, 128, self.cfg.head_dim)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_Vt, tma_atom_O, tma_O, mO, mQ, mK, gmem_copy_O,
            mLSE, mOpiece, mLSEpiece, mPieceCount, whole_tiles, split_units, softmax_scale_log2,
            tiled_mma_qk, tiled_mma_pv,
            sQ_layout, sK_layout, sVt_layout, SharedStorage, *varlen_args, **mods,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,  # programmatic dependent launch: see griddepcontrol_wait in kernel
        )



    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom, mVt: cute.Tensor,
        tma_atom_O: cute.CopyAtom, mO: cute.Tensor,
        mO_gmem: cute.Tensor, mQ_gmem: cute.Tensor, mK_gmem: cute.Tensor, gmem_copy_O: cute.TiledCopy,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor, mLSEpiece: cute.Tensor, mPieceCount: cute.Tensor,
        whole_tiles: Int32, split_units: Int32,
        softmax_scale_log2: Float32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None = None,
        mCuSeqlensK: cute.Tensor | None = None,
        max_seqlen_q: Int32 | None = None,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        softcap_pre: Float32 | None = None,
        mAlibiSlopes: cute.Tensor | None = None,
        alibi_scale: Float32 | None = None,
        philox_seed: cutlass.Int64 | None = None,
        philox_offset: cutlass.Int64 | None = None,
        dropout_threshold: Int32 | None = None,
        dropout_scale: Float32 | None = None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one elected thread per consumer warp.
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cfg.num_mma_threads // 32)
        # With q_by_group, stage q_stage * q_pieces + g holds warp group g's rows of Q stage q_stage,
        # which only g's warps release.
        q_piece_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cfg.num_mma_threads // 32 // self.cfg.q_pieces)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=self.cfg.q_stages * self.cfg.q_pieces,
            producer_group=tma_warp, consumer_group=q_piece_warps,
            tx_count=self.tx_bytes_Q, defer_sync=True,
        )
        pipeline_k, pipeline_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=self.cfg.num_stages,
                producer_group=tma_warp, consumer_group=mma_warps,
                tx_count=self.tx_bytes_KV, defer_sync=True,
            )
            for mbar in (storage.mbar_K, storage.mbar_V)
        ]
        sched = None
        if const_expr(self.cfg.dynamic_schedule):
            sched = dict(
                pipe=pipeline.PipelineAsync.create(
                    barrier_storage=storage.mbar_sched.data_ptr(), num_stages=SCHEDULE_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cfg.num_mma_threads),
                    defer_sync=True,
                ),
                units=storage.sched_units.data_ptr(),
                counter=mPieceCount.iterator + TailPlan.schedule_counter(self.cfg.num_sms),
            )
        # Dependent launch: this grid may start before the kernel ahead of it in the stream has
        # flushed. Nothing above reads or writes global memory; everything below may (the walk
        # plan and the schedule's counter, Q, K, V, O and LSE).
        cute.arch.griddepcontrol_wait()
        walk_plan = None
        if const_expr(self.cfg.planned_tail):
            # A causal kernel never splits its tail: the walk plan takes the counters' place.
            walk_plan = SimpleNamespace(first=mPieceCount[0], units=cute.domain_offset((1,), mPieceCount))
        # A packed batch's sequence bounds (config.varlen), None for a dense one; its walk order is
        # ranked here by all threads, before the barrier below.
        varlen = None
        if const_expr(self.cfg.varlen):
            sOrder = storage.seq_order.get_tensor(cute.make_layout(LONGEST_FIRST_MAX_SEQUENCES))
            varlen = self.scheduler.packed_walk(mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, sOrder)
            self.scheduler.order_sequences(varlen, tidx, self.cfg.num_threads)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        split = SimpleNamespace(whole_tiles=whole_tiles, units=split_units, mO=mOpiece, mLSE=mLSEpiece,
                                mCount=mPieceCount, done=storage.pieces_done.get_tensor(cute.make_layout(1)))
        sO = sQ
        if const_expr(self.cfg.separate_o):
            sQ_stage_layout = cute.slice_(sQ_layout, (None, None, 0))
            sO = storage.sO.get_tensor(sQ_stage_layout.outer, swizzle=sQ_stage_layout.inner)

        # The window's sides, None without one (config.window).
        window = (window_left, window_right) if const_expr(self.cfg.window) else None
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.register_split[0])
            if warp_idx == 0:
                self.producer(
                    tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt,
                    pipeline_q, pipeline_k, pipeline_v, split, role_namespace(sched), walk_plan, window, varlen,
                )
        else:
            cute.arch.setmaxregister_increase(self.cfg.register_split[1])
            self.consumer(
                tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_O, mO, mO_gmem, mQ_gmem, mK_gmem, gmem_copy_O,
                mLSE, pipeline_q, pipeline_k, pipeline_v, tidx - 128, mQ.shape[0], mK.shape[0], softmax_scale_log2,
                split, role_namespace(sched), walk_plan, window, softcap_pre, mAlibiSlopes, alibi_scale,
                (philox_seed, philox_offset, dropout_threshold, dropout_scale), varlen,
            )


    @cute.jit
    def consumer(
        self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_O, mO, mO_gmem, mQ_gmem, mK_gmem, gmem_copy_O, mLSE,
        pipeline_q, pipeline_k, pipeline_v, tidx, seqlen_q, seqlen_k, softmax_scale_log2, split, sched, walk_plan,
        window, softcap_pre, mAlibiSlopes, alibi_scale, dropout_args, varlen,
    ):
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.cfg.tile_m, self.cfg.head_dim)))
        # P as the register A operand of the PV wgmma. Its k-blocks of 16 columns are pairs of
        # the S accumulator's 8-column chunks, so both fragments share one register order.
        tOrP = tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((self.cfg.tile_m, self.cfg.tile_n)))

        softmax = OnlineSoftmax.create(
            softmax_scale_log2, cute.size(reshape_acc_to_mn(acc_O), mode=[0])
        )

        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.cfg.dtype),
            tiled_mma_pv,
        )

        # Ping-pong: the last consumer warp group lets the first one take the first turn.
        if wg_idx == self.cfg.num_wg_mma - 1:
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER_BASE, number_of_threads=256)

        num_heads = mO.shape[2]
        seqlen_q, num_batch = self.scheduler.walk_extent(seqlen_q, mO.shape[3], varlen)
        block_ranges = BlockRanges(self.cfg.tile_m, self.cfg.tile_n, self.cfg.causal)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages)
        # This warp group's first Q stage: its own piece of the first Q buffer (q_by_group).
        q_state = pipeline.PipelineState(
            self.cfg.q_stages * self.cfg.q_pieces, Int32(0), wg_idx if const_expr(self.cfg.q_by_group) else Int32(0), Int32(0)
        )
        num_units = self.scheduler.num_units(seqlen_q, num_heads, num_batch, split)
        round_idx = Int32(0)
        unit = self.scheduler.unit_of_round(round_idx, walk_plan)
        sched_state = None
        if const_expr(self.cfg.dynamic_schedule):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHEDULE_STAGES)
            unit, sched_state = self.scheduler.receive_unit(sched, sched_state)
        while unit < num_units:
            next_unit = unit
            if const_expr(self.cfg.planned_tail):
                # Read now: in the planned rounds it comes from global memory.
                next_unit = self.scheduler.unit_of_round(round_idx + 1, walk_plan)
            m_block, head, batch, n_block_min, n_block_max, slot, seq = self.scheduler.unit_work(
                unit, seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split, window, varlen
            )
            mQ_seq, mK_seq, mO_seq, mLSE_seq, batch_idx = self.sequence_tensors(
                seq, batch, mQ_gmem, mK_gmem, mO_gmem, mLSE)
            alibi_slope = alibi_head_slope(mAlibiSlopes, alibi_scale, batch, head)
            rng = None
            if const_expr(self.cfg.dropout):
                rng = DropoutRng.create(*dropout_args[:3], batch * num_heads + head)
            acc_O.fill(0.0)
            softmax.reset()
            q_buffer = q_state.index // self.cfg.q_pieces  # this tile's Q stage (a piece's stage with q_by_group)
            c = SimpleNamespace(
                tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK,
                tOrVt=tOrVt, acc_S=acc_S, acc_O=acc_O, tOrP=tOrP, thr_qk=thr_qk, softmax=softmax,
                pipeline_k=pipeline_k, pipeline_v=pipeline_v, wg_idx=wg_idx, m_block=m_block,
                seqlen_q=seq.seqlen_q, seqlen_k=seq.seqlen_k, q_index=q_buffer,
                pipeline_q=pipeline_q, q_state=q_state, mQ=mQ_seq, mK=mK_seq, head=head, batch=batch_idx,
                window=window, softcap_pre=softcap_pre, alibi_slope=alibi_slope, rng=rng,
            )
            if n_block_max > n_block_min:
                wait_full(pipeline_q, q_state, self.cfg.spin_waits)
                wg_n_block_max = self.wg_n_block_max(c, n_block_min, n_block_max, block_ranges)
                wg_n_block_min = n_block_min
                if const_expr(self.cfg.window):
                    wg_n_block_min, wg_n_block_max = self.wg_window_blocks(c, n_block_min, wg_n_block_max)
                runs_mainloop = wg_n_block_max > wg_n_block_min
                kv_state = self.pass_blocks(
                    c, kv_state, n_block_max - cutlass.max(wg_n_block_max, n_block_min), runs_mainloop
                )
                if runs_mainloop:
                    kv_state = self.mainloop(c, kv_state, wg_n_block_min, wg_n_block_max, block_ranges)
                    if const_expr(self.cfg.window):
                        # The blocks past the window's left edge of this group's rows, visited last.
                        kv_state = self.pass_blocks(c, kv_state, wg_n_block_min - n_block_min, True)
                if const_expr(self.cfg.separate_o or (self.cfg.o_from_registers and not self.cfg.release_q_early)):
                    # The producer may load the next tile's Q while this one's epilogue runs.
                    pipeline_q.consumer_release(q_state)
                elif const_expr(self.cfg.release_q_early):
                    if not runs_mainloop:  # else the mainloop released Q after its last S GEMM
                        pipeline_q.consumer_release(q_state)
            tidx_tile = tidx
            if const_expr(self.cfg.recompute_epilogue):
                # From values the compiler cannot see through, so that what the epilogue derives
                # from them is not hoisted out of the tile loop (see __init__).
                tidx_tile = opaque_i32(tidx)
                m_block, head, batch, n_block_min, n_block_max, slot, seq = self.scheduler.unit_work(
                    opaque_i32(unit), seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split, window, varlen
                )
                mQ_seq, mK_seq, mO_seq, mLSE_seq, batch_idx = self.sequence_tensors(
                    seq, batch, mQ_gmem, mK_gmem, mO_gmem, mLSE)
            tOcO_mn = reshape_acc_to_mn(
                tiled_mma_pv.get_slice(tidx_tile).partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.head_dim)))
            )
            row_scale = softmax.finalize()
            if const_expr(self.cfg.dropout):
                # kept probabilities count 1 / (1 - p) times; the LSE keeps every probability
                row_scale.store(row_scale.load() * dropout_args[3])
            softmax.rescale_O(acc_O, row_scale)
            if const_expr(self.cfg.o_from_registers):
                store = partial(self.output.store_O_from_registers, acc_O, softmax.row_sum, tOcO_mn, tidx_tile, mO_seq,
                                mLSE_seq, m_block, head, batch_idx, seq.seqlen_q)
            else:
                # O through its own buffer, or through this tile's stage of Q's.
                sO_tile = sO if const_expr(self.cfg.separate_o) else sO[None, None, q_buffer]
                store = partial(self.output.store_O_through_smem, acc_O, softmax.row_sum, tOcO_mn, smem_copy_O, sO_tile, tma_atom_O,
                                mO, mO_gmem, gmem_copy_O, mLSE, tidx_tile, wg_idx, m_block, head, batch, seqlen_q)
            if const_expr(self.cfg.splits_tail):
                # A tile that one piece covers (stream_k) stores itself, like a whole tile.
                whole = slot < 0
                if not whole:
                    whole = self.scheduler.tail_plan_words(split)[slot * TailPlan.UNIT_WORDS + 3] == 1
                if whole:
                    store()
                else:
                    self.output.merge_pieces(acc_O, softmax.row_sum, tOcO_mn, tidx_tile, slot, split, mO_gmem, mLSE,
                                      m_block, head, batch, seqlen_q)
            else:
                store()
            if n_block_max > n_block_min:
                if const_expr(not (self.cfg.separate_o or self.cfg.o_from_registers)):
                    # O went out through Q's buffer; the epilogue waited until TMA had read it.
                    pipeline_q.consumer_release(q_state)
                for _ in cutlass.range_constexpr(self.cfg.q_pieces):
                    q_state.advance()
            round_idx += 1
            if const_expr(self.cfg.dynamic_schedule):
                unit, sched_state = self.scheduler.receive_unit(sched, sched_state)
            elif const_expr(self.cfg.planned_tail):
                unit = next_unit
            else:
                unit = self.scheduler.unit_of_round(round_idx, walk_plan)
        if const_expr(self.cfg.wg_tma_store):
            # sO must outlive the last store's read.
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    def sequence_tensors(self, seq, batch, mQ, mK, mO, mLSE):
        """What the consumers address for a unit's sequence (unit_work's `seq`): Q, K, O, LSE
        and the batch index into them. Dense, the kernel's tensors and `batch`; packed, each
        from the sequence's first row on, at batch index 0 (their batch mode has size 1)."""
        if const_expr(not self.cfg.varlen):
            return mQ, mK, mO, mLSE, batch
        return (rows_from(mQ, seq.offset_q, 0), rows_from(mK, seq.offset_k, 0), rows_from(mO, seq.offset_q, 0),
                rows_from(mLSE, seq.offset_q, 2), 0)

    @cute.jit
    def mainloop(self, c, kv_state, n_block_min, n_block_max, block_ranges):
        """Algorithm 1's inner loop over the K/V blocks [n_block_min, n_block_max) of one unit,
        last block first."""
        # Blocks from n_block_right_mask on cross the causal diagonal or the window's right edge for
        # some row of the tile, blocks below n_block_left_mask the window's left edge.
        n_block_right_mask = n_block_max
        if const_expr(self.cfg.causal):
            n_block_right_mask = block_ranges.n_block_min_causal_mask(c.m_block, c.seqlen_q, c.seqlen_k, 0)
        n_block_left_mask = n_block_min
        if const_expr(self.cfg.window):
            n_block_right_mask, n_block_left_mask = block_ranges.n_block_window_masks(
                c.m_block, c.seqlen_q, c.seqlen_k, *c.window
            )
        # Blocks [n_block_left_mask, n_block_unmasked) need no mask; the last block is always masked
        # (a piece's last block is inside seqlen_k unless the piece ends the row: masking is harmless).
        n_block_unmasked = cutlass.min(n_block_right_mask, n_block_max - 1)
        if const_expr(self.cfg.window):
            n_block_unmasked = cutlass.max(n_block_unmasked, n_block_min)
            n_block_left_mask = cutlass.max(cutlass.min(n_block_left_mask, n_block_unmasked), n_block_min)
        # First block: S and softmax only; its PV GEMM overlaps the next block's S GEMM.
        wait_full(c.pipeline_k, kv_state, self.cfg.spin_waits)
        self.gemm_qk(c, kv_state.index)
        warpgroup.wait_group(0)
        c.pipeline_k.consumer_release(kv_state)
        self.score_mods(c, n_block_max - 1)
        self.mask(c, n_block_max - 1, True)
        c.softmax.online_softmax(c.acc_S, is_first=True)
        self.convert_P(c, n_block_max - 1)
        if const_expr(self.cfg.causal or self.cfg.window):
            for i in cutlass.range(n_block_max - 1 - n_block_unmasked, unroll=1):
                kv_state = self.one_block(c, kv_state, n_block_max - 2 - i, True)
        for i in cutlass.range(n_block_unmasked - n_block_left_mask, unroll=1):
            kv_state = self.one_block(c, kv_state, n_block_unmasked - 1 - i, False)
        if const_expr(self.cfg.window):
            for i in cutlass.range(n_block_left_mask - n_block_min, unroll=1):
                kv_state = self.one_block(c, kv_state, n_block_left_mask - 1 - i, True)
        if const_expr(self.cfg.release_q_early):
            # The S GEMMs are done and O will not pass through Q's buffer: the next Q may load.
            c.pipeline_q.consumer_release(c.q_state)
        wait_full(c.pipeline_v, kv_state, self.cfg.spin_waits)
        self.gemm_pv(c, kv_state.index)
        warpgroup.wait_group(0)
        c.pipeline_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def wg_n_block_max(self, c, n_block_min, n_block_max, block_ranges):
        """End of the K/V blocks this warp group's 64 rows need: n_block_min when none of its rows
        exist (the last m_block of a ragged seqlen_q); causal, the end of its own rows' diagonal,
        which for the first groups of a tile can lie a block before the tile's."""
        wg_row = c.m_block * self.cfg.tile_m + c.wg_idx * 64
        wg_n_block_max = n_block_min
        if wg_row < c.seqlen_q:
            wg_n_block_max = n_block_max
            if const_expr(self.cfg.causal):
                wg_n_block_max = cutlass.min(
                    n_block_max, block_ranges.n_block_end(wg_row + 64, c.seqlen_q, c.seqlen_k)
                )
        return wg_n_block_max

    @cute.jit
    def wg_window_blocks(self, c, n_block_min, wg_n_block_max):
        """With a window, the blocks [wg_n_block_min, wg_n_block_max) of the tile's that this warp
        group's own rows see (a 64-row BlockRanges of its own: a group's rows reach a block or two
        less far than the tile's on either side, with 192-row tiles); (n_block_min, n_block_min)
        when they see none or do not exist, so that the group passes the whole tile."""
        wg_window_min, wg_window_max = BlockRanges(64, self.cfg.tile_n, False).n_block_min_max_window(
            c.m_block * self.cfg.num_wg_mma + c.wg_idx, c.seqlen_q, c.seqlen_k, *c.window
        )
        wg_n_block_min = cutlass.max(n_block_min, wg_window_min)
        wg_n_block_max = cutlass.min(wg_n_block_max, wg_window_max)
        sees_none = wg_n_block_min >= wg_n_block_max
        return (n_block_min if sees_none else wg_n_block_min), (n_block_min if sees_none else wg_n_block_max)

    @cute.jit
    def pass_blocks(self, c, kv_state, num_blocks, mainloop_follows):
        """The mainloop's waits, releases and ping-pong turns without its GEMMs and softmax, for
        blocks this warp group does not need (wg_n_block_max): every block of the tile, when none
        of its rows exist, or, causal, the first blocks visited, which only the tile's later rows
        see (with a window also the last ones, past its rows' left edge: wg_window_blocks). The
        other groups run as before and the tile costs about what its needed blocks do. The
        mainloop takes a turn for every block but its first: a group passing the whole tile takes
        one less, one passing blocks before or after its mainloop one per block."""
        for i in cutlass.range(num_blocks, unroll=1):
            wait_full(c.pipeline_k, kv_state, self.cfg.spin_waits)
            c.pipeline_k.consumer_release(kv_state)
            if mainloop_follows or i > 0:
                self.turn_wait(c.wg_idx)
                self.turn_signal(c.wg_idx)
            wait_full(c.pipeline_v, kv_state, self.cfg.spin_waits)
            c.pipeline_v.consumer_release(kv_state)
            kv_state.advance()
        return kv_state

    # ------------------------------------------------------------------ one K/V block

    def gemm_qk(self, c, stage):
        gemm(c.tiled_mma_qk, c.acc_S, c.tSrQ[None, None, None, c.q_index], c.tSrK[None, None, None, stage],
             zero_init=True)

    def gemm_pv(self, c, stage):
        gemm(c.tiled_mma_pv, c.acc_O, c.tOrP, c.tOrVt[None, None, None, stage], zero_init=False)

    def convert_P(self, c, n_block):
        if const_expr(self.cfg.dropout):
            # After the row sums took P: dropped probabilities leave P V only.
            apply_dropout(c.acc_S, c.thr_qk, self.cfg.tile_m, self.cfg.tile_n, c.m_block, n_block, c.rng,
                          encode_in_sign=False)
        # Not `tOrP.store(acc_S.load().to(dtype))`: LLVM sinks that pure conversion to its use, the
        # PV GEMM of the next block, which is issued after that block's S GEMM. S of the previous
        # block then stays live (and is copied) while the new S GEMM is in flight: 64 extra
        # registers, and ptxas serializes every wgmma of the kernel (C7512) once the masked loop
        # overlaps. The conversion below is an asm statement with side effects, so it stays here.
        convert_f32_to_16bit(c.acc_S, c.tOrP)

    @cute.jit
    def one_block(self, c, kv_state, n_block, masked: cutlass.Constexpr):
        """S GEMM of n_block overlapped with the PV GEMM of the block before it; `masked`: a block
        crossing the causal diagonal or an edge of the window."""
        kv_state_v = kv_state.clone()
        kv_state.advance()
        wait_full(c.pipeline_k, kv_state, self.cfg.spin_waits)
        self.turn_wait(c.wg_idx)
        self.gemm_qk(c, kv_state.index)
        # V's wait inside the turn, after the S GEMM is issued: the producer loads this block's K
        # before the previous block's V, so waiting for V before the turn delays the turn and
        # every group behind it (2026-11-24: -2.4 to -4.0% at long non-causal d64).
        wait_full(c.pipeline_v, kv_state_v, self.cfg.spin_waits)
        self.gemm_pv(c, kv_state_v.index)
        self.turn_signal(c.wg_idx)
        warpgroup.wait_group(1)  # S is ready; the PV GEMM may still run
        c.pipeline_k.consumer_release(kv_state)
        self.score_mods(c, n_block)
        if const_expr(masked):
            self.mask(c, n_block, False)
        if const_expr(self.cfg.stale_max and not masked):
            # stale_max: the exponentials first, while the PV GEMM runs; its wait before P's registers
            # are rewritten (and O, in the rare rescale).
            block_sum = cute.make_rmem_tensor_like(c.softmax.row_sum, Float32)
            outgrown = c.softmax.exponentiate_stale(c.acc_S, block_sum)
            warpgroup.wait_group(0)
            c.softmax.settle_stale(outgrown, c.acc_S, c.acc_O, block_sum, partial(self.rescore, c, n_block))
            c.pipeline_v.consumer_release(kv_state_v)
            self.convert_P(c, n_block)
            return kv_state
        # Wait for the previous block's PV GEMM between the row maxima and the exponentials, with
        # the exponentials made to depend on O (f32_after): otherwise ptxas places that wait where
        # it likes, after 0-12 of the exponentials, by dtype and by unrelated options. Measured
        # (interleaved A/B, bf16 / fp16, 2026-11-23): non-causal d128 +1.5-2.1% at 4k, +2.6-3.6%
        # at 8k; d256 +0.6-2.1% at 8k, causal 2k +0.3-3.7%; d64 non-causal +1.5% at 512, +2.5% at
        # 2k, fp16 +0.7-1.4% at 4k-16k; causal d64 4k +1.7%; elsewhere within +-1.2% (noise).
        if const_expr(self.cfg.lazy_rescale):
            row_max_new, grows = c.softmax.grown_row_max(c.acc_S)
            warpgroup.wait_group(0)
            c.softmax.rescale_if_grown(c.acc_O, row_max_new, grows)
            max_scaled = c.softmax.max_scaled()
            row_scale = None
        else:
            max_scaled, row_scale = c.softmax.update_row_max(c.acc_S)
            warpgroup.wait_group(0)
        for r in cutlass.range_constexpr(cute.size(max_scaled)):
            max_scaled[r] = f32_after(max_scaled[r], c.acc_O[0])
        c.softmax.exponentiate(c.acc_S, max_scaled, row_scale)
        c.pipeline_v.consumer_release(kv_state_v)
        self.convert_P(c, n_block)
        if const_expr(not self.cfg.lazy_rescale):
            c.softmax.rescale_O(c.acc_O, row_scale)
        return kv_state

    @cute.jit
    def rescore(self, c, n_block):
        """S of this thread's entries of block n_block again, on CUDA cores from Q and K in global
        memory: the redo of a block whose exponentials overflowed against the stale running max
        (stale_max: a score 128 / scale_log2 above it, rare enough that speed does not matter).
        Rows past seqlen_q, which no one stores, score against the last row of Q."""
        tScS = c.thr_qk.partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
        head_kv = kv_head(c.head, c.mQ.shape[2], c.mK.shape[2])
        for i in cutlass.range_constexpr(cute.size(c.acc_S)):
            q_row = c.mQ[cutlass.min(c.m_block * self.cfg.tile_m + tScS[i][0], c.seqlen_q - 1), None, c.head, c.batch]
            k_row = c.mK[n_block * self.cfg.tile_n + tScS[i][1], None, head_kv, c.batch]
            score = Float32.zero
            for k in cutlass.range(self.cfg.head_dim, unroll=1):
                score += q_row[k].to(Float32) * k_row[k].to(Float32)
            c.acc_S[i] = score
        self.score_mods(c, n_block)  # (only unmasked blocks are rescored)

    # ------------------------------------------------------------------ ping-pong

    def turn_wait(self, wg_idx):
        """Wait for this warp group's turn to issue GEMMs."""
        cute.arch.barrier(barrier_id=TURN_BARRIER_BASE + wg_idx, number_of_threads=256)

    def turn_signal(self, wg_idx):
        """Hand the turn to the next consumer warp group."""
        next_wg = wg_idx + 1
        if const_expr(self.cfg.num_wg_mma == 2):
            next_wg = 1 - wg_idx
        else:
            next_wg = (wg_idx + 1) % self.cfg.num_wg_mma
        cute.arch.barrier_arrive(barrier_id=TURN_BARRIER_BASE + next_wg, number_of_threads=256)

    def mask(self, c, n_block, mask_seqlen: bool):
        """The causal diagonal's or the window's mask (with `mask_seqlen`, also seqlen_k's)."""
        apply_mask(c.acc_S, c.thr_qk, self.cfg.tile_m, self.cfg.tile_n, c.m_block, n_block,
                   c.seqlen_q, c.seqlen_k, mask_seqlen, self.cfg.causal, window=c.window)

    def score_mods(self, c, n_block):
        """softcap, then ALiBi, on S of n_block, before any mask (flash-attn 2's order: a capped
        -inf would be -1)."""
        if const_expr(self.cfg.softcap):
            apply_softcap(c.acc_S, c.softcap_pre)
        if const_expr(self.cfg.alibi):
            apply_alibi(c.acc_S, c.thr_qk, self.cfg.tile_m, self.cfg.tile_n, c.m_block, n_block, c.seqlen_q,
                        c.seqlen_k, c.alibi_slope)

    # ------------------------------------------------------------------ tail split
