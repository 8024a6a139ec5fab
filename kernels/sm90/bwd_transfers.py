"""The Hopper backward's warp group 0: the TMA producer warp and the dQ writer warp.

Warp 0 loads K and V once, then per query block of the walk Q with its LSE and dO with its D into
the `q_stages`-deep rings that the MMA warp groups of bwd.py drain. Warp 1 adds each query
block's dQ, staged in smem by the MMA warp groups, to the fp32 sums in global memory with one bulk
reduce, in a fixed key-block order with `deterministic`.

`BackwardTransfers` is mixed into FlashAttnBwdSm90 (bwd.py) and uses its `cfg`, `ranges` and `step`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives import cp_reduce_async_bulk_global_shared_cta
from cutlass.experimental.primitives.nvvm_wrapper import CpReduceType

# Named barriers (0 is __syncthreads): both MMA groups' dS is in smem; the dQ staging buffer is
# free / full (MMA warp groups and the dQ warp); the epilogue's smem reuse.
DS_READY_BARRIER = 1
DQ_EMPTY_BARRIER = 2
DQ_FULL_BARRIER = 3
EPILOGUE_BARRIER = 4
SCORES_FREE_BARRIER = 5  # split_head_dim with one buffer: P's and dS's smem may be overwritten


class BackwardTransfers:
    """Warp group 0's methods of the Hopper backward (see the module docstring)."""

    @cute.jit
    def producer(self, tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV, tma_atom_LSE, mLSE,
                 tma_atom_dPsum, mdPsum, s, pipeline_kv, pipeline_q, pipeline_do, walk, n_block, head_kv, batch):
        cfg = self.cfg
        m, n, d = cfg.m_block_size, cfg.n_block_size, cfg.head_dim
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        for atom, mX, sX in ((tma_atom_K, mK, s.sK), (tma_atom_V, mV, s.sV)):
            self.load_tile(atom, mX, sX, (n, d), n_block, head_kv, batch, 0, pipeline_kv.producer_get_barrier(kv_state))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.q_stages)
        for i in cutlass.range(walk.steps, unroll=1):
            head, m_block = self.step(walk, i)
            # Q with its LSE on one barrier, dO with its D on the other; both rings advance together.
            pipeline_q.producer_acquire(q_state)
            bar_q = pipeline_q.producer_get_barrier(q_state)
            self.load_tile(tma_atom_Q, mQ, s.sQ, (m, d), m_block, head, batch, q_state.index, bar_q)
            self.load_tile(tma_atom_LSE, mLSE, s.sLSE, (m,), m_block, head, batch, q_state.index, bar_q)
            pipeline_do.producer_acquire(q_state)
            bar_do = pipeline_do.producer_get_barrier(q_state)
            self.load_tile(tma_atom_dO, mdO, s.sdO, (m, d), m_block, head, batch, q_state.index, bar_do)
            self.load_tile(tma_atom_dPsum, mdPsum, s.sdPsum, (m,), m_block, head, batch, q_state.index, bar_do)
            q_state.advance()

    @cute.jit
    def load_tile(self, atom, mX, sX, tile: cutlass.Constexpr, block, head, batch, stage, bar):
        """TMA: block `block` of (head, batch) into stage `stage` of sX, completing on mbarrier `bar`."""
        tXsX, tXgX = self.tma_views(atom, mX, sX, tile, block, head, batch)
        cute.copy(atom, tXgX, tXsX[None, stage], tma_bar_ptr=bar)

    @staticmethod
    def tma_views(atom, mX, sX, tile, block, head, batch):
        """The TMA views (smem by stage, gmem) of block `block` of `tile`-shaped tiles along the
        rows of (head, batch)."""
        rank = len(tile)
        gX = cute.local_tile(mX[(None,) * rank + (head, batch)], tile, (block,) + (0,) * (rank - 1))
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, rank),
                                     cute.group_modes(gX, 0, rank))

    @cute.jit
    def dq_writer(self, mdQaccum, mdQsemaphore, sdQ, walk, n_block, batch, tensor_batch, seqlen_q, seqlen_k, window):
        """Warp 1: each query block's dQ, staged in smem by the MMA warp groups, added to its fp32
        sums in global memory with one bulk reduce. With `deterministic` the key blocks of a query
        block add in a fixed order (descending with causal or window masks: cfg.shortest_walk_first):
        wait for the semaphore to reach this block's turn, add, wait until the add has landed, pass
        the turn on."""
        cfg = self.cfg
        tile_elems = cfg.m_block_size * cfg.head_dim
        sync_threads = cfg.num_mma_threads + 32
        lane = cute.arch.lane_idx()
        for i in cutlass.range(walk.steps, unroll=1):
            head, m_block = self.step(walk, i)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER, number_of_threads=sync_threads)
            if const_expr(cfg.deterministic):
                lock = mdQsemaphore.iterator + cute.crd2idx((batch, head, m_block), mdQsemaphore.layout)
                turn = n_block
                if const_expr(cfg.shortest_walk_first):
                    turn = self.ranges.dq_turn_descending(n_block, m_block, seqlen_q, seqlen_k, window)
                if lane == 0:
                    while cute.arch.load(lock, Int32, sem="acquire", scope="gpu") != turn:
                        pass
            cute.arch.barrier(barrier_id=DQ_FULL_BARRIER, number_of_threads=sync_threads)
            if lane == 0:
                gdQaccum = cute.local_tile(mdQaccum[tensor_batch, head, None], (tile_elems,), (m_block,))
                cp_reduce_async_bulk_global_shared_cta(gdQaccum.iterator, sdQ.iterator, tile_elems * 4,
                                                       type=CpReduceType.F32)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(cfg.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(lock, Int32(1), sem="release", scope="gpu")
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
