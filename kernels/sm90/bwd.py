"""FlashAttention backward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.

FlashAttention-2 Algorithm 2, mapped onto Hopper. A CTA owns one block of n_block_size keys of
one KV head (the outer loop of Algorithm 2) and keeps dK, dV for it in registers; it walks the
query blocks of every query head that reads this KV head (GQA sums in place, no workspace):

* Warp group 0 moves data (bwd_transfers.py). Warp 0 loads K and V once, then Q with its LSE
  (log2) and dO with its D = rowsum(dO * O) per query block, by TMA into `q_stages`-deep rings
  (`cutlass.pipeline.PipelineTmaAsync`). Warp 1 adds each query block's dQ from smem into the
  fp32 dQ sums in global memory with one bulk reduce (`cp.reduce.async.bulk`); with
  `deterministic` it first waits for the key blocks that add before it (a semaphore per query block).
* Warp groups 1 and 2 compute; each owns 64 of the keys. Per query block, in this order:
      S^T  = K Q^T               wgmma, both operands in smem (keys are the rows: "transposed")
      dP^T = V dO^T              wgmma (with 128-row query blocks accumulating onto -D)
      P^T  = exp2(S^T * scale * log2(e) - LSE)       causal mask on diagonal blocks (64 rows)
      dS^T = P^T * (dP^T - D)
      dV  += P^T dO              wgmma, P^T straight from registers
      dQ   = dS K                wgmma, dS from smem (both groups' keys), handed to warp 1
      dK  += dS^T Q              wgmma, dS^T straight from registers, while dQ is handed over
  Computing S and dP transposed makes P^T and dS^T land in the register layout of the dV and dK
  GEMMs' A operand, so neither goes through shared memory for them.
* Head dims 192, 256 and classes that spill with 128 keys (config.split_head_dim): a CTA owns 64 keys; the groups split S^T's and dP^T's query columns and dV's and dK's head-dim
  columns, so P^T and dS^T reach the dV and dK GEMMs through smem, after one barrier. With one Q / dO buffer (hd 256) dV, dK and dQ run in
  that order and each buffer is released once its last GEMM is done.
* Epilogue: dK (times the softmax scale) and dV are converted, staged in K's and V's smem and
  stored by TMA, which clips rows past seqlen_k.

Score modifications (`call_with_mods`, as in the forward): a sliding window walks only the query
blocks the keys see and masks its edge blocks; ALiBi adds -slope * |i - j| to S^T; with softcap
scores are t = tanh(s * scale / softcap), P's exponent runs at scale softcap, and dS^T picks
up dt/ds's factor 1 - t^2 (the softmax scale is applied to dK and dQ as without softcap).
With dropout (config.dropout) the forward's Philox keep mask is drawn again on S^T while the dP
GEMM runs (philox.apply_dropout_transposed), dS^T = P^T * (Z dP^T / (1 - p) - D) and dV takes the
kept P^T, its 1 / (1 - p) applied at the end.

Packed variable-length batches (`call_varlen`, config.varlen): each CTA reads its sequence's
bounds from cu_seqlens, views the packed tensors from the sequence's first rows, zeroes K's rows
past the sequence (`zero_keys_past_end`) and stores dK, dV clipped at its last key
(docs/kernels/sm90-backward.md).

Rows past seqlen_q need no mask: TMA fills their Q and dO with zeros and the preprocess gives
them LSE = +inf and D = 0, so their P and dS are 0. Keys past seqlen_k are zero rows of K and V:
they add nothing to dQ, and their dK, dV rows are never stored. The postprocess
(kernels/sm90/bwd_post.py) scales dQ's sums and converts them to the input dtype.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils.layout import LayoutEnum

from ..common.blocks import BlockRanges
from ..common.entry_points import BackwardEntryPoints
from ..common.layouts import (
    LONGEST_FIRST_MAX_SEQUENCES, gmem_tiled_copy, key_length_rank, packed_stat_offset, reshape_acc_to_mn, rows_from,
    sequence_bounds, transpose_view,
)
from ..common.mask import alibi_head_slope, apply_alibi, apply_mask, apply_softcap, kernel_mod_args
from ..common.packed16 import convert_f32_to_16bit
from ..common.philox import DropoutRng, apply_dropout_transposed, dropout_dS
from ..common.softmax import LOG2_E
from ..common.stores import stage_acc_in_smem, store_smem_tile
from .config import Sm90BwdConfig, backward_smem_bytes, dq_atom_layout
from .bwd_transfers import (
    DQ_EMPTY_BARRIER, DQ_FULL_BARRIER, DS_READY_BARRIER, EPILOGUE_BARRIER, SCORES_FREE_BARRIER, BackwardTransfers,
)
from .primitives import gemm, opaque_f32



def dq_tiled_mma(config) -> cute.TiledMma:
    """dQ = dS K: A = dS (m, n) with m contiguous, B = K viewed as (d, n) with d contiguous. The
    postprocess rebuilds it to read dQ's sums back in accumulator order."""
    atoms = dq_atom_layout(config.m_block_size)
    return sm90_utils.make_trivial_tiled_mma(
        config.dtype, config.dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
        atom_layout_mnk=atoms, tiler_mn=(64, config.head_dim // atoms[1]),
    )


def dq_swizzle_columns(config) -> int:
    """The dQ GEMM gives each warp group a slice of dQ's (and K's) columns, read in the widest
    swizzle atom that divides it (d = 96: 48 columns, 16-column atoms; d = 192: 96, 32). At d = 64
    with 64-row query blocks the two 32-column slices share one 64-column atom instead (each
    group's descriptor starts inside it), as timed since 2026-11-27."""
    d = config.head_dim
    return d if d == 64 else d // dq_atom_layout(config.m_block_size)[1]


def rows_by_d_smem_layout(config, rows: int, slice_columns: int, stages: int) -> cute.ComposedLayout:
    """A (rows, d) buffer with d contiguous, in the widest swizzle atom that divides the column
    slices the MMA warp groups read of it (the whole of d where they do not split it)."""
    atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, config.dtype, slice_columns)
    atom = sm90_utils.make_smem_layout_atom(atom_kind, config.dtype)
    return cute.tile_to_shape(atom, (rows, config.head_dim, stages), order=(0, 1, 2))


