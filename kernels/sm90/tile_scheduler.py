"""The Hopper forward's tile scheduler: which CTA computes which unit of work, and when.

A unit is a tile (one tile_m x head_dim block of O for one (batch, head)) or, at the end of a
persistent non-causal walk, a piece of a tile: a run of its K/V blocks (the tail split). The
host side plans per call (`tail_plan`, `plan_walk`); the device side (`TileScheduler`) walks
the plan in the producer warp and the consumer warp groups alike:

    unit = scheduler.unit_of_round(0, walk_plan)           # or, dynamic: the first one published
    while unit < scheduler.num_units(...):
        m_block, head, batch, n_block_min, n_block_max, slot, seq = scheduler.unit_work(unit, ...)
        ...
        unit = next: unit_of_round(round + 1) (static walk, snake or turned rounds; planned tail
               rounds from walk_plan) or, with the dynamic schedule, the producer's
               fetch_unit + publish_unit and the consumers' receive_unit

docs/kernels/sm90-forward.md (sections "Tile order", "Persistent CTAs", "Tail split") gives the
measurements behind each rule.
"""

from __future__ import annotations

import heapq
from collections import Counter

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from types import SimpleNamespace

from ..common.blocks import BlockRanges
from ..common.layouts import LONGEST_FIRST_MAX_SEQUENCES, key_length_rank, sequence_bounds
from .config import Sm90FwdConfig
from .primitives import acquire_empty, wait_full

L2_BYTES = 50 * 1024 * 1024  # the H100's L2: what K/V of concurrently running heads may fill
MAX_SPLITS = 4  # pieces per tail tile: each adds a prologue, a workspace slot and a merge read
MIN_PIECE_BLOCKS = 2  # K/V blocks per piece, so that a piece still overlaps its GEMMs
# Stream-K tails only where a tile has this many K/V blocks: a share's pieces cost about 20 us per
# SM (pipeline refill behind Q's buffer, float32 O to the workspace, half of them merge).
STREAM_K_MIN_BLOCKS = 128
SCHEDULE_STAGES = 2  # next-unit slots between the producer and the consumers (dynamic_schedule)
# The walk plan's cost model (planned_tail): a tile costs this many K/V blocks' time besides its
# blocks (its prologue, epilogue and first loads), from a per-CTA timeline of causal d128 at 512 keys.
TILE_COST_BLOCKS = 1.2
PLANNED_TAIL_ROUNDS = 4  # at most this many full rounds before the end are planned
NO_UNIT = 2**31 - 1  # a walk plan's entry for a CTA that has no more units


