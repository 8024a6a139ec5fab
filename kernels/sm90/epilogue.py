"""How the Hopper forward's O and LSE leave the CTA, and how tail-split pieces are merged.

Three ways out for O (config): registers -> smem -> one TMA store per tile, or per warp group
(wg_epilogue: 16-byte stores from smem, or a TMA box per group with wg_tma_store); or straight
from the accumulator to global memory after a transpose within each quad (o_from_registers).
A tail-split piece leaves its O and LSE in the workspace instead, and the last piece of its tile
to finish merges them (merge_pieces, store_merged). LSE always goes from registers.
"""

from __future__ import annotations

import math
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.layouts import reshape_acc_to_mn, store_tile_rows
from ..common.packed16 import cvt_pack_16bit
from ..common.softmax import LOG2_E
from .config import Sm90FwdConfig
from .primitives import EPILOGUE_BARRIER, L2_EVICT_FIRST, SPLIT_BARRIER, l2_hint
from .tile_scheduler import MAX_SPLITS, TailPlan, TileScheduler


class Epilogue:
    """Device code of the consumer warp groups after a unit's mainloop."""

    def __init__(self, config: Sm90FwdConfig, scheduler: TileScheduler):
        self.cfg = config
        self.scheduler = scheduler

    @cute.jit
    def merge_pieces(self, acc_O, lse, tOcO_mn, tidx, slot, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """Hand-off of the tail-split piece in workspace slot `slot`: its normalized O and its LSE
        go to the workspace; the CTA that completes the tile's last piece reads every piece back
        and stores the merged tile itself (O = sum_p exp(lse_p - lse) O_p, lse the log-sum-exp
        of the lse_p)."""
        acc_O_mn = reshape_acc_to_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tOcO_mn[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                split.mO[slot, row, tOcO_mn[r, j][1]] = acc_O_mn[r, j]
            split.mLSE[slot, row] = lse[r]
        # Release this piece's writes to the CTA that merges (the classic fence, barrier, atomic).
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=SPLIT_BARRIER, number_of_threads=self.cfg.num_mma_threads)
        # Read only now: loaded before the stores above, its words took registers O needed there.
        plan_row = cute.domain_offset((slot * TailPlan.UNIT_WORDS,), self.scheduler.tail_plan_words(split))
        tail_tile = plan_row[0] - split.whole_tiles
        if tidx == 0:
            counter = split.mCount.iterator + tail_tile
            split.done[0] = cute.arch.atomic_add(counter.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=SPLIT_BARRIER, number_of_threads=self.cfg.num_mma_threads)
        if split.done[0] == plan_row[3] - 1:
            if tidx == 0:
                split.mCount[tail_tile] = 0  # every piece has counted: ready for the next call
            cute.arch.fence_acq_rel_gpu()
            self.store_merged(tidx, plan_row, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q)

    @cute.jit
    def store_merged(self, tidx, plan_row, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """The merge of the pieces in the slots of `plan_row` (TailPlan), in 16-byte pieces of rows
        that consecutive threads read together, straight to O and LSE in global memory. Every
        piece's LSE and O are loaded at once (the row repeats the last slot, read with weight 0),
        for merge_batch chunks before any is stored: a loop over the pieces, or reading them in the
        accumulator's scattered layout, left the loads one after another (~30 us a merge), and so
        did each chunk's loads behind the stores of the chunk before, which might alias them: a
        stream-K tail with a merge per SM lost 40 us a call (d256 bf16: -22% at 4k keys, -6% at
        8k, 2026-11-24)."""
        vec = 4
        row_vecs = self.cfg.head_dim // vec
        last_piece = plan_row[3] - 1
        slots = [plan_row[4 + p] for p in range(MAX_SPLITS)]
        chunks = self.cfg.tile_m * row_vecs // self.cfg.num_mma_threads
        for first in cutlass.range_constexpr(0, chunks, self.cfg.merge_batch):
            loaded = []
            for i in cutlass.range_constexpr(first, min(first + self.cfg.merge_batch, chunks)):
                chunk = tidx + i * self.cfg.num_mma_threads
                row = chunk // row_vecs
                col_vec = chunk - row * row_vecs
                lses = [split.mLSE[slot, row] for slot in slots]
                outs = [cute.local_tile(split.mO[slot, None, None], (1, vec), (row, col_vec)).load() for slot in slots]
                loaded.append((row, col_vec, lses, outs))
            for row, col_vec, lses, outs in loaded:
                lse_max = lses[0]
                for p in cutlass.range_constexpr(1, MAX_SPLITS):
                    lse_max = cutlass.max(lse_max, lses[p])
                lse_max = 0.0 if lse_max == -Float32.inf else lse_max
                weight_sum = Float32(0.0)
                merged = outs[0]
                for p in cutlass.range_constexpr(MAX_SPLITS):
                    weight = cute.math.exp2((lses[p] - lse_max) * LOG2_E, fastmath=True)
                    weight = weight if p <= last_piece else Float32(0.0)
                    weight_sum += weight
                    if const_expr(p == 0):
                        merged = outs[p] * weight
                    else:
                        merged = merged + outs[p] * weight
                # A row no piece saw a key of keeps the kernel's convention: O = 0, LSE = -inf.
                no_key = weight_sum == 0.0
                inv_weight_sum = 0.0 if no_key else cute.arch.rcp_approx(weight_sum)
                row_global = m_block * self.cfg.tile_m + row
                if row_global < seqlen_q:
                    gO = cute.local_tile(mO_gmem[None, None, head, batch], (1, vec), (row_global, col_vec))
                    gO.store((merged * inv_weight_sum).to(self.cfg.dtype))
                    if col_vec == 0:
                        lse_row = lse_max + cute.math.log2(weight_sum, fastmath=True) * math.log(2.0)
                        mLSE[batch, head, row_global] = -Float32.inf if no_key else lse_row

    @cute.jit
    def store_lse(self, lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q):
        """LSE straight from registers: the thread holding column 0 of a row writes it."""
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.cfg.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = lse[r]

    @cute.jit
    def store_O_from_registers(self, acc_O, lse, tOcO_mn, tidx, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """O and LSE from the accumulator to global memory, without smem (o_from_registers).

        In the wgmma accumulator, the four threads of a quad hold one row's 8-column chunk as four
        packed pairs, lane t the pair at columns 2t, 2t+1. For each run of four chunks the quad
        transposes its 4 x 4 pairs (two butterfly shuffle steps), after which lane t holds all of
        chunk t: one 16-byte store instead of four 4-byte ones."""
        self.store_lse(lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q)
        acc_O_mn = reshape_acc_to_mn(acc_O)
        lane = tidx % 4
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.cfg.dtype, num_bits_per_copy=128)
        chunk = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        chunk_elems = cute.make_tensor(cute.recast_ptr(chunk.iterator, dtype=self.cfg.dtype), cute.make_layout(8))
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            row = m_block * self.cfg.tile_m + tOcO_mn[r, 0][0]
            for run in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1]) // 8):
                # pairs[i]: this lane's pair of chunk 4 * run + i (columns 8 * chunk + 2 * lane).
                pairs = []
                for i in cutlass.range_constexpr(4):
                    pairs.append(
                        cvt_pack_16bit(acc_O_mn[r, 8 * run + 2 * i], acc_O_mn[r, 8 * run + 2 * i + 1], self.cfg.dtype)
                    )
                # Step 1 swaps the off-diagonal 2 x 2 blocks between lanes t and t ^ 2, step 2
                # transposes each 2 x 2 block between lanes t and t ^ 1.
                for bit, firsts in ((2, (0, 1)), (1, (0, 2))):
                    upper = (lane & bit) != 0
                    for k in firsts:
                        low, high = pairs[k], pairs[k + bit]
                        got = cute.arch.shuffle_sync_bfly(high if not upper else low, offset=bit)
                        pairs[k] = got if upper else low
                        pairs[k + bit] = high if upper else got
                for i in cutlass.range_constexpr(4):
                    chunk[i] = pairs[i]
                if row < seqlen_q:
                    gO = cute.local_tile(mO_gmem[None, None, head, batch], (1, 8), (row, 4 * run + lane))
                    cute.copy(store_atom, chunk_elems, gO[0, None])

    @cute.jit
    def store_O_through_smem(
        self, acc_O, lse, tOcO_mn, smem_copy_O, sO, tma_atom_O, mO, mO_gmem, gmem_copy_O, mLSE, tidx,
        wg_idx, m_block, head, batch, seqlen_q,
    ):
        self.store_lse(lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q)

        rO = cute.make_rmem_tensor_like(acc_O, self.cfg.dtype)
        rO.store(acc_O.load().to(self.cfg.dtype))
        thr_copy_O = smem_copy_O.get_slice(tidx)
        if const_expr(self.cfg.wg_epilogue):
            # Each warp group stages its own rows of O in sO (its rows of Q's buffer when O has
            # none: its own S GEMMs, the only readers of those rows, are done) and stores them,
            # clipped at seqlen_q: with 16-byte vector stores, or (wg_tma_store) with one TMA box
            # that the group's first warp issues, waiting for TMA to have read the rows only before
            # the group writes them again (or, through Q's buffer, before Q is released). The first
            # barrier keeps a fast thread from overwriting rows that a slow one (or TMA) is still
            # reading for the previous tile.
            if const_expr(self.cfg.wg_tma_store):
                if tidx % 128 < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            group_barrier = partial(
                cute.arch.barrier, barrier_id=EPILOGUE_BARRIER + wg_idx, number_of_threads=128
            )
            group_barrier()
            cute.copy(smem_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))
            if const_expr(self.cfg.wg_tma_store):
                cute.arch.fence_proxy("async.shared", space="cta")
            group_barrier()
            if const_expr(self.cfg.wg_tma_store):
                if tidx % 128 < 32:
                    gO = cute.local_tile(mO[None, None, head, batch], (64, self.cfg.head_dim), (None, 0))
                    tOsO, tOgO = cpasync.tma_partition(
                        tma_atom_O, 0, cute.make_layout(1),
                        cute.group_modes(cute.flat_divide(sO, (64, self.cfg.head_dim)), 0, 2), cute.group_modes(gO, 0, 2),
                    )
                    cute.copy(tma_atom_O, tOsO[None, wg_idx, 0], tOgO[None, m_block * self.cfg.num_wg_mma + wg_idx],
                              **l2_hint(self.cfg.cache_hints, L2_EVICT_FIRST))
                    cute.arch.cp_async_bulk_commit_group()
                    if const_expr(not self.cfg.separate_o):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                sO_rows = cute.local_tile(sO, (64, self.cfg.head_dim), (wg_idx, 0))
                gO_rows = cute.local_tile(
                    mO_gmem[None, None, head, batch], (64, self.cfg.head_dim), (m_block * self.cfg.num_wg_mma + wg_idx, 0)
                )
                store_tile_rows(gmem_copy_O, tidx % 128, sO_rows, gO_rows,
                                seqlen_q - m_block * self.cfg.tile_m - wg_idx * 64)
        else:
            # O: registers -> smem -> one TMA store, clipped at seqlen_q. sO is its own buffer or
            # Q's (each warp group overwrites only its own rows, which its last S GEMM has finished
            # reading). The storing warp waits until TMA has read sO; the barrier first makes every
            # warp wait for that, so a warp group with a short tile cannot overwrite rows that the
            # previous tile's store has not read yet.
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_mma_threads)
            cute.copy(smem_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_mma_threads)
            if tidx < 32:
                gO = cute.local_tile(mO[None, None, head, batch], (self.cfg.tile_m, self.cfg.head_dim), (m_block, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O, 0, cute.make_layout(1),
                    cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO, **l2_hint(self.cfg.cache_hints, L2_EVICT_FIRST))
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