def k_smem_layout(config) -> cute.ComposedLayout:
    """K's (and V's, dK's, dV's) (n, d) buffer, swizzled for the dQ GEMM's column slices."""
    return rows_by_d_smem_layout(config, config.n_block_size, dq_swizzle_columns(config), 1)


def q_smem_layout(config) -> cute.ComposedLayout:
    """Q's and dO's (m, d) rings: with split_head_dim the dK and dV GEMMs read them in column
    halves (d = 192: 96 columns, 32-column atoms)."""
    return rows_by_d_smem_layout(config, config.m_block_size, config.dkv_columns, config.q_stages)


def dq_staging_view(sdQ: cute.Tensor, num_threads: int, thread: Int32) -> cute.Tensor:
    """Thread `thread`'s accumulator elements in a flat fp32 dQ tile, 4 at a time: element e at
    (e // 4) * 4 * num_threads + 4 * thread + e % 4. Both the smem staging buffer and the global
    sums use this order, so every transfer is a conflict-free or coalesced 16-byte vector."""
    vectors = cute.size(sdQ) // (4 * num_threads)
    threads = cute.make_tensor(
        sdQ.iterator, cute.make_layout(((4, num_threads), vectors), stride=((1, 4), 4 * num_threads))
    )
    return threads[(None, thread), None]