class TailPlan:
    """Which pieces the last `tiles` tiles of a persistent non-causal walk run as, in the order the
    walk hands them out. Piece i keeps its O and LSE in workspace slot i; its row of the plan
    (`words`, which the kernel reads after its counters) is: its tile, n_block_min, n_block_max,
    the tile's number of pieces and their slots (the last repeated up to MAX_SPLITS), so that
    the tile's last piece to finish finds the others."""

    UNIT_WORDS = 4 + MAX_SPLITS

    def __init__(self, tiles: int, units: list[tuple[int, int, int]]):
        self.tiles, self.units = tiles, units  # (tail tile, n_block_min, n_block_max) per piece

    def whole_tiles(self, num_tiles: int) -> int:
        return num_tiles - self.tiles

    @staticmethod
    def schedule_counter(num_sms: int) -> int:
        """Index of the dynamic schedule's counter: after one counter per tail tile (fewer than
        two rounds of tiles)."""
        return 2 * num_sms

    @staticmethod
    def plan_offset(num_sms: int) -> int:
        return TailPlan.schedule_counter(num_sms) + 1

    def words(self, num_tiles: int) -> list[int]:
        """The plan as the kernel reads it, with tile indices in the walk of `num_tiles` tiles."""
        slots: dict[int, list[int]] = {}
        for slot, (tile, _, _) in enumerate(self.units):
            slots.setdefault(tile, []).append(slot)
        padded = {tile: own + own[-1:] * (MAX_SPLITS - len(own)) for tile, own in slots.items()}
        whole = self.whole_tiles(num_tiles)
        return [w for tile, lo, hi in self.units for w in (whole + tile, lo, hi, len(slots[tile]), *padded[tile])]

    @staticmethod
    def even(split_tiles: int, splits: int, num_n_blocks: int) -> "TailPlan":
        """Each tail tile in `splits` equal runs of its blocks (tail_split_plan), tile by tile."""
        return TailPlan(split_tiles, [(tile, piece * num_n_blocks // splits, (piece + 1) * num_n_blocks // splits)
                                      for tile in range(split_tiles) for piece in range(splits)])

    @staticmethod
    def stream_k(num_tiles: int, num_n_blocks: int, num_sms: int) -> "TailPlan | None":
        """The last round's leftover tiles and one full round before them (or all tiles, when
        fewer than that) as one run of K/V blocks, cut into num_sms equal shares, one per SM;
        a share covers parts of two or three tiles. Cuts within MIN_PIECE_BLOCKS of a tile's
        edge move to it. Pieces go out in the order their shares would start them with every SM
        starting its share at once, so that the dynamic schedule, which hands the next unit to
        the first SM free, keeps each SM's total at one share. A tile that one share covers is one
        piece, which stores its O itself. None when no tiles are left over or a tile would come in
        more than MAX_SPLITS pieces."""
        leftover = num_tiles % num_sms
        if leftover == 0:
            return None
        tiles = min(num_tiles, leftover + num_sms)
        total = tiles * num_n_blocks
        cuts = []
        for share in range(num_sms + 1):
            cut = round(share * total / num_sms)
            edge = round(cut / num_n_blocks) * num_n_blocks
            cut = edge if abs(cut - edge) < MIN_PIECE_BLOCKS else cut
            if not cuts or cut > cuts[-1]:
                cuts.append(cut)
        pieces = []  # (start within its share, share, tail tile, n_block_min, n_block_max)
        for share, (begin, end) in enumerate(zip(cuts, cuts[1:])):
            at = begin
            while at < end:
                tile = at // num_n_blocks
                stop = min(end, (tile + 1) * num_n_blocks)
                pieces.append((at - begin, share, tile, at - tile * num_n_blocks, stop - tile * num_n_blocks))
                at = stop
        if max(Counter(p[2] for p in pieces).values()) > MAX_SPLITS:
            return None
        return TailPlan(tiles, [p[2:] for p in sorted(pieces, key=lambda p: p[:2])])

def tail_work(seqlen_q: int, tile_m: int, num_heads_batch: int) -> int:
    """The tiles' work in whole tiles: a head's last tile costs only the warp groups that have
    rows in it (the others pass its blocks, pass_blocks), e.g. a third for 4096 rows in 192-row
    tiles."""
    m_blocks, groups = -(-seqlen_q // tile_m), tile_m // 64
    last_groups = -(-(seqlen_q - (m_blocks - 1) * tile_m) // 64)
    return -(-((m_blocks - 1) * groups + last_groups) * num_heads_batch // groups)

def tail_split_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int | None = None) -> tuple[int, int]:
    """(split_tiles, splits) for one call of a tail-splitting kernel: the last `split_tiles`
    tiles of the walk run as `splits` pieces each, all at once on the SMs that the last round
    would leave idle. (0, 1) when the round is full, or too full for two pieces per tile, or
    when pieces would be shorter than MIN_PIECE_BLOCKS K/V blocks. Measured (perf/NOTES.md):
    pieces over two rounds lost 7-13% (per-piece prologue and merge, and an H100 that clocks
    up while SMs idle), so they all fit one; planned where no one-round split exists (an
    earlier variant, perf/NOTES.md), they lost 3-7% at d128 1k / 2k and tied at d64 8k / 16k.
    When the tiles leave no split, the plan is taken again on their work (`work_tiles`,
    tail_work): partial tiles run ahead of the walk, and what is left after the last full
    round of work is what idles. d128 at 4k keys (1408 tiles, 1366 of work): (46, 2), +3%
    (2026-11-23); at 8k / 16k, where the tiles' own plan (56, 2) applies, the work's plan
    lost 1-2%."""
    plan = _split_leftover(num_tiles, num_n_blocks, num_sms)
    if plan == (0, 1) and work_tiles is not None:
        plan = _split_leftover(work_tiles, num_n_blocks, num_sms)
    return plan

def tail_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int | None = None,
              dynamic_schedule: bool = False) -> TailPlan | None:
    """The pieces of one call's tail (TailPlan), None for none. Equal pieces all in the last
    round where tail_split_plan finds them; otherwise, on the dynamic schedule, with tiles of
    equal cost and at least STREAM_K_MIN_BLOCKS blocks a tile, equal shares of the last two
    rounds' blocks per SM (TailPlan.stream_k). Why: 128-row d256 tiles leave 100 / 116 / 124
    of 132 SMs busy in the last round at 16k / 8k / 4k tokens (8 heads), too many to split
    within the round; a full last round measured +2% TFLOP/s for both ours and FA4 (seqlen_q
    16896 / 8448 / 4224 against 16384 / 8192 / 4096, 2026-11-24)."""
    split_tiles, splits = tail_split_plan(num_tiles, num_n_blocks, num_sms, work_tiles)
    if split_tiles:
        return TailPlan.even(split_tiles, splits, num_n_blocks)
    # The shares are equal in blocks, so only where every tile costs the same (no head's last
    # tile with fewer rows: tail_work).
    whole_cost = work_tiles is None or work_tiles == num_tiles
    if dynamic_schedule and whole_cost and num_n_blocks >= STREAM_K_MIN_BLOCKS:
        return TailPlan.stream_k(num_tiles, num_n_blocks, num_sms)
    return None

def _split_leftover(num_tiles: int, num_n_blocks: int, num_sms: int) -> tuple[int, int]:
    leftover = num_tiles % num_sms
    if leftover == 0:
        return 0, 1
    splits = min(num_sms // leftover, num_n_blocks // MIN_PIECE_BLOCKS, MAX_SPLITS)
    return (leftover, splits) if splits >= 2 else (0, 1)

def plan_walk(seqlen_q: int, seqlen_k: int, num_heads_batch: int, tile_m: int, tile_n: int,
              num_sms: int) -> list[int]:
    """The planned tail of a persistent per-head causal walk (planned_tail), as the int32
    words the kernel reads: [first planned round, then one row of grid entries per planned
    round, unit or NO_UNIT, then a row of NO_UNIT]. Rounds before the first follow
    unit_of_round's snake. The planned units, the last 1..PLANNED_TAIL_ROUNDS full rounds and
    the partial one, go longest first to the CTA with the least modeled work so far
    (TILE_COST_BLOCKS); the number of rounds with the shortest modeled end wins. [NO_UNIT]
    when no plan ends sooner than the snake.

    Why: the snake pairs a round's long tiles with the next round's short ones, but the last
    full round and the partial one are not paired. Causal d128, 512 keys, 2048 tiles on 132
    SMs: CTAs with 16 tiles end at 59.2 modeled blocks, those with 15 at 54.2 to 57.2
    (per-CTA timeline, 2026-11-23: 99.4 against 91.9-95.6 us); planned, 58.2."""
    m_blocks = -(-seqlen_q // tile_m)
    num_tiles = m_blocks * num_heads_batch
    grid = min(num_tiles, num_sms)
    full_rounds = num_tiles // grid
    ranges = BlockRanges(tile_m, tile_n, True)
    # Unit u of the per-head order is m_block m_blocks - 1 - u % m_blocks (tile_coord).
    cost = [TILE_COST_BLOCKS + ranges.n_block_end((m_blocks - i) * tile_m, seqlen_q, seqlen_k)
            for i in range(m_blocks)]

    def snake_loads(rounds: int) -> list[float]:
        # A round's costs depend only on its parity and on where it starts within a head.
        loads = [0.0] * grid
        for (odd, start), count in Counter((r % 2, r * grid % m_blocks) for r in range(rounds)).items():
            for lane in range(grid):
                loads[grid - 1 - lane if odd else lane] += count * cost[(start + lane) % m_blocks]
        return loads

    snake_end = snake_loads(full_rounds)
    odd_last = full_rounds % 2
    for unit in range(full_rounds * grid, num_tiles):
        lane = unit - full_rounds * grid
        snake_end[grid - 1 - lane if odd_last else lane] += cost[unit % m_blocks]
    best_end, best = max(snake_end), [NO_UNIT]
    for planned_full in range(1, min(PLANNED_TAIL_ROUNDS, full_rounds) + 1):
        first = full_rounds - planned_full
        free = [(load, cta) for cta, load in enumerate(snake_loads(first))]
        heapq.heapify(free)
        units = [[] for _ in range(grid)]
        for unit in sorted(range(first * grid, num_tiles), key=lambda u: -cost[u % m_blocks]):
            load, cta = heapq.heappop(free)
            units[cta].append(unit)
            heapq.heappush(free, (load + cost[unit % m_blocks], cta))
        end = max(load for load, _ in free)
        if end < best_end - 1e-6:  # shorter by more than float rounding
            rows = max(len(u) for u in units) + 1
            best_end, best = end, [first] + [
                units[cta][row] if row < len(units[cta]) else NO_UNIT
                for row in range(rows) for cta in range(grid)
            ]
    return best

# ------------------------------------------------------------------ host entry

class TileScheduler:
    """The device side of the walk for one kernel configuration (see the module docstring).
    Every method emits device code for the role that calls it; what the roles share at run time
    (the schedule's pipeline and slots, the walk plan, the tail plan) comes in as arguments."""

    def __init__(self, config: Sm90FwdConfig):
        self.cfg = config

    @cute.jit
    def tile_coord(self, tile: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_batch: Int32):
        """(m_block, head, batch) of tile index `tile` (blockIdx.x, then + gridDim.x per step).

        With causal masking the tiles at the end of the sequence do the most work, so they
        should start first (longest processing time first), but tiles running at the same time
        should also share K/V in L2. "head": descending m_block within each (head, batch) pair.
        "l2": descending m_block across groups of pairs whose K and V fit in L2 together (a power
        of two of them, as FA4 does). Measured (causal, bf16, against the former 40 MB groups of
        any size and "head"): 8k d256 700 vs 600/636 TFLOP/s, d128 600 vs 573/577; d64 +2% at
        8k-16k. At 16k d192 / d256 (two heads a group) against "head": +0.8 / +2.8% and +0.8 /
        +2.1% (bf16 / fp16, interleaved A/B, 2026-11-24); "head" led there on 2026-11-23, with one
        CTA per tile and no dynamic schedule.
        """
        num_m_blocks = cute.ceil_div(seqlen_q, self.cfg.tile_m)
        hb = tile // num_m_blocks
        m_block = tile - hb * num_m_blocks
        batch = hb // num_heads
        head = hb - batch * num_heads
        if const_expr(self.cfg.tile_order == "head"):
            m_block = num_m_blocks - 1 - m_block
        if const_expr(self.cfg.tile_order == "l2"):
            kv_tokens_in_l2 = L2_BYTES // (2 * self.cfg.head_dim * self.cfg.dtype.width // 8)
            group = cutlass.max(Int32(kv_tokens_in_l2) // cutlass.max(seqlen_k, 1), 1)
            group = Int32(1) << (Int32(31) - Int32(cute.arch.clz(group)))
            num_hb = num_heads * num_batch
            group_idx = tile // (group * num_m_blocks)
            in_group = tile - group_idx * (group * num_m_blocks)
            group_size = cutlass.min(group, num_hb - group_idx * group)
            m_rev = in_group // group_size
            hb = group_idx * group + (in_group - m_rev * group_size)
            m_block = num_m_blocks - 1 - m_rev
            batch = hb // num_heads
            head = hb - batch * num_heads
        return m_block, head, batch

    @cute.jit
    def unit_of_round(self, round_idx: Int32, walk_plan) -> Int32:
        """This CTA's unit of work in round `round_idx` of a persistent walk (one CTA per tile:
        round 0 only); units are tiles, then the tail split's pieces (unit_work). A round is the
        next grid-size units, so the tiles that run together (and share K/V in L2) stay those of
        the tile order; only which CTA takes which changes. A plain stride would hand a CTA the
        same m_block every round whenever the grid is a multiple of the m_blocks per head, so
        one CTA would get every short tile: with the per-head causal order odd rounds run
        backwards (a snake: a CTA that got one of a round's first, longest tiles gets one of the
        next round's last, shortest; measured d64 causal 2k 245 vs 384 TFLOP/s against the plain
        stride), and otherwise each round turns by one CTA, so the heads' partial last tiles
        (which cost only their warp groups with rows, pass_blocks) spread over all CTAs
        (measured, 2026-11-23: non-causal d64 +4.6 / +4.9 / +1.3% at 512 / 1k / 2k keys, where
        192-row tiles leave every third, sixth or eleventh tile partial; d128 / d256 equal).
        With planned_tail, rounds from the plan's first on come from `walk_plan` (plan_walk).
        """
        cta, grid = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        lane = cta
        if const_expr(self.cfg.tile_order == "head"):
            if round_idx % 2 == 1:
                lane = grid - 1 - cta
        else:
            lane = (cta + round_idx) % grid
        unit = round_idx * grid + lane
        if const_expr(self.cfg.planned_tail):
            if round_idx >= walk_plan.first:
                unit = walk_plan.units[(round_idx - walk_plan.first) * grid + cta]
        return unit

    @cute.jit
    def fetch_unit(self, sched, num_units: Int32) -> Int32:
        """The dynamic schedule's next unit for this CTA (producer warp): the first grid-size units
        are the CTAs' first; the counter hands out the rest in order. Every CTA fetches once per
        unit it runs, the last time past the end, so num_units fetches in all: the one that gets
        the last value resets the counter for the next launch."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(sched.counter.llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
            if taken == num_units - 1:
                cute.make_tensor(sched.counter, cute.make_layout(1))[0] = 0
        taken = cute.arch.shuffle_sync(taken, 0)
        return taken + cute.arch.grid_dim()[0]

    def sched_units(self, sched):
        """The schedule's shared-memory slots, viewed where they are used (each role's own view)."""
        return cute.make_tensor(sched.units, cute.make_layout(SCHEDULE_STAGES))

    @cute.jit
    def publish_unit(self, sched, state, unit):
        """Producer warp: hand `unit` to the consumers (one slot of the sched pipeline)."""
        acquire_empty(sched.pipe, state, self.cfg.spin_waits)
        units = self.sched_units(sched)
        if cute.arch.lane_idx() == 0:
            units[state.index] = unit
        # Every lane arrives: lane 0's store comes before its arrive, and the slot fills with the last.
        sched.pipe.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def receive_unit(self, sched, state):
        """Consumers: the next unit the producer published."""
        wait_full(sched.pipe, state, self.cfg.spin_waits)
        unit = self.sched_units(sched)[state.index]
        sched.pipe.consumer_release(state)
        state.advance()
        return unit, state

    @staticmethod
    def packed_walk(mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, sOrder=None):
        """A packed batch's bounds as unit_work reads them (config.varlen), None for a dense one;
        sOrder: the kernel's shared-memory ranking of the sequences (order_sequences)."""
        if mCuSeqlensQ is None:
            return None
        return SimpleNamespace(mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, max_seqlen_q=max_seqlen_q,
                               num_batch=mCuSeqlensQ.shape[0] - 1, sOrder=sOrder)

    @cute.jit
    def order_sequences(self, varlen, tidx, num_threads: cutlass.Constexpr):
        """Every thread of the CTA, before the roles split: varlen.sOrder[r] = the sequence of rank
        r by key length, longest first (layouts.key_length_rank). A tile's longest K/V walk is its
        sequence's key blocks, so the walk, which visits the tiles of one sequence after another,
        starts the longest ones first and ends on short ones (the longest-processing-time rule
        across sequences; within a sequence the tile order's). O(batch^2) loads per CTA, hence the
        cap (layouts.LONGEST_FIRST_MAX_SEQUENCES)."""
        if varlen.num_batch <= LONGEST_FIRST_MAX_SEQUENCES:
            for b in cutlass.range(tidx, varlen.num_batch, num_threads, unroll=1):
                varlen.sOrder[key_length_rank(varlen.mCuSeqlensK, b, varlen.num_batch)] = b

    @staticmethod
    def walk_extent(seqlen_q, num_batch, varlen):
        """The (seqlen_q, batch) the walk counts its tiles over: the kernel's, or a packed batch's
        longest sequence and number of sequences."""
        if varlen is None:
            return seqlen_q, num_batch
        return varlen.max_seqlen_q, varlen.num_batch

    def num_tiles(self, seqlen_q, num_heads, num_batch):
        return cute.ceil_div(seqlen_q, self.cfg.tile_m) * num_heads * num_batch

    def num_units(self, seqlen_q, num_heads, num_batch, split):
        """Tiles, or for a tail-splitting kernel the host's count of whole tiles and pieces."""
        if const_expr(self.cfg.splits_tail):
            return split.whole_tiles + split.units
        return self.num_tiles(seqlen_q, num_heads, num_batch)

    def tail_plan_words(self, split):
        """The tail plan after the counters, viewed where it is read (TailPlan.words)."""
        return cute.domain_offset((TailPlan.plan_offset(self.cfg.num_sms),), split.mCount)

    @cute.jit
    def unit_work(self, unit: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_batch: Int32,
                  block_ranges: BlockRanges, split, window=None, varlen=None):
        """What unit `unit` of the walk computes: (m_block, head, batch), the K/V blocks
        [n_block_min, n_block_max), its workspace `slot`, -1 for a whole tile, and `seq`, its
        sequence's seqlen_q, seqlen_k and first packed rows offset_q, offset_k. After the
        split.whole_tiles whole tiles come split.units pieces of the tiles after them, piece i in
        slot i, its tile and blocks in row i of the tail plan (TailPlan). With a sliding window
        ((left, right), config.window), the blocks some row of the tile sees; the producer and the
        consumers both take the range from here, so they agree on every block.

        A dense batch's sequences are the kernel's (offsets None). A packed one (`varlen`: its
        cu_seqlens, config.varlen) walks every sequence's tiles at the count of the longest
        (seqlen_q is max_seqlen_q here), the sequences longest first (order_sequences); a tile
        past its own sequence's end gets no blocks, and its rows, all past seqlen_q, are never
        stored."""
        tile = unit
        slot = Int32(-1)
        plan = self.tail_plan_words(split) if const_expr(self.cfg.splits_tail) else None
        if const_expr(self.cfg.splits_tail):
            if unit >= split.whole_tiles:
                slot = unit - split.whole_tiles
                tile = plan[slot * TailPlan.UNIT_WORDS]
        m_block, head, batch = self.tile_coord(tile, seqlen_q, seqlen_k, num_heads, num_batch)
        seq = SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, offset_q=None, offset_k=None)
        if const_expr(varlen is not None):
            if varlen.num_batch <= LONGEST_FIRST_MAX_SEQUENCES:
                batch = varlen.sOrder[batch]  # the walk's batch-th sequence, longest first
            offset_q, seqlen_q = sequence_bounds(varlen.mCuSeqlensQ, batch)
            offset_k, seqlen_k = sequence_bounds(varlen.mCuSeqlensK, batch)
            seq = SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, offset_q=offset_q, offset_k=offset_k)
        if const_expr(window is not None):
            n_block_min, n_block_max = block_ranges.n_block_min_max_window(m_block, seqlen_q, seqlen_k, *window)
            # A tile whose rows see no key still runs one block, fully masked (out = 0, lse = -inf),
            # so that its O leaves the usual way: an empty tile would write O through a Q buffer
            # that the producer, having nothing to load for it, already refills for the next tile.
            n_block_max = cutlass.max(n_block_max, 1)
            n_block_min = cutlass.min(n_block_min, n_block_max - 1)
        else:
            n_block_min, n_block_max = block_ranges.n_block_min_max(m_block, seqlen_q, seqlen_k)
        if const_expr(self.cfg.splits_tail):
            if slot >= 0:
                n_block_min, n_block_max = plan[slot * TailPlan.UNIT_WORDS + 1], plan[slot * TailPlan.UNIT_WORDS + 2]
        if const_expr(varlen is not None):
            if m_block * self.cfg.tile_m >= seqlen_q:
                n_block_max = n_block_min
        return m_block, head, batch, n_block_min, n_block_max, slot, seq

