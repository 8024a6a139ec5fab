"""FlashAttention forward for fp32 inputs on Hopper (sm_90a): split TF32 on wgmma.

FlashAttention-2 Algorithm 1 with every product a split-TF32 one: a b ~ a_hi b_hi + a_hi b_lo +
a_lo b_hi, three TF32 wgmma chains into one fp32 accumulator (the dropped a_lo b_lo is ~2^-22 of
the product). The tensor cores truncate an fp32 word to TF32 (warpgroup_tf32.py), so raw fp32 data
is the hi part and lo = x - trunc13(x), exact in fp32.

* A prepass (fwd_tf32_prep.py) writes K_lo, V^T and V^T_lo to a workspace: TF32 B operands must be
  K-major in smem, which V (the PV GEMM's B, K = keys) is not, and TMA does not transpose 32-bit
  data. `__call__` launches the prepass and then the main kernel on the same stream.
* One CTA per (m_block, head, batch) tile of tile_m rows; causal tiles launch the longest first.
* Warp group 0 is the producer: one warp issues TMA loads of Q (once), and per key block of K with
  K_lo (one mbarrier stage) and of V^T with V^T_lo (another), `num_stages` blocks deep, through
  `cutlass.pipeline.PipelineTmaAsync`. It gives its registers to the consumers (setmaxnreg).
* Warp groups 1 and 2 are consumers, 64 rows each. Q_lo sits in registers for the whole tile, Q_hi
  in smem. Per key block, from the last one down (the masked blocks
  first, as in fwd.py):
      S  = Q_lo K + Q_hi K_lo + Q_hi K         (wgmma: A from registers or smem, B = the K tiles)
      mask, online softmax (kernels/common/softmax.py), O *= row factors
      P_hi = trunc13(P), P_lo = P - P_hi       (registers of their own: warpgroup_tf32.tf32_hi)
      O += P_lo V + P_hi V_lo + P_hi V         (wgmma: A = P's registers, B = the V^T tiles)
  The small terms go first, before the large one moves the accumulator.
* Options (config): `overlap` issues each block's S GEMM with the previous block's PV GEMM, as
  fwd.py does; `pingpong` makes the two consumer warp groups take turns issuing their GEMMs;
  `block_accumulator` gives each block's PV GEMM a zeroed accumulator of its own and adds it into O
  with fp32 adds (the tensor cores' accumulation rounds toward zero: the bias would otherwise grow
  with the number of MMAs into O).
* Epilogue: O normalized and stored from registers (fp32, clipped at seqlen_q); LSE from registers
  (epilogue.py: store_lse).

Not (yet) here, unlike the 16-bit forward: persistent CTAs and tile schedules, per-warp-group block
ranges (both groups of a causal tile walk all its blocks), score modifications, dropout, packed
batches; fp32 with those runs the sm80 forward.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, TFloat32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.tensor_utils.layout import LayoutEnum

from ..common.blocks import BlockRanges, kv_head
from ..common.layouts import reshape_acc_to_mn
from ..common.mask import apply_mask
from ..common.softmax import LOG2_E, OnlineSoftmax
from .config import Sm90Tf32FwdConfig, tf32_smem_bytes
from .epilogue import Epilogue
from .fwd_tf32_prep import Tf32Prepass
from .primitives import TURN_BARRIER_BASE, acquire_empty, f32_after, wait_full
from .warpgroup_tf32 import tf32_hi, tf32_lo, tiled_mma_tf32


def as_tf32(sX: cute.Tensor, layout: cute.ComposedLayout) -> cute.Tensor:
    """An fp32 smem tile (what TMA wrote) as the TFloat32 tensor the MMA reads; the swizzle is
    named again (cute.recast_tensor would drop it from the pointer, and the descriptor with it)."""
    return cute.make_tensor(cute.recast_ptr(sX.iterator, layout.inner, dtype=TFloat32), layout.outer)


def acc_as_frgA(acc: cute.Tensor) -> cute.Tensor:
    """The m64nN TF32 accumulator ((2 columns, 2 row halves, N/8 blocks), 1, 1) viewed as the
    A operand ((2 row halves, 2 k halves), 1, N/8 k steps) of a product over its columns, in
    TFloat32. Column pair c of a block is k half c of its step once the B operand's keys are
    permuted (fwd_tf32_prep.py), so only the first two value modes swap."""
    (shape_c, shape_r, shape_n), (stride_c, stride_r, stride_n) = acc.layout.shape[0], acc.layout.stride[0]
    layout = cute.make_layout(((shape_r, shape_c), 1, shape_n), stride=((stride_r, stride_c), 0, stride_n))
    return cute.make_tensor(cute.recast_ptr(acc.iterator, dtype=TFloat32), layout)


@cute.jit
def gemm_chains(chains, acc: cute.Tensor, zero_init: cutlass.Constexpr):
    """Issue the products (tiled_mma, A fragment, B fragment) of `chains`, each over all its k steps,
    into acc as one wgmma commit group; does not wait."""
    warpgroup.fence()
    first = True
    for tiled_mma, tCrA, tCrB in chains:
        # A fresh atom carries the accumulate flag (primitives.gemm says why).
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            mma_atom.set(warpgroup.Field.ACCUMULATE, not (zero_init and first and k == 0))
            cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        first = False
    warpgroup.commit_group()


@cute.jit
def split_fragment(src: cute.Tensor, lo: cute.Tensor, hi: cute.Tensor | None = None):
    """lo <- src - trunc13(src) and (if given) hi <- trunc13(src), elementwise: src fp32 or
    TFloat32 registers, hi and lo TFloat32."""
    for i in cutlass.range_constexpr(cute.size(src)):
        x = Float32(src[i])
        if const_expr(hi is None):
            lo[i] = TFloat32(tf32_lo(x))
        else:
            x_hi = tf32_hi(x)
            hi[i] = TFloat32(x_hi)
            lo[i] = TFloat32(x - x_hi)


class FlashAttnFwdSm90Tf32:
    """Hopper split-TF32 forward for one configuration (config.py: Sm90Tf32FwdConfig)."""

    def __init__(self, config: Sm90Tf32FwdConfig):
        self.cfg = config
        self.prepass = Tf32Prepass(config.head_dim)
        self.output = Epilogue(config, None)  # only its store_lse, which reads cfg.tile_m

    def smem_bytes(self, **_) -> int:
        return tf32_smem_bytes(self.cfg)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mKlo: cute.Tensor,
        mVt: cute.Tensor,
        mVtlo: cute.Tensor,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        """q, k, v, out (batch, seqlen, heads, head_dim) fp32, lse (batch, heads, seqlen_q); the
        workspace the prepass fills: K_lo like k, V^T and V^T_lo (batch, heads_kv, head_dim,
        seqlen_k rounded up to 8: fwd_tf32_prep.padded_seqlen_k)."""
        self.prepass(mK, mV, mKlo, mVt, mVtlo, stream)
        cfg = self.cfg
        # (batch, seqlen, heads, d) -> (seqlen, d, heads, batch); V^T (batch, heads, d, keys) ->
        # (d, keys, heads, batch): the first two modes are what a tile covers.
        mQ, mK, mKlo, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                            for t in (mQ, mK, mKlo, mO)]
        mVt, mVtlo = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0])) for t in (mVt, mVtlo)]

        tiled_mma_qk = tiled_mma_tf32(cfg.num_wg_mma, cfg.tile_n, OperandSource.RMEM)  # Q_lo
        tiled_mma_qk_hi = tiled_mma_tf32(cfg.num_wg_mma, cfg.tile_n, OperandSource.SMEM)  # Q_hi
        tiled_mma_pv = tiled_mma_tf32(cfg.num_wg_mma, cfg.head_dim, OperandSource.RMEM)

        # Every operand tile K-major (32 fp32 words per 128-byte swizzled row).
        qk_tiler = (cfg.tile_m, cfg.tile_n, cfg.head_dim)
        pv_tiler = (cfg.tile_m, cfg.head_dim, cfg.tile_n)
        sQ_layout = cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tiler, TFloat32, 1),
                                (None, None, 0))
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tiler, TFloat32, cfg.num_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, pv_tiler, TFloat32, cfg.num_stages)
        sK_stage, sVt_stage = cute.slice_(sK_layout, (None, None, 0)), cute.slice_(sVt_layout, (None, None, 0))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (cfg.tile_m, cfg.head_dim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, sK_stage, (cfg.tile_n, cfg.head_dim))
        tma_atom_Klo, tma_Klo = cpasync.make_tiled_tma_atom(g2s, mKlo, sK_stage, (cfg.tile_n, cfg.head_dim))
        tma_atom_V, tma_Vt = cpasync.make_tiled_tma_atom(g2s, mVt, sVt_stage, (cfg.head_dim, cfg.tile_n))
        tma_atom_Vlo, tma_Vtlo = cpasync.make_tiled_tma_atom(g2s, mVtlo, sVt_stage, (cfg.head_dim, cfg.tile_n))
        self.tx_bytes_Q = cute.size_in_bytes(Float32, sQ_layout)
        # A K stage is K and K_lo, a V stage V^T and V^T_lo: two TMA copies on one barrier.
        self.tx_bytes_KV = 2 * cute.size_in_bytes(Float32, sK_stage)

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sK_layout)], 1024]
            sKlo: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sK_layout)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sVt_layout)], 1024]
            sVtlo: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sVt_layout)], 1024]

        num_m_blocks = cute.ceil_div(mQ.shape[0], cfg.tile_m)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_Klo, tma_Klo, tma_atom_V, tma_Vt, tma_atom_Vlo, tma_Vtlo,
            mO, mLSE, mQ.shape[0], mK.shape[0], softmax_scale * Float32(LOG2_E),
            tiled_mma_qk, tiled_mma_qk_hi, tiled_mma_pv, sQ_layout, sK_layout, sVt_layout, SharedStorage,
        ).launch(
            grid=[num_m_blocks, mQ.shape[2], mQ.shape[3]],
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,  # griddepcontrol_wait below orders it after the prepass
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_Klo: cute.CopyAtom, mKlo: cute.Tensor,
        tma_atom_V: cute.CopyAtom, mVt: cute.Tensor,
        tma_atom_Vlo: cute.CopyAtom, mVtlo: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor,
        seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32,
        tiled_mma_qk: cute.TiledMma, tiled_mma_qk_hi: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head, batch = cute.arch.block_idx()
        # Causal tiles, longest first: the last m_block sees the most keys.
        m_block = block_x
        if const_expr(cfg.causal):
            m_block = cute.arch.grid_dim()[0] - 1 - block_x

        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_Klo, tma_atom_V, tma_atom_Vlo):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.num_mma_threads // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=mma_warps, tx_count=self.tx_bytes_Q, defer_sync=True,
        )
        pipeline_k, pipeline_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=cfg.num_stages, producer_group=tma_warp,
                consumer_group=mma_warps, tx_count=self.tx_bytes_KV, defer_sync=True,
            )
            for mbar in (storage.mbar_K, storage.mbar_V)
        ]
        # Dependent launch: wait for the prepass (and whatever wrote Q, K, V) before any global access.
        cute.arch.griddepcontrol_wait()
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sKlo = storage.sKlo.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        sVtlo = storage.sVtlo.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        block_ranges = BlockRanges(cfg.tile_m, cfg.tile_n, cfg.causal)
        n_block_min, n_block_max = block_ranges.n_block_min_max(m_block, seqlen_q, seqlen_k)
        head_kv = kv_head(head, mQ.shape[2], mK.shape[2])
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.register_split[0])
            if warp_idx == 0:
                self.producer(
                    tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_Klo, mKlo, tma_atom_V, mVt, tma_atom_Vlo, mVtlo,
                    sQ, sK, sKlo, sVt, sVtlo, pipeline_q, pipeline_k, pipeline_v,
                    m_block, head, head_kv, batch, n_block_min, n_block_max,
                )
        else:
            cute.arch.setmaxregister_increase(cfg.register_split[1])
            self.consumer(
                tiled_mma_qk, tiled_mma_qk_hi, tiled_mma_pv, sQ_layout, sK_layout, sVt_layout,
                sQ, sK, sKlo, sVt, sVtlo, pipeline_q, pipeline_k, pipeline_v, mO, mLSE, tidx - 128,
                m_block, head, batch, n_block_min, n_block_max, seqlen_q, seqlen_k, softmax_scale_log2,
            )

    # ------------------------------------------------------------------ producer

    @cute.jit
    def producer(
        self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_Klo, mKlo, tma_atom_V, mVt, tma_atom_Vlo, mVtlo,
        sQ, sK, sKlo, sVt, sVtlo, pipeline_q, pipeline_k, pipeline_v,
        m_block, head, head_kv, batch, n_block_min, n_block_max,
    ):
        cfg = self.cfg
        if n_block_max > n_block_min:
            no_mcast = cute.make_layout(1)

            def views(atom, sX, gX):
                return cpasync.tma_partition(atom, 0, no_mcast, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))

            gQ = cute.local_tile(mQ[None, None, head, batch], (cfg.tile_m, cfg.head_dim), (m_block, 0))
            tQsQ, tQgQ = views(tma_atom_Q, sQ, gQ)
            k_tile, vt_tile = (cfg.tile_n, cfg.head_dim), (cfg.head_dim, cfg.tile_n)
            tKsK, tKgK = views(tma_atom_K, sK, cute.local_tile(mK[None, None, head_kv, batch], k_tile, (None, 0)))
            tKsKlo, tKgKlo = views(tma_atom_Klo, sKlo,
                                   cute.local_tile(mKlo[None, None, head_kv, batch], k_tile, (None, 0)))
            tVsVt, tVgVt = views(tma_atom_V, sVt, cute.local_tile(mVt[None, None, head_kv, batch], vt_tile, (0, None)))
            tVsVtlo, tVgVtlo = views(tma_atom_Vlo, sVtlo,
                                     cute.local_tile(mVtlo[None, None, head_kv, batch], vt_tile, (0, None)))

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
            acquire_empty(pipeline_q, q_state, True)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                n_block = n_block_max - 1 - i
                # K (with K_lo) first: the consumers' S GEMM of a block comes before its PV GEMM.
                acquire_empty(pipeline_k, kv_state, True)
                bar_k = pipeline_k.producer_get_barrier(kv_state)
                cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, kv_state.index], tma_bar_ptr=bar_k)
                cute.copy(tma_atom_Klo, tKgKlo[None, n_block], tKsKlo[None, kv_state.index], tma_bar_ptr=bar_k)
                acquire_empty(pipeline_v, kv_state, True)
                bar_v = pipeline_v.producer_get_barrier(kv_state)
                cute.copy(tma_atom_V, tVgVt[None, n_block], tVsVt[None, kv_state.index], tma_bar_ptr=bar_v)
                cute.copy(tma_atom_Vlo, tVgVtlo[None, n_block], tVsVtlo[None, kv_state.index], tma_bar_ptr=bar_v)
                kv_state.advance()

    # ------------------------------------------------------------------ consumers

    @cute.jit
    def consumer(
        self, tiled_mma_qk, tiled_mma_qk_hi, tiled_mma_pv, sQ_layout, sK_layout, sVt_layout,
        sQ, sK, sKlo, sVt, sVtlo, pipeline_q, pipeline_k, pipeline_v, mO, mLSE, tidx,
        m_block, head, batch, n_block_min, n_block_max, seqlen_q, seqlen_k, softmax_scale_log2,
    ):
        cfg = self.cfg
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_qk_hi = tiled_mma_qk_hi.get_slice(wg_idx * 128)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        sQ_tf32 = as_tf32(sQ, sQ_layout)
        sK_tf32, sKlo_tf32 = as_tf32(sK, sK_layout), as_tf32(sKlo, sK_layout)
        sVt_tf32, sVtlo_tf32 = as_tf32(sVt, sVt_layout), as_tf32(sVtlo, sVt_layout)

        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((cfg.tile_m, cfg.head_dim)))
        acc_O.fill(0.0)
        # the PV GEMM's own accumulator per key block (block_accumulator), else O itself
        acc_PV = thr_pv.make_fragment_C(thr_pv.partition_shape_C((cfg.tile_m, cfg.head_dim))) \
            if const_expr(cfg.block_accumulator) else acc_O
        # P as the PV GEMM's A operand: its hi and lo parts, in registers apart from the S accumulator.
        tOrP_hi = tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        tOrP_lo = tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        tSrQ_lo = tiled_mma_qk.make_fragment_A(thr_qk.partition_shape_A((cfg.tile_m, cfg.head_dim)))
        # B fragments (smem descriptors) by stage; Q_hi's A fragment (smem).
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK_tf32))
        tSrK_hi = tiled_mma_qk_hi.make_fragment_B(wg_qk_hi.partition_B(sK_tf32))
        tSrKlo_hi = tiled_mma_qk_hi.make_fragment_B(wg_qk_hi.partition_B(sKlo_tf32))
        tOrVt = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt_tf32))
        tOrVtlo = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVtlo_tf32))
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(reshape_acc_to_mn(acc_O), mode=[0]))
        softmax.reset()

        if n_block_max > n_block_min:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            wait_full(pipeline_q, q_state, True)
            # Q_lo from this thread's A elements of the Q tile.
            tSsQ = thr_qk.partition_A(sQ)
            tSrQ = cute.make_rmem_tensor_like(tSsQ, Float32)
            cute.autovec_copy(tSsQ, tSrQ)
            split_fragment(tSrQ, tSrQ_lo)
            tSrQ_hi = tiled_mma_qk_hi.make_fragment_A(wg_qk_hi.partition_A(sQ_tf32))
            c = dict(tSrQ_lo=tSrQ_lo, tSrQ_hi=tSrQ_hi, tSrK=tSrK, tSrK_hi=tSrK_hi, tSrKlo_hi=tSrKlo_hi,
                     tOrVt=tOrVt, tOrVtlo=tOrVtlo, acc_S=acc_S, acc_O=acc_O, acc_PV=acc_PV, tOrP_hi=tOrP_hi, tOrP_lo=tOrP_lo,
                     thr_qk=thr_qk, softmax=softmax, m_block=m_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     tiled_mma_qk=tiled_mma_qk, tiled_mma_qk_hi=tiled_mma_qk_hi, tiled_mma_pv=tiled_mma_pv,
                     pipeline_k=pipeline_k, pipeline_v=pipeline_v, wg_idx=wg_idx)
            if const_expr(cfg.pingpong):
                # The second warp group lets the first take the first turn.
                if wg_idx == 1:
                    cute.arch.barrier_arrive(barrier_id=TURN_BARRIER_BASE, number_of_threads=256)
            self.mainloop(c, block_ranges=BlockRanges(cfg.tile_m, cfg.tile_n, cfg.causal),
                          n_block_min=n_block_min, n_block_max=n_block_max)

        # Epilogue: rows that saw no key keep O = 0 and LSE = -inf (softmax.finalize).
        row_scale = softmax.finalize()
        softmax.rescale_O(acc_O, row_scale)
        tOcO_mn = reshape_acc_to_mn(thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
        self.output.store_lse(softmax.row_sum, tOcO_mn, mLSE, m_block, head, batch, seqlen_q)
        self.store_O(acc_O, tOcO_mn, mO, m_block, head, batch, seqlen_q)

    @cute.jit
    def mainloop(self, c: dict, block_ranges: BlockRanges, n_block_min: Int32, n_block_max: Int32):
        """Algorithm 1's inner loop over the key blocks [n_block_min, n_block_max), last first:
        the blocks crossing seqlen_k or the causal diagonal are masked, the rest not. With
        config.overlap, each block's S GEMM is issued together with the previous block's PV GEMM
        (as in fwd.py), else every block runs S, softmax, PV one after the other."""
        cfg = self.cfg
        n_block_right_mask = n_block_max
        if const_expr(cfg.causal):
            n_block_right_mask = block_ranges.n_block_min_causal_mask(c["m_block"], c["seqlen_q"], c["seqlen_k"], 0)
        n_block_unmasked = cutlass.min(n_block_right_mask, n_block_max - 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        block = self.one_block_overlapped if const_expr(cfg.overlap) else self.one_block
        # The first block: S and its softmax; without overlap its PV GEMM too.
        self.scores(c, kv_state, n_block_max - 1, masked=True, mask_seqlen=True, is_first=True)
        if const_expr(not cfg.overlap):
            self.gemm_pv(c, kv_state)
            kv_state.advance()
        if const_expr(cfg.causal):
            for i in cutlass.range(n_block_max - 1 - n_block_unmasked, unroll=1):
                kv_state = block(c, kv_state, n_block_max - 2 - i, masked=True)
        for i in cutlass.range(n_block_unmasked - n_block_min, unroll=1):
            kv_state = block(c, kv_state, n_block_unmasked - 1 - i, masked=False)
        if const_expr(cfg.overlap):
            self.gemm_pv(c, kv_state)  # the last block's

    @cute.jit
    def scores(self, c: dict, kv_state, n_block: Int32, masked: cutlass.Constexpr, mask_seqlen: cutlass.Constexpr,
               is_first: cutlass.Constexpr):
        """S of n_block, its mask and online softmax, O rescaled, P split into hi and lo."""
        cfg = self.cfg
        acc_S = c["acc_S"]
        wait_full(c["pipeline_k"], kv_state, True)
        self.gemm_s(c, kv_state.index)
        warpgroup.wait_group(0)
        c["pipeline_k"].consumer_release(kv_state)
        if const_expr(masked):
            self.mask(c, n_block, mask_seqlen)
        row_scale = c["softmax"].online_softmax(acc_S, is_first=is_first)
        if const_expr(not is_first):
            c["softmax"].rescale_O(c["acc_O"], row_scale)
        self.split_P(c)

    @cute.jit
    def one_block(self, c: dict, kv_state, n_block: Int32, masked: cutlass.Constexpr):
        """One block, in order: S, softmax, O += P V."""
        self.scores(c, kv_state, n_block, masked=masked, mask_seqlen=False, is_first=False)
        self.gemm_pv(c, kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def one_block_overlapped(self, c: dict, kv_state, n_block: Int32, masked: cutlass.Constexpr):
        """S GEMM of n_block issued with the PV GEMM of the block before it (kv_state's); the row
        maxima while the PV GEMM runs, the exponentials and P's split after it (P's registers are
        its A operand), O rescaled last."""
        acc_S, acc_O, softmax = c["acc_S"], c["acc_O"], c["softmax"]
        kv_state_v = kv_state.clone()
        kv_state.advance()
        wait_full(c["pipeline_k"], kv_state, True)
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=TURN_BARRIER_BASE + c["wg_idx"], number_of_threads=256)
        self.gemm_s(c, kv_state.index)
        wait_full(c["pipeline_v"], kv_state_v, True)
        self.issue_pv(c, kv_state_v.index)
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER_BASE + 1 - c["wg_idx"], number_of_threads=256)
        warpgroup.wait_group(1)  # S is ready; the PV GEMM may still run
        c["pipeline_k"].consumer_release(kv_state)
        if const_expr(masked):
            self.mask(c, n_block, False)
        max_scaled, row_scale = softmax.update_row_max(acc_S)
        warpgroup.wait_group(0)
        self.add_block_PV(c)
        # The exponentials made to wait for O (fwd.py: one_block says why).
        for r in cutlass.range_constexpr(cute.size(max_scaled)):
            max_scaled[r] = f32_after(max_scaled[r], acc_O[0])
        softmax.exponentiate(acc_S, max_scaled, row_scale)
        c["pipeline_v"].consumer_release(kv_state_v)
        self.split_P(c)
        softmax.rescale_O(acc_O, row_scale)
        return kv_state

    def gemm_s(self, c: dict, stage):
        """S = Q_lo K + Q_hi K_lo + Q_hi K (issued, not waited for)."""
        tSrK, tSrK_hi, tSrKlo_hi = (c[name][None, None, None, stage] for name in ("tSrK", "tSrK_hi", "tSrKlo_hi"))
        gemm_chains([(c["tiled_mma_qk"], c["tSrQ_lo"], tSrK), (c["tiled_mma_qk_hi"], c["tSrQ_hi"], tSrKlo_hi),
                     (c["tiled_mma_qk_hi"], c["tSrQ_hi"], tSrK_hi)], c["acc_S"], zero_init=True)

    def issue_pv(self, c: dict, stage):
        """O += P_lo V + P V_lo + P V (issued, not waited for; with block_accumulator into acc_PV,
        zeroed, which add_block_PV adds into O)."""
        tOrVt, tOrVtlo = c["tOrVt"][None, None, None, stage], c["tOrVtlo"][None, None, None, stage]
        mma_pv = c["tiled_mma_pv"]
        gemm_chains([(mma_pv, c["tOrP_lo"], tOrVt), (mma_pv, c["tOrP_hi"], tOrVtlo), (mma_pv, c["tOrP_hi"], tOrVt)],
                    c["acc_PV"], zero_init=self.cfg.block_accumulator)

    def add_block_PV(self, c: dict):
        """O += this block's P V, once its PV GEMM is done (block_accumulator)."""
        if const_expr(self.cfg.block_accumulator):
            c["acc_O"].store(c["acc_O"].load() + c["acc_PV"].load())

    @cute.jit
    def gemm_pv(self, c: dict, kv_state):
        """The PV GEMM of kv_state's block, waited for, its V stage released."""
        wait_full(c["pipeline_v"], kv_state, True)
        self.issue_pv(c, kv_state.index)
        warpgroup.wait_group(0)
        c["pipeline_v"].consumer_release(kv_state)
        self.add_block_PV(c)

    def split_P(self, c: dict):
        # P's hi and lo parts in A operand order, out of the accumulator's registers (tf32_hi says why).
        split_fragment(acc_as_frgA(c["acc_S"]), c["tOrP_lo"], c["tOrP_hi"])

    def mask(self, c: dict, n_block, mask_seqlen: bool):
        apply_mask(c["acc_S"], c["thr_qk"], self.cfg.tile_m, self.cfg.tile_n, c["m_block"], n_block, c["seqlen_q"],
                   c["seqlen_k"], mask_seqlen, self.cfg.causal)

    @cute.jit
    def store_O(self, acc_O, tOcO_mn, mO, m_block, head, batch, seqlen_q):
        """O from the accumulator to global memory: each thread's column pairs as 8-byte stores,
        rows past seqlen_q skipped."""
        acc_O_mn = reshape_acc_to_mn(acc_O)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            row = m_block * self.cfg.tile_m + tOcO_mn[r, 0][0]
            if row < seqlen_q:
                for j in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1]) // 2):
                    pair[0] = acc_O_mn[r, 2 * j]
                    pair[1] = acc_O_mn[r, 2 * j + 1]
                    gO = cute.local_tile(mO[row, None, head, batch], (2,), (tOcO_mn[r, 2 * j][1] // 2,))
                    cute.copy(store_atom, pair, gO)
