"""The Hopper forward's producer warp: TMA loads of Q and of the K/V ring, tile by tile.

Per unit of the tile walk (tile_scheduler.py), one warp loads Q (in `q_pieces` pieces, one per
consumer warp group when `q_by_group`) and then K and V block by block, from the last n_block
down, into the `num_stages`-deep ring that the consumers of fwd.py drain. With `prefetch_next`
it warms L2 with the start of the CTA's next tile; with the dynamic schedule it claims that tile
and publishes it to the consumers through a small shared-memory pipeline.

`ForwardLoads` is mixed into FlashAttnFwdSm90 (fwd.py) and uses its `cfg` and `scheduler`.
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.blocks import BlockRanges, kv_head
from ..common.layouts import rows_from
from .primitives import L2_EVICT_FIRST, L2_EVICT_LAST, acquire_empty, l2_hint
from .tile_scheduler import SCHEDULE_STAGES


class ForwardLoads:
    """Producer-side methods of the Hopper forward (see the module docstring)."""

    @cute.jit
    def producer(
        self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt,
        pipeline_q, pipeline_k, pipeline_v, split, sched, walk_plan, window, varlen,
    ):
        num_heads = mQ.shape[2]
        seqlen_q, num_batch = self.scheduler.walk_extent(mQ.shape[0], mQ.shape[3], varlen)
        block_ranges = BlockRanges(self.cfg.tile_m, self.cfg.tile_n, self.cfg.causal)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.q_stages * self.cfg.q_pieces)
        num_units = self.scheduler.num_units(seqlen_q, num_heads, num_batch, split)
        round_idx = Int32(0)
        unit = self.scheduler.unit_of_round(round_idx, walk_plan)
        sched_state = None
        if const_expr(self.cfg.dynamic_schedule):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHEDULE_STAGES)
            sched_state = self.scheduler.publish_unit(sched, sched_state, unit)
        while unit < num_units:
            next_unit = self.scheduler.unit_of_round(round_idx + 1, walk_plan)
            n_block_min, n_block_max, (tQsQ, tQgQ), (tKsK, tKgK), (tVsV, tVgV) = self.tile_views(
                unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split, window, varlen
            )
            load_K = partial(self.load_block, tma_atom_K, tKgK, tKsK, pipeline_k)
            load_V = partial(self.load_block, tma_atom_V, tVgV, tVsV, pipeline_v)

            if n_block_max > n_block_min:
                # With one Q stage, K first: Q's buffer may still hold the previous tile (or its
                # O) until the consumers release it.
                if const_expr(self.cfg.q_stages == 1):
                    load_K(n_block_max - 1, kv_state)
                for piece in cutlass.range_constexpr(self.cfg.q_pieces):
                    acquire_empty(pipeline_q, q_state, self.cfg.spin_waits)
                    cute.copy(tma_atom_Q, tQgQ[None, piece], tQsQ[None, piece, q_state.index // self.cfg.q_pieces],
                              tma_bar_ptr=pipeline_q.producer_get_barrier(q_state),
                              **l2_hint(self.cfg.cache_hints, L2_EVICT_FIRST))
                    q_state.advance()
                if const_expr(self.cfg.q_stages > 1):
                    load_K(n_block_max - 1, kv_state)
                if const_expr(self.cfg.prefetch_next):
                    self.prefetch_tile(
                        next_unit, tma_atom_Q, mQ, tma_atom_K, mK,
                        tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split, window,
                    )
                # Consumers want K of block j before V of block j+1: issue in that order.
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    n_block = n_block_max - 2 - i
                    state_prev = kv_state.clone()
                    kv_state.advance()
                    load_K(n_block, kv_state)
                    load_V(n_block + 1, state_prev)
                load_V(n_block_min, kv_state)
                kv_state.advance()
            if const_expr(self.cfg.dynamic_schedule):
                # Claimed only now, num_stages blocks before the consumers finish this unit: a CTA
                # that claimed at the start of a long tile would leave the next (longest) units
                # waiting behind it while CTAs with short tiles idle.
                next_unit = self.scheduler.fetch_unit(sched, num_units)
                sched_state = self.scheduler.publish_unit(sched, sched_state, next_unit)
            round_idx += 1
            unit = next_unit

    def tile_views(self, unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split,
                   window, varlen=None):
        """The K/V blocks [n_block_min, n_block_max) of one unit of the walk and the TMA (smem,
        gmem) views of its Q and of K, V by n_block."""
        seqlen_k, num_heads = mK.shape[0], mQ.shape[2]
        seqlen_q, num_batch = self.scheduler.walk_extent(mQ.shape[0], mQ.shape[3], varlen)
        m_block, head, batch, n_block_min, n_block_max, _, seq = self.scheduler.unit_work(
            unit, seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split, window, varlen
        )
        head_kv = kv_head(head, num_heads, mK.shape[2])
        if const_expr(varlen is not None):
            # The packed tensors from this sequence's first rows on (batch mode of size 1). TMA
            # reads past the sequence's last row into the next one's: masked keys, unstored rows.
            mQ, mK, mVt = rows_from(mQ, seq.offset_q, 0), rows_from(mK, seq.offset_k, 0), rows_from(mVt, seq.offset_k, 1)
            batch = 0
        # Q by pieces of a tile's rows (q_by_group), smem (rows, d, piece, stage), gmem (rows, d, piece).
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.cfg.q_piece_rows, self.cfg.head_dim), (None, 0))
        gQ = cute.local_tile(gQ, (self.cfg.q_piece_rows, self.cfg.head_dim, self.cfg.q_pieces), (0, 0, m_block))
        sQ = cute.flat_divide(sQ, (self.cfg.q_piece_rows, self.cfg.head_dim))
        sQ = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[0, 1, 2, 4]))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.cfg.tile_n, self.cfg.head_dim), (None, 0))
        gVt = cute.local_tile(mVt[None, None, head_kv, batch], (self.cfg.head_dim, self.cfg.tile_n), (0, None))
        no_mcast = cute.make_layout(1)
        views = [
            cpasync.tma_partition(atom, 0, no_mcast, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            for atom, sX, gX in ((tma_atom_Q, sQ, gQ), (tma_atom_K, sK, gK), (tma_atom_V, sVt, gVt))
        ]
        return n_block_min, n_block_max, views[0], views[1], views[2]

    @cute.jit
    def prefetch_tile(self, unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges,
                      split, window):
        """Warm L2 with Q and the first K, V block of `unit` (this CTA's next one) while the current
        one runs, so the next tile does not start with a DRAM round trip."""
        if unit < self.scheduler.num_units(mQ.shape[0], mQ.shape[2], mQ.shape[3], split):
            n_block_min, n_block_max, (_, tQgQ), (_, tKgK), (_, tVgV) = self.tile_views(
                unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split, window
            )
            if n_block_max > n_block_min:
                for piece in cutlass.range_constexpr(self.cfg.q_pieces):
                    cute.prefetch(tma_atom_Q, tQgQ[None, piece])
                cute.prefetch(tma_atom_K, tKgK[None, n_block_max - 1])
                cute.prefetch(tma_atom_V, tVgV[None, n_block_max - 1])

    def load_block(self, tma_atom, tXgX, tXsX, pipe, n_block, state):
        acquire_empty(pipe, state, self.cfg.spin_waits)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state), **l2_hint(self.cfg.cache_hints, L2_EVICT_LAST))