def ds_store_copy(tiled_mma_SdP: cute.TiledMma, dtype) -> cute.TiledCopy:
    """dS^T's 16-bit fragment (in the S^T / dP^T accumulator's register order) into dS's m-major
    smem by stmatrix: four 8x8 matrices (8 keys by 8 queries) per instruction, 8 instructions per
    thread instead of 32 4-byte stores. Each instruction's four source registers are one k-block
    of the dK GEMM's A fragment, so both instructions read the same register quads."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    return cute.make_tiled_copy_C(atom, tiled_mma_SdP)


def swizzle_free(sX: cute.Tensor) -> cute.Tensor:
    """`sX`, whose pointer carries the swizzle, as a plain pointer with the swizzle in its layout
    (in element units). A thread's partition of it is one address plus offsets that the layout
    knows: compile-time, or per-thread strides where the XOR takes bits of the thread's own
    address. Through the swizzled pointer, a thread's addresses are computed before the loop, one
    register per distinct swizzled offset, and held through it.

    dS's stmatrix store (ds_store_copy): a lane's row address holds its key's low 3 bits, which the
    128-byte swizzle XORs into the 16-byte chunk index, where the 16- and 32-query steps between
    instructions land. That leaves one base address (per stage) and two per-thread strides, the
    64-query step an immediate offset."""
    swz = sX.iterator.type.swizzle_type
    width = sX.element_type.width
    in_bytes = cute.recast_layout(8, width, sX.layout)
    swizzle = cute.make_swizzle(swz.num_bits, swz.num_base, swz.num_shift)
    layout = cute.recast_layout(width, 8, cute.make_composed_layout(swizzle, 0, in_bytes))
    return cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=sX.element_type), layout)


def shared_storage(cfg, sQ_layout, sK_layout, sdS_layout, stat_layout):
    """The kernel's smem: barriers, row statistics, then the tiles (P's only with split_head_dim).
    Fields listed as values: this module's annotations are strings, which cute.struct cannot read
    outside a jit function."""
    def tile(dtype, layout_or_size, align=1024):
        size = layout_or_size if isinstance(layout_or_size, int) else cute.cosize(layout_or_size)
        return cute.struct.Align[cute.struct.MemRange[dtype, size], align]

    fields = dict(
        mbar_KV=cute.struct.MemRange[cutlass.Int64, 2],
        mbar_Q=cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stages],
        mbar_dO=cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stages],
        sLSE=tile(Float32, stat_layout, 128),
        sdPsum=tile(Float32, stat_layout, 128),
        sQ=tile(cfg.dtype, sQ_layout),
        sdO=tile(cfg.dtype, sQ_layout),
        sK=tile(cfg.dtype, sK_layout),
        sV=tile(cfg.dtype, sK_layout),
        sdS=tile(cfg.dtype, sdS_layout),
    )
    if cfg.split_head_dim:
        fields["sP"] = tile(cfg.dtype, sdS_layout)
    fields["sdQ"] = tile(Float32, cfg.m_block_size * cfg.head_dim)
    if cfg.varlen:
        fields["seq_of_rank"] = cute.struct.MemRange[Int32, 1]  # this CTA's sequence (kernel)
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


class FlashAttnBwdSm90(BackwardEntryPoints, BackwardTransfers):
    """Hopper backward for one configuration (config.py: Sm90BwdConfig); see the module docstring."""

    @property
    def ds_by_stmatrix(self) -> bool:
        """dS^T to smem by stmatrix (ds_store_copy, swizzle_free) before the dV GEMM, as FA3 / FA4
        order it, where -D is filled before the S GEMM (shared_stats): the 4-byte stores after the
        dV GEMM kept eight base addresses (one per 16-byte chunk of the swizzle) through the loop
        there, and ptxas spilled them (56 bytes per thread, 72 causal). The 64-row shapes keep the
        4-byte stores after the dV GEMM: stmatrix before it measured 0-4% slower at hd 128
        (2026-11-29, H200; perf/results/h200-20261129-run5.md)."""
        return self.cfg.shared_stats

    def __init__(self, config: Sm90BwdConfig):
        self.cfg = config
        # Block ranges (compile-time sizes) of the query walk and the dQ turns.
        self.ranges = BlockRanges(config.m_block_size, config.n_block_size, config.causal)

    def smem_bytes(self, **_) -> int:
        return backward_smem_bytes(self.cfg)

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
        """A packed variable-length batch (config.varlen), in the sm80 backward's `call_varlen`
        order: q, k, v, dO, dK, dV packed (1, total, heads, d); the statistics and dQ's sums per
        sequence at kernels/common/layouts.py: packed_stat_offset (rows padded to STAT_ROW_PAD,
        the preprocess's `call_varlen` layout); mdQsemaphore (batch, heads, m_blocks of the
        longest sequence); max_seqlen_k sizes the grid. Modifications as call_with_mods."""
        self.launch(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale,
                    window_left, window_right, softcap, mAlibiSlopes, stream,
                    varlen_args=(mCuSeqlensQ, mCuSeqlensK, max_seqlen_k))

    @cute.jit
    def launch(self, mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale: Float32,
               window_left, window_right, softcap, mAlibiSlopes, stream: cuda.CUstream, varlen_args=(None,) * 3,
               dropout_args=(None,) * 4):
        cfg = self.cfg
        m, n, d = cfg.m_block_size, cfg.n_block_size, cfg.head_dim
        # (batch, seqlen, heads, d) -> (seqlen, d, heads, batch); row statistics -> (rows, heads, batch).
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mdO, mdK, mdV)
        ]
        mLSElog2, mdPsum = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSElog2, mdPsum)
        ]

        # Keys are the M dimension of S^T, dP^T, dV and dK: one warp group per 64 keys, or with
        # split_head_dim one 64-key block whose query columns (S^T, dP^T) and head-dim columns
        # (dV, dK) the groups split; then P^T and dS^T come from smem.
        split = cfg.split_head_dim
        keys_by_group = (1, cfg.num_wg_mma, 1) if split else (cfg.num_wg_mma, 1, 1)
        tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(
            cfg.dtype, cfg.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=keys_by_group, tiler_mn=(64, m // keys_by_group[1]),
        )
        tiled_mma_dKV = sm90_utils.make_trivial_tiled_mma(
            cfg.dtype, cfg.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=keys_by_group, tiler_mn=(64, cfg.dkv_columns),
            a_source=warpgroup.OperandSource.SMEM if split else warpgroup.OperandSource.RMEM,
        )
        tiled_mma_dQ = dq_tiled_mma(cfg)

        # One swizzled buffer per operand, read in both orientations: Q and dO (m, d) are the
        # K-major B of S^T / dP^T and, transposed, the MN-major B of dK / dV; K (n, d) is the
        # K-major A of S^T and, transposed, the MN-major B of dQ; dS (m, n) is stored m-major
        # (transposed, the K-major A of dK with split_head_dim; P likewise for dV).
        sQ_layout = q_smem_layout(cfg)
        sK_layout = k_smem_layout(cfg)
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (m, d, n), cfg.dtype, cfg.q_stages)
        sQ_tile = cute.slice_(sQ_layout, (None, None, 0))
        sK_tile = cute.slice_(sK_layout, (None, None, 0))
        stat_layout = cute.make_layout((m, cfg.q_stages))

        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_tile, (m, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mdO, sQ_tile, (m, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK, sK_tile, (n, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mV, sK_tile, (n, d))
        stat_tile = cute.make_layout(m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mLSElog2, stat_tile, (m,))
        tma_atom_dPsum, tma_dPsum = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mdPsum, stat_tile, (m,))
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdK, sK_tile, (n, d))
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdV, sK_tile, (n, d))
        self.tx_bytes_q = (m * d * cfg.dtype.width + m * Float32.width) // 8
        self.tx_bytes_kv = 2 * n * d * cfg.dtype.width // 8

        SharedStorage = shared_storage(cfg, sQ_layout, sK_layout, sdS_layout, stat_layout)

        grid = (cute.ceil_div(mK.shape[0], n), mK.shape[2], mK.shape[3])
        varlen_kwargs = {}
        if const_expr(cfg.varlen):
            # One CTA row per key block of the longest sequence; dK, dV leave by plain stores
            # (a TMA box would cross into the next sequence's rows).
            mCuSeqlensQ, mCuSeqlensK, max_seqlen_k = varlen_args
            grid = (cute.ceil_div(max_seqlen_k, n), mK.shape[2], mCuSeqlensQ.shape[0] - 1)
            varlen_kwargs = dict(mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mdK_rows=mdK, mdV_rows=mdV)
        # P's exponent runs at scale softcap with softcap (the forward's parametrization)
        score_scale, mods = kernel_mod_args(cfg.window, cfg.softcap, cfg.alibi, softmax_scale, window_left,
                                            window_right, softcap, mAlibiSlopes, cfg.dropout, dropout_args)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_LSE, tma_LSE, tma_atom_dPsum, tma_dPsum, tma_atom_dK, tma_dK, tma_atom_dV, tma_dV,
            mdQaccum, mdQsemaphore, softmax_scale, score_scale * Float32(LOG2_E),
            tiled_mma_SdP, tiled_mma_dKV, tiled_mma_dQ, sQ_layout, sK_layout, sdS_layout, stat_layout, SharedStorage,
            **mods, **varlen_kwargs,
        ).launch(grid=grid, block=[cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 use_pdl=True)  # programmatic dependent launch: see griddepcontrol_wait in kernel

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_dO: cute.CopyAtom, mdO: cute.Tensor,
        tma_atom_K: cute.CopyAtom, mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
        tma_atom_LSE: cute.CopyAtom, mLSE: cute.Tensor, tma_atom_dPsum: cute.CopyAtom, mdPsum: cute.Tensor,
        tma_atom_dK: cute.CopyAtom, mdK: cute.Tensor, tma_atom_dV: cute.CopyAtom, mdV: cute.Tensor,
        mdQaccum: cute.Tensor, mdQsemaphore: cute.Tensor, softmax_scale: Float32, softmax_scale_log2: Float32,
        tiled_mma_SdP: cute.TiledMma, tiled_mma_dKV: cute.TiledMma, tiled_mma_dQ: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        stat_layout: cute.Layout, SharedStorage: cutlass.Constexpr,
        window_left: Int32 | None = None, window_right: Int32 | None = None, softcap_pre: Float32 | None = None,
        mAlibiSlopes: cute.Tensor | None = None, alibi_scale: Float32 | None = None,
        mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None,
        mdK_rows: cute.Tensor | None = None, mdV_rows: cute.Tensor | None = None,
        philox_seed: Int64 | None = None, philox_offset: Int64 | None = None, dropout_threshold: Int32 | None = None,
        dropout_scale: Float32 | None = None,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        if const_expr(cfg.shortest_walk_first):
            n_block = cute.arch.grid_dim()[0] - 1 - n_block
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE, tma_atom_dPsum,
                         tma_atom_dK, tma_atom_dV):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.num_mma_threads // 32)
        pipeline_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_KV.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=mma_warps, tx_count=self.tx_bytes_kv, defer_sync=True,
        )
        pipeline_q, pipeline_do = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=cfg.q_stages, producer_group=tma_warp,
                consumer_group=mma_warps, tx_count=self.tx_bytes_q, defer_sync=True,
            )
            for mbar in (storage.mbar_Q, storage.mbar_dO)
        ]
        sSeq = None
        if const_expr(cfg.varlen):
            sSeq = storage.seq_of_rank.get_tensor(cute.make_layout(1))
            self.rank_sequence(sSeq, mCuSeqlensK, batch, tidx)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        # Dependent launch: this grid may start before the preprocess ahead of it in the stream has
        # flushed LSE·log2(e), D and the zeroed dQ sums. Nothing above reads what it writes (a packed
        # batch's ranking reads only cu_seqlens_k).
        cute.arch.griddepcontrol_wait()

        s = SimpleNamespace(
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sdS=storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
            sP=storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner) if const_expr(cfg.split_head_dim)
            else None,
            sLSE=storage.sLSE.get_tensor(stat_layout),
            sdPsum=storage.sdPsum.get_tensor(stat_layout),
            sdQ=storage.sdQ.get_tensor(cute.make_layout(cfg.m_block_size * cfg.head_dim)),
        )
        window = (window_left, window_right) if const_expr(cfg.window) else None
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        # The batch index into the tensors (0 in packed ones, whose views start at the sequence).
        tensor_batch = batch
        dkv_rows = None
        if const_expr(cfg.varlen):
            batch = sSeq[0]
            offset_q, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            offset_k, seqlen_k = sequence_bounds(mCuSeqlensK, batch)
            stat_offset = packed_stat_offset(offset_q, batch)
            mQ, mdO = rows_from(mQ, offset_q, 0), rows_from(mdO, offset_q, 0)
            mK, mV = rows_from(mK, offset_k, 0), rows_from(mV, offset_k, 0)
            mLSE, mdPsum = rows_from(mLSE, stat_offset, 0), rows_from(mdPsum, stat_offset, 0)
            mdQaccum = rows_from(mdQaccum, stat_offset * cfg.head_dim, 2)
            # Kernel parameters until the epilogue, where the sequence's rows are found again: views
            # made here would hold their offsets and strides in registers through the main loop.
            dkv_rows = SimpleNamespace(mdK=mdK_rows, mdV=mdV_rows, mCuSeqlensK=mCuSeqlensK, sSeq=sSeq)
            tensor_batch = 0
        walk = self.query_walk(n_block, head_kv, seqlen_q, seqlen_k, mQ.shape[2], mK.shape[2], window)

        # Packed: the grid covers the longest sequence's key blocks; a CTA past its own does nothing.
        runs = True
        if const_expr(cfg.varlen):
            runs = n_block * cfg.n_block_size < seqlen_k
        if runs:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(cfg.register_split[0])
                if warp_idx == 0:
                    self.producer(tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                                  tma_atom_LSE, mLSE, tma_atom_dPsum, mdPsum, s, pipeline_kv, pipeline_q, pipeline_do,
                                  walk, n_block, head_kv, tensor_batch)
                if warp_idx == 1:
                    self.dq_writer(mdQaccum, mdQsemaphore, s.sdQ, walk, n_block, batch, tensor_batch, seqlen_q,
                                   seqlen_k, window)
            else:
                cute.arch.setmaxregister_increase(cfg.register_split[1])
                self.consumer(tiled_mma_SdP, tiled_mma_dKV, tiled_mma_dQ, s, pipeline_kv, pipeline_q, pipeline_do,
                              tma_atom_dK, mdK, tma_atom_dV, mdV, walk, n_block, head_kv,
                              sSeq if const_expr(cfg.varlen) else batch, tensor_batch, seqlen_q, seqlen_k, softmax_scale, softmax_scale_log2, tidx - 128, window,
                              softcap_pre, mAlibiSlopes, alibi_scale, dkv_rows,
                              SimpleNamespace(seed=philox_seed, offset=philox_offset, threshold=dropout_threshold,
                                              scale=dropout_scale, num_heads=mQ.shape[2]))

    @cute.jit
    def query_walk(self, n_block: Int32, head_kv: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32,
                   num_heads_kv: Int32, window) -> SimpleNamespace:
        """The query blocks this CTA visits: for each query head of its KV head, the blocks
        [m_block_min, m_block_max) that see one of its keys. Step i is (head, m_block) = step(i).
        Blocks below mask_end (the causal diagonal's, or those crossing a window's right edge) and
        from mask_start (crossing its left edge) need a mask."""
        ranges = self.ranges
        if const_expr(window is not None):
            m_block_min, m_block_max = ranges.m_block_min_max_window(n_block, seqlen_q, seqlen_k, *window)
            mask_end, mask_start = ranges.m_block_window_masks(n_block, seqlen_q, seqlen_k, *window)
        else:
            m_block_min, m_block_max = ranges.m_block_min_max(n_block, seqlen_q, seqlen_k)
            mask_end, mask_start = m_block_min, m_block_max
            if const_expr(self.cfg.causal):
                mask_end = ranges.m_block_max_causal_mask(n_block, seqlen_q, seqlen_k, m_block_min)
        blocks = cutlass.max(m_block_max - m_block_min, 0)
        group = num_heads // num_heads_kv
        return SimpleNamespace(m_block_min=m_block_min, blocks=blocks, steps=group * blocks,
                               first_head=head_kv * group, mask_end=mask_end, mask_start=mask_start)

    @cute.jit
    def step(self, walk: SimpleNamespace, i: Int32):
        head_in_group = i // walk.blocks
        return walk.first_head + head_in_group, walk.m_block_min + i - head_in_group * walk.blocks

    @cute.jit
    def rank_sequence(self, sSeq: cute.Tensor, mCuSeqlensK: cute.Tensor, rank: Int32, tidx: Int32):
        """Packed: longest sequences first. blockIdx.z is taken as a rank by key length
        (layouts.key_length_rank); the hardware hands out CTAs in block-index order, so the longest
        K/V walks start first and short ones fill the end. The thread that finds the sequence of
        this rank writes it to sSeq[0], before the CTA's barrier that follows; beyond
        LONGEST_FIRST_MAX_SEQUENCES sequences the rank is the sequence."""
        num_batch = mCuSeqlensK.shape[0] - 1
        if num_batch <= LONGEST_FIRST_MAX_SEQUENCES:
            for b in cutlass.range(tidx, num_batch, self.cfg.num_threads, unroll=1):
                if key_length_rank(mCuSeqlensK, b, num_batch) == rank:
                    sSeq[0] = b
        elif tidx == 0:
            sSeq[0] = rank

    def sequence_index(self, batch):
        """The batch index of the CTA's sequence where the consumers use it: blockIdx.z for a dense
        batch; a packed one's is read again from shared memory at each use (held in a register
        through the main loop, it spilled)."""
        return batch[0] if const_expr(self.cfg.varlen) else batch

    # -------------------------------------------------------------------------------------- consumers

    @cute.jit
    def consumer(self, tiled_mma_SdP, tiled_mma_dKV, tiled_mma_dQ, s, pipeline_kv, pipeline_q, pipeline_do,
                 tma_atom_dK, mdK, tma_atom_dV, mdV, walk, n_block, head_kv, batch, tensor_batch, seqlen_q, seqlen_k,
                 softmax_scale, softmax_scale_log2, tidx, window, softcap_pre, mAlibiSlopes, alibi_scale, dkv_rows,
                 dropout):
        cfg = self.cfg
        m, n, d = cfg.m_block_size, cfg.n_block_size, cfg.head_dim
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_SdP, thr_SdP = tiled_mma_SdP.get_slice(wg * 128), tiled_mma_SdP.get_slice(tidx)
        wg_dKV, thr_dKV = tiled_mma_dKV.get_slice(wg * 128), tiled_mma_dKV.get_slice(tidx)
        wg_dQ, thr_dQ = tiled_mma_dQ.get_slice(wg * 128), tiled_mma_dQ.get_slice(tidx)
        ds_copy = thr_ds = tdSsdS = None
        if const_expr(self.ds_by_stmatrix):
            ds_copy = ds_store_copy(tiled_mma_SdP, cfg.dtype)
            thr_ds = ds_copy.get_slice(tidx)
            tdSsdS = thr_ds.partition_D(swizzle_free(transpose_view(s.sdS)))
        c = SimpleNamespace(
            tiled_mma_SdP=tiled_mma_SdP, tiled_mma_dKV=tiled_mma_dKV, tiled_mma_dQ=tiled_mma_dQ,
            # S^T = K Q^T and dP^T = V dO^T
            tSrK=tiled_mma_SdP.make_fragment_A(wg_SdP.partition_A(s.sK)),
            tSrQ=tiled_mma_SdP.make_fragment_B(wg_SdP.partition_B(s.sQ)),
            tdPrV=tiled_mma_SdP.make_fragment_A(wg_SdP.partition_A(s.sV)),
            tdPrdO=tiled_mma_SdP.make_fragment_B(wg_SdP.partition_B(s.sdO)),
            acc_S=thr_SdP.make_fragment_C(thr_SdP.partition_shape_C((n, m))),
            acc_dP=thr_SdP.make_fragment_C(thr_SdP.partition_shape_C((n, m))),
            # (key, query) coordinates of this thread's S^T elements, and where they go in dS.
            tScS=reshape_acc_to_mn(thr_SdP.partition_C(cute.make_identity_tensor((n, m)))),
            t0ScS=reshape_acc_to_mn(tiled_mma_SdP.get_slice(0).partition_C(cute.make_identity_tensor((n, m)))),
            thr_SdP=thr_SdP, sdSt=transpose_view(s.sdS),
            # dS^T's stmatrix store (ds_by_stmatrix): this lane's rows of dS in every stage
            ds_copy=ds_copy, thr_ds=thr_ds, tdSsdS=tdSsdS,
            sPt=transpose_view(s.sP) if const_expr(cfg.split_head_dim) else None,
            # dV += P^T dO and dK += dS^T Q, A from registers (from smem with split_head_dim)
            tdVrP=tiled_mma_dKV.make_fragment_A(wg_dKV.partition_A(transpose_view(s.sP)))
            if const_expr(cfg.split_head_dim) else tiled_mma_dKV.make_fragment_A(thr_dKV.partition_shape_A((n, m))),
            tdKrdS=tiled_mma_dKV.make_fragment_A(wg_dKV.partition_A(transpose_view(s.sdS)))
            if const_expr(cfg.split_head_dim) else tiled_mma_dKV.make_fragment_A(thr_dKV.partition_shape_A((n, m))),
            tdVrdO=tiled_mma_dKV.make_fragment_B(wg_dKV.partition_B(transpose_view(s.sdO))),
            tdKrQ=tiled_mma_dKV.make_fragment_B(wg_dKV.partition_B(transpose_view(s.sQ))),
            acc_dV=thr_dKV.make_fragment_C(thr_dKV.partition_shape_C((n, d))),
            acc_dK=thr_dKV.make_fragment_C(thr_dKV.partition_shape_C((n, d))),
            # dQ = dS K
            tdQrdS=tiled_mma_dQ.make_fragment_A(wg_dQ.partition_A(s.sdS)),
            tdQrK=tiled_mma_dQ.make_fragment_B(wg_dQ.partition_B(transpose_view(s.sK))),
            acc_dQ=thr_dQ.make_fragment_C(thr_dQ.partition_shape_C((m, d))),
            tdQsdQ=dq_staging_view(s.sdQ, cfg.num_mma_threads, tidx),
            pipeline_q=pipeline_q, pipeline_do=pipeline_do, sLSE=s.sLSE, sdPsum=s.sdPsum,
            n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, scale_log2=softmax_scale_log2, window=window,
            softcap_pre=softcap_pre,
            # ALiBi's slope of this step's query head (GQA: the heads of a walk differ)
            mAlibiSlopes=mAlibiSlopes, alibi_scale=alibi_scale, batch=batch,
            dropout=dropout,  # Philox seed, offset, keep threshold, 1 / (1 - p), heads (each head its stream)
        )
        c.acc_dV.fill(0.0)
        c.acc_dK.fill(0.0)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_kv.consumer_wait(kv_state)
        if const_expr(cfg.varlen):
            self.zero_keys_past_end(s.sK[None, None, 0], seqlen_k - n_block * n, tidx)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.q_stages)
        if const_expr(cfg.varlen):
            # Packed: head by head, without step's division. Its temporaries on top of the walk's
            # loaded bounds (a dense batch's derive from kernel parameters) spilled 32 bytes per
            # thread at hd 128 causal.
            for h in cutlass.range(walk.steps // cutlass.max(walk.blocks, 1), unroll=1):
                for j in cutlass.range(walk.blocks, unroll=1):
                    self.visit(c, q_state, walk, walk.first_head + h, walk.m_block_min + j)
                    q_state.advance()
        else:
            for i in cutlass.range(walk.steps, unroll=1):
                head, m_block = self.step(walk, i)
                self.visit(c, q_state, walk, head, m_block)
                q_state.advance()

        self.store_dKV(c, s, tma_atom_dK, mdK, tma_atom_dV, mdV, n_block, head_kv, tensor_batch, softmax_scale, tidx,
                       dkv_rows)

    @cute.jit
    def visit(self, c: SimpleNamespace, q_state, walk: SimpleNamespace, head: Int32, m_block: Int32):
        """One step of the query walk: one_block, masked where the walk says the block needs it."""
        needs_mask = m_block < walk.mask_end
        if const_expr(self.cfg.window):
            needs_mask = needs_mask | (m_block >= walk.mask_start)
        self.one_block(c, q_state, head, m_block, needs_mask)

    @cute.jit
    def zero_keys_past_end(self, sK_tile: cute.Tensor, keys_left: Int32, tidx: Int32):
        """Packed batches: K's rows past the sequence's last key hold the next sequence's keys
        (a dense batch's TMA reads zeros there). Zeroed, they add nothing to dQ = dS K, as in the
        dense case; their dK and dV rows are never stored."""
        n, d = self.cfg.n_block_size, self.cfg.head_dim
        if keys_left < n:
            for i in cutlass.range(n * d // self.cfg.num_mma_threads, unroll=1):
                idx = tidx + i * self.cfg.num_mma_threads
                row = idx // d
                if row >= keys_left:
                    sK_tile[row, idx - row * d] = sK_tile.element_type(0)
            # The wgmma reads of K (the async proxy) must see these writes, in both warp groups.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_mma_threads)

    @cute.jit
    def one_block(self, c: SimpleNamespace, q_state, head: Int32, m_block: Int32, needs_mask):
        """Algorithm 2's inner loop body for one query block (see the module docstring)."""
        cfg = self.cfg
        stage = q_state.index
        c.pipeline_q.consumer_wait(q_state)
        acc_dP_mn = reshape_acc_to_mn(c.acc_dP)
        if const_expr(cfg.shared_stats):
            # dP^T - D in one go: the dP GEMM accumulates onto -D, so no D is held while dS is
            # formed. -D is written before the S GEMM is issued: written while S is in flight,
            # ptxas waits for S before issuing dP (advisory C7517); the asm moves keep LLVM from
            # sinking the writes back next to the dP GEMM.
            c.pipeline_do.consumer_wait(q_state)
            for j in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                minus_dpsum = -c.sdPsum[c.tScS[0, j][1], stage]
                for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                    acc_dP_mn[r, j] = minus_dpsum
            for i in cutlass.range_constexpr(cute.size(c.acc_dP)):
                c.acc_dP[i] = opaque_f32(c.acc_dP[i])
        gemm(c.tiled_mma_SdP, c.acc_S, c.tSrK[None, None, None, 0], c.tSrQ[None, None, None, stage], zero_init=True)
        lse_shares = self.stat_shares(c, c.sLSE, stage)
        if const_expr(not cfg.shared_stats):
            c.pipeline_do.consumer_wait(q_state)
        gemm(c.tiled_mma_SdP, c.acc_dP, c.tdPrV[None, None, None, 0], c.tdPrdO[None, None, None, stage],
             zero_init=not cfg.shared_stats)

        warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
        acc_S_mn = reshape_acc_to_mn(c.acc_S)
        if const_expr(cfg.softcap):
            # scores t = tanh(s * scale / softcap); dS's factor 1 - t^2 is taken before masks and
            # bias change t, and held in fp16 (half the registers; relative error 2^-11 on [0, 1]).
            apply_softcap(c.acc_S, c.softcap_pre)
            dtanh = cute.make_rmem_tensor_like(c.acc_S, cutlass.Float16)
            dtanh.store((1.0 - c.acc_S.load() * c.acc_S.load()).to(cutlass.Float16))
        if const_expr(cfg.alibi):
            slope = alibi_head_slope(c.mAlibiSlopes, c.alibi_scale, self.sequence_index(c.batch), head)
            apply_alibi(c.acc_S, c.thr_SdP, cfg.m_block_size, cfg.n_block_size, m_block, c.n_block, c.seqlen_q,
                        c.seqlen_k, slope, transposed=True)
        if const_expr(cfg.causal and cfg.m_block_size == 128):
            # 128-row blocks: the mask's compares on every block cost less than the registers a
            # branch around it keeps live (20 bytes per thread spilled with the branch).
            self.mask_causal(c, acc_S_mn, m_block)
        elif const_expr(cfg.causal):
            if needs_mask:
                self.mask_causal(c, acc_S_mn, m_block)
        if const_expr(cfg.window):
            if needs_mask:
                apply_mask(c.acc_S, c.thr_SdP, cfg.m_block_size, cfg.n_block_size, m_block, c.n_block, c.seqlen_q,
                           c.seqlen_k, mask_seqlen=False, mask_causal=False, transposed=True, branchless=False,
                           window=c.window)
        # Columns are queries: each column's LSE is read from smem (or its sharing lane) where used.
        for j in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            lse = self.column_stat(c, c.sLSE, lse_shares, stage, j)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, j] = cute.math.exp2(acc_S_mn[r, j] * c.scale_log2 - lse, fastmath=True)
        if const_expr(cfg.dropout):
            # the forward's keep mask, drawn again while dP^T runs; dropped entries as -P
            rng = DropoutRng.create(c.dropout.seed, c.dropout.offset, c.dropout.threshold,
                                    c.batch * c.dropout.num_heads + head)
            apply_dropout_transposed(c.acc_S, c.thr_SdP, cfg.n_block_size, cfg.m_block_size, c.n_block, m_block, rng)

        warpgroup.wait_group(0)  # dP^T is ready
        for j in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
            # with shared_stats dP^T already holds -D
            dpsum = Float32(0.0) if const_expr(cfg.shared_stats) else c.sdPsum[c.tScS[0, j][1], stage]
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                if const_expr(cfg.dropout):
                    acc_dP_mn[r, j] = dropout_dS(acc_S_mn[r, j], acc_dP_mn[r, j], dpsum, c.dropout.scale)
                else:
                    acc_dP_mn[r, j] = acc_S_mn[r, j] * (acc_dP_mn[r, j] - dpsum)
        if const_expr(cfg.dropout):
            # dV's P is the kept P (rescaled by 1 / (1 - p) with dV at the end)
            for i in cutlass.range_constexpr(cute.size(c.acc_S)):
                c.acc_S[i] = cutlass.max(c.acc_S[i], Float32(0.0))
        if const_expr(cfg.softcap):
            c.acc_dP.store(c.acc_dP.load() * dtanh.load().to(Float32))
        if const_expr(cfg.split_head_dim):
            self.scores_to_smem(c, stage)
            tdVrP, tdKrdS = c.tdVrP[None, None, None, stage], c.tdKrdS[None, None, None, stage]
        else:
            tdVrP, tdKrdS = c.tdVrP, c.tdKrdS
            if const_expr(self.ds_by_stmatrix):
                # dS^T to smem before the dV GEMM is issued, as FlashAttention-3/4 do: stored after it
                # (as below), the stmatrix version spilled 96 bytes and ptxas serialized the wgmmas
                # (advisory C7512).
                convert_f32_to_16bit(c.acc_dP, c.tdKrdS)
                dS = cute.make_tensor(c.tdKrdS.iterator, c.acc_dP.layout)
                cute.copy(c.ds_copy, c.thr_ds.retile(dS), c.tdSsdS[None, None, None, stage])
                convert_f32_to_16bit(c.acc_S, c.tdVrP)
                gemm(c.tiled_mma_dKV, c.acc_dV, tdVrP, c.tdVrdO[None, None, None, stage], zero_init=False)
            else:
                # P's 16-bit copy only now: the fp32 P and its copy are never live together.
                convert_f32_to_16bit(c.acc_S, c.tdVrP)
                gemm(c.tiled_mma_dKV, c.acc_dV, tdVrP, c.tdVrdO[None, None, None, stage], zero_init=False)
                convert_f32_to_16bit(c.acc_dP, c.tdKrdS)
                # dS^T in the accumulator's order is dS in smem: the dQ GEMM reads both groups' keys.
                cute.autovec_copy(cute.make_tensor(c.tdKrdS.iterator, c.acc_dP.layout),
                                  c.thr_SdP.partition_C(c.sdSt[None, None, stage]))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=DS_READY_BARRIER, number_of_threads=cfg.num_mma_threads)
        if const_expr(cfg.split_head_dim):
            gemm(c.tiled_mma_dKV, c.acc_dV, tdVrP, c.tdVrdO[None, None, None, stage], zero_init=False)
        if const_expr(cfg.q_stages == 1):
            # One Q and one dO buffer: each is released as soon as its last GEMM is done (dV
            # reads dO, dK Q), so that the next block's loads overlap the GEMMs still running.
            gemm(c.tiled_mma_dKV, c.acc_dK, tdKrdS, c.tdKrQ[None, None, None, stage], zero_init=False)
            gemm(c.tiled_mma_dQ, c.acc_dQ, c.tdQrdS[None, None, None, stage], c.tdQrK[None, None, None, 0],
                 zero_init=True)
            warpgroup.wait_group(2)
            c.pipeline_do.consumer_release(q_state)
            warpgroup.wait_group(1)
            c.pipeline_q.consumer_release(q_state)
            warpgroup.wait_group(0)
            self.hand_over_dq(c)
        else:
            # dQ before dK: dQ's copy into the staging buffer then runs while the dK GEMM does.
            gemm(c.tiled_mma_dQ, c.acc_dQ, c.tdQrdS[None, None, None, stage], c.tdQrK[None, None, None, 0],
                 zero_init=True)
            gemm(c.tiled_mma_dKV, c.acc_dK, tdKrdS, c.tdKrQ[None, None, None, stage], zero_init=False)
            warpgroup.wait_group(1)  # dV (the last reader of dO) and dQ are done
            c.pipeline_do.consumer_release(q_state)
            self.hand_over_dq(c)
            warpgroup.wait_group(0)  # dK is done with this stage's Q
            c.pipeline_q.consumer_release(q_state)

    @cute.jit
    def hand_over_dq(self, c: SimpleNamespace):
        """This query block's dQ into the staging buffer, once the dQ warp has emptied it."""
        sync_threads = self.cfg.num_mma_threads + 32
        cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER, number_of_threads=sync_threads)
        cute.autovec_copy(cute.make_tensor(c.acc_dQ.iterator, cute.make_layout(c.tdQsdQ.shape)), c.tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER, number_of_threads=sync_threads)

    @cute.jit
    def scores_to_smem(self, c: SimpleNamespace, stage):
        """split_head_dim: this group's columns of P^T and dS^T, in 16 bits, into P's and dS's
        buffers (m-major, as dS always is), where the dV and dK GEMMs of both groups read them."""
        if const_expr(self.cfg.q_stages == 1):
            # One buffer each: the other group's dV and dK GEMMs of the last block must be done.
            cute.arch.barrier(barrier_id=SCORES_FREE_BARRIER, number_of_threads=self.cfg.num_mma_threads)
        for acc, sXt in ((c.acc_S, c.sPt), (c.acc_dP, c.sdSt)):
            rX = cute.make_rmem_tensor_like(acc, self.cfg.dtype)
            convert_f32_to_16bit(acc, rX)
            cute.autovec_copy(rX, c.thr_SdP.partition_C(sXt[None, None, stage]))

    @cute.jit
    def stat_shares(self, c: SimpleNamespace, sStat: cute.Tensor, stage):
        """This lane's share of a statistic's values (None where each lane reads its own).

        A thread's accumulator columns (queries) are 8 * (j // 2) + j % 2 plus 2 * (lane % 4): the
        eight lanes with the same lane % 4 need the same per-query statistics. With 64-row query
        blocks each lane reads its 16 LSE values from smem where they are used. With 128 rows
        (`shared_stats`) ptxas hoists all 32 of those loads and spills; instead each of the eight
        lanes loads 4, just after the S GEMM is issued, and the others take them by shuffle."""
        shares = None
        if const_expr(self.cfg.shared_stats):
            columns = cute.size(c.tScS, mode=[1])
            assert [c.t0ScS[0, j][1] for j in range(columns)] == [8 * (j // 2) + j % 2 for j in range(columns)]
            per_lane = columns // 8
            lane = cute.arch.lane_idx()
            first = 4 * per_lane * (lane // 4) + c.tScS[0, 0][1]
            shares = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
            for t in cutlass.range_constexpr(per_lane):
                shares[t] = sStat[first + c.t0ScS[0, t][1], stage]
        return shares

    @cute.jit
    def column_stat(self, c: SimpleNamespace, sStat: cute.Tensor, shares, stage, j: cutlass.Constexpr):
        """The statistic of this thread's accumulator column j."""
        if const_expr(shares is None):
            return sStat[c.tScS[0, j][1], stage]
        per_lane = cute.size(shares)
        owner = 4 * (j // per_lane) + cute.arch.lane_idx() % 4
        return cute.arch.shuffle_sync(shares[j % per_lane], owner)

    @cute.jit
    def mask_causal(self, c: SimpleNamespace, acc_S_mn: cute.Tensor, m_block: Int32):
        """-inf where key > query + seqlen_k - seqlen_q (bottom-right aligned causal mask). Each
        element's key - query is this thread's offset plus thread 0's, a compile-time constant."""
        key0, query0 = c.tScS[0, 0]
        limit = (m_block * self.cfg.m_block_size - c.n_block * self.cfg.n_block_size + c.seqlen_k - c.seqlen_q
                 - (key0 - query0))
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                key, query = c.t0ScS[r, j]
                if key - query > limit:
                    acc_S_mn[r, j] = -Float32.inf

    @cute.jit
    def store_dKV(self, c, s, tma_atom_dK, mdK, tma_atom_dV, mdV, n_block, head_kv, batch, softmax_scale, tidx,
                  dkv_rows=None):
        """dK (scaled) and dV through K's and V's smem, stored by TMA (rows past seqlen_k clipped),
        or, packed (`dkv_rows`: the packed dK, dV and where the sequence starts), by 16-byte stores
        that stop at its last key."""
        n, d = self.cfg.n_block_size, self.cfg.head_dim
        c.acc_dK.store(c.acc_dK.load() * softmax_scale)
        if const_expr(self.cfg.dropout):
            c.acc_dV.store(c.acc_dV.load() * c.dropout.scale)
        # Both groups' last dQ GEMMs read all of K: wait for them before overwriting it.
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_mma_threads)
        stage_acc_in_smem(c.acc_dV, s.sV[None, None, 0], c.tiled_mma_dKV, tidx)
        stage_acc_in_smem(c.acc_dK, s.sK[None, None, 0], c.tiled_mma_dKV, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_mma_threads)
        if const_expr(dkv_rows is not None):
            s2g = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.cfg.dtype, self.cfg.num_mma_threads,
                                  math.gcd(d, 64))
            offset_k, seqlen_k = sequence_bounds(dkv_rows.mCuSeqlensK, dkv_rows.sSeq[0])
            for mX, sX in ((dkv_rows.mdV, s.sV), (dkv_rows.mdK, s.sK)):
                gX = cute.local_tile(rows_from(mX, offset_k, 0)[None, None, head_kv, 0], (n, d), (n_block, 0))
                store_smem_tile(sX[None, None, 0], gX, s2g, seqlen_k - n_block * n, d, tidx)
        else:
            if tidx < 32:
                for atom, mX, sX in ((tma_atom_dV, mdV, s.sV), (tma_atom_dK, mdK, s.sK)):
                    tXsX, tXgX = self.tma_views(atom, mX, sX, (n, d), n_block, head_kv, batch)
                    cute.copy(atom, tXsX[None, 0], tXgX)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
