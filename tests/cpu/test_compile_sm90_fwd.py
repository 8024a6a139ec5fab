"""The Hopper forward compiles for sm_90a on a CPU-only machine, into the code we intend.

Each variant must use TMA loads (cp.async.bulk.tensor), wgmma, register reallocation between the
producer and consumer warp groups (setmaxnreg), must not spill, and ptxas must not serialize the
wgmma instructions nor wait for them where we did not (advisories C7512: registers ran out while a
wgmma was in flight, which cost the causal kernel a third to a half of its speed; C7515: something
other than a wgmma defines an accumulator a wgmma may still write; C7517: a wait injected before a
use of such registers; C7511: "insufficient register resources for the wgmma pipeline", which a
first S GEMM of half the width into part of the S accumulator brought, at -10 to -32% .
Every C751x advisory fails the test).
"""

import heapq
import itertools
import re
from collections import Counter

import pytest

import cutlass

from cute_flash import compile_report as compile_report_module
from cute_flash.compile_report import compile_report
from cute_flash import dispatch
from cute_flash.dispatch import fake_forward_args
from cute_flash.kernels.sm90 import tile_scheduler
from cute_flash.kernels.sm90.config import Sm90FwdConfig, can_implement, forward_config
from cute_flash.kernels.sm90.fwd import FlashAttnFwdSm90
from cute_flash.kernels.sm90.tile_scheduler import TailPlan

VARIANTS = [
    (cutlass.BFloat16, 64, False, None),
    (cutlass.BFloat16, 128, False, None),
    (cutlass.BFloat16, 128, True, None),
    (cutlass.Float16, 128, True, None),
    (cutlass.BFloat16, 256, True, None),
    (cutlass.Float16, 64, True, None),
    # Tiles that only fit since P's conversion is pinned (kernels/sm90/fwd.py: convert_P).
    (cutlass.BFloat16, 64, True, dict(tile_m=192, tile_n=128, num_stages=2)),
    (cutlass.BFloat16, 128, True, dict(tile_m=128, tile_n=176, num_stages=2)),
    # The short-sequence causal d64 kernel (length_config), and O rescaled early at d192.
    (cutlass.BFloat16, 64, True, dict(tile_m=128, tile_n=128, num_stages=2, tile_order="head", prefetch_next=True,
                                      wg_epilogue=True, q_stages=2, planned_tail=True, cache_hints=True)),
    (cutlass.Float16, 192, False, None),
    # Short non-causal (length_config): two Q stages, each warp group storing its own rows of O
    # by TMA; d128 with the DSL's sleeping pipeline waits and, up to 1024 keys, the global tile
    # counter.
    (cutlass.BFloat16, 64, False, dict(tile_m=192, tile_n=128, num_stages=2, prefetch_next=True,
                                       wg_epilogue=True, wg_tma_store=True, q_stages=2)),
    (cutlass.Float16, 128, False, dict(tile_m=128, tile_n=128, num_stages=2, wg_epilogue=True, wg_tma_store=True,
                                       q_stages=2, q_by_group=True, spin_waits=False,
                                       dynamic_schedule=True)),
    # Short and mid causal d128 (two Q stages, per-warp-group O stores), mid causal d64 (192 rows).
    # Short causal walks take their last rounds from the host's plan (planned_tail) and put L2
    # eviction priorities on their TMA copies (cache_hints, as short non-causal d256 does).
    (cutlass.BFloat16, 128, True, dict(tile_m=128, tile_n=128, num_stages=2, tile_order="head", wg_epilogue=True,
                                       wg_tma_store=True, q_stages=2, recompute_epilogue=True, planned_tail=True,
                                       cache_hints=True)),
    (cutlass.BFloat16, 64, True, dict(tile_m=192, tile_n=128, num_stages=2, tile_order="head", prefetch_next=True,
                                      wg_epilogue=True)),
    # Short d256 loads Q by warp group into its one Q buffer and stores O from registers
    # (o_from_registers), releasing Q after the mainloop (causal) or its last S GEMM; causal up to
    # 1024 keys on 64-column blocks, up to 2048 on 80.
    (cutlass.BFloat16, 256, True, dict(tile_m=128, tile_n=64, num_stages=2, tile_order="head", wg_epilogue=True,
                                       q_by_group=True, o_from_registers=True, release_q_early=False,
                                       planned_tail=True, cache_hints=True)),
    (cutlass.Float16, 256, True, dict(tile_m=128, tile_n=80, num_stages=2, tile_order="head", wg_epilogue=True,
                                      q_by_group=True, o_from_registers=True, release_q_early=False,
                                      cache_hints=True)),
    # Short non-causal d256 and short causal d128 derive the epilogue's coordinates per tile;
    # short_2k non-causal d256 walks its tiles statically.
    (cutlass.BFloat16, 256, False, dict(tile_m=128, tile_n=80, num_stages=2, wg_epilogue=True,
                                        recompute_epilogue=True, q_by_group=True, o_from_registers=True)),
    (cutlass.Float16, 256, False, dict(tile_m=128, tile_n=80, num_stages=2, wg_epilogue=True,
                                       recompute_epilogue=True, q_by_group=True, o_from_registers=True,
                                       dynamic_schedule=True, cache_hints=True)),
    # 64-column blocks: short d192 (causal and not), and non-causal d256 up to 512 keys (short_512).
    (cutlass.BFloat16, 192, False, dict(tile_m=128, tile_n=64, num_stages=2, dynamic_schedule=True)),
    (cutlass.Float16, 192, True, dict(tile_m=128, tile_n=64, num_stages=2, tile_order="head", planned_tail=True,
                                      cache_hints=True)),
    (cutlass.BFloat16, 256, False, dict(tile_m=128, tile_n=64, num_stages=2, wg_epilogue=True,
                                        recompute_epilogue=True, q_by_group=True, o_from_registers=True,
                                        dynamic_schedule=True, cache_hints=True)),
    # Long non-causal d128 (length_config): three consumer warp groups of 64 x 80; tiles taken from
    # a global counter (dynamic_schedule), as for long causal d64/d128/d256 and mid causal.
    # Long and mid problems rescale lazily (lazy_rescale), but for non-causal d64; causal d128 from
    # mid on runs the non-causal kernel's tiles.
    (cutlass.BFloat16, 128, False, dict(tile_m=192, tile_n=80, num_stages=3,
                                        dynamic_schedule=True, lazy_rescale=True)),
    (cutlass.Float16, 128, False, dict(tile_m=192, tile_n=80, num_stages=3,
                                       dynamic_schedule=True, lazy_rescale=True)),
    (cutlass.BFloat16, 128, True, dict(tile_m=192, tile_n=80, num_stages=3, tile_order="l2", dynamic_schedule=True,
                                       lazy_rescale=True)),
    (cutlass.Float16, 128, True, dict(tile_m=192, tile_n=80, num_stages=3, tile_order="l2", dynamic_schedule=True,
                                      lazy_rescale=True)),
    (cutlass.BFloat16, 64, True, dict(tile_m=192, tile_n=128, num_stages=2, tile_order="l2", dynamic_schedule=True,
                                      lazy_rescale=True)),
    (cutlass.Float16, 256, True, dict(tile_m=128, tile_n=80, num_stages=2, tile_order="l2", dynamic_schedule=True,
                                      wg_epilogue=True, q_by_group=True, lazy_rescale=True)),
    (cutlass.BFloat16, 256, False, dict(tile_m=128, tile_n=80, num_stages=2, dynamic_schedule=True,
                                        lazy_rescale=True, wg_epilogue=True, q_by_group=True)),
    (cutlass.Float16, 256, False, dict(tile_m=128, tile_n=80, num_stages=2, dynamic_schedule=True,
                                       lazy_rescale=True)),
    (cutlass.Float16, 192, True, dict(tile_m=128, tile_n=112, num_stages=2, tile_order="l2", dynamic_schedule=True,
                                      lazy_rescale=True)),
    # d96 from 1025 keys on: three consumer warp groups of 64 x 96 (long causal: per-tile epilogue
    # coordinates; causal up to 2048 keys: the short settings' static walk).
    (cutlass.Float16, 96, True, dict(tile_m=192, tile_n=96, num_stages=2, tile_order="l2", dynamic_schedule=True,
                                     recompute_epilogue=True, lazy_rescale=True)),
    (cutlass.BFloat16, 96, False, dict(tile_m=192, tile_n=96, num_stages=2, dynamic_schedule=True,
                                       lazy_rescale=True)),
    (cutlass.BFloat16, 96, True, dict(tile_m=192, tile_n=96, num_stages=2, tile_order="head", planned_tail=True)),
    # Long non-causal d64 keeps the DSL's sleeping pipeline waits (spin_waits=False); Q by warp
    # group in three pieces (bf16).
    (cutlass.BFloat16, 64, False, dict(tile_m=192, tile_n=128, num_stages=2, dynamic_schedule=True,
                                       spin_waits=False, recompute_epilogue=True, q_by_group=True)),
    (cutlass.Float16, 64, False, dict(tile_m=192, tile_n=128, num_stages=2, dynamic_schedule=True,
                                      spin_waits=False, recompute_epilogue=True)),
]


@pytest.mark.parametrize(
    "dtype,head_dim,causal,tiles", VARIANTS,
    ids=[f"{dt.__name__}-d{d}-{'causal' if c else 'full'}" + (f"-{t['tile_m']}x{t['tile_n']}" if t else "")
         + ("-dynamic" if t and t.get("dynamic_schedule") else "")
         + ("-planned" if t and t.get("planned_tail") else "")
         + ("-wgtma" if t and t.get("wg_tma_store") else "")
         + ("-lazy" if t and t.get("lazy_rescale") else "")
         + ("-hints" if t and t.get("cache_hints") else "")
         for dt, d, c, t in VARIANTS],
)
def test_sm90_fwd_compiles_to_tma_wgmma_without_spills(dtype, head_dim, causal, tiles, monkeypatch):
    # None: the dispatched long kernel. Persistent, as on an H100.
    config = (forward_config(dtype, head_dim, causal, "long", 132) if tiles is None
              else Sm90FwdConfig.create(dtype, head_dim, causal, num_sms=132, **tiles))
    kernel = FlashAttnFwdSm90(config)
    # CompileReport has no field for ptxas advisories: keep the log it parses.
    logs = []
    parse = compile_report_module._parse
    monkeypatch.setattr(compile_report_module, "_parse", lambda log: (logs.append(log), parse(log))[1])
    report = compile_report(kernel, fake_forward_args(dtype, head_dim, True), arch="sm_90a")
    assert "wgmma.mma_async" in report.ptx
    assert "cp.async.bulk.tensor" in report.ptx
    assert "setmaxnreg" in report.ptx
    assert ("cp.async.bulk.prefetch.tensor" in report.ptx) == config.prefetch_next
    # Pipeline waits: plain try_wait loops (spin_wait), or the DSL's wait with a suspend-time hint.
    assert ("wait_again" in report.ptx) == config.spin_waits
    # The dynamic schedule's counter: a relaxed atomic add (the tail split's are acq_rel).
    assert ("atom.global.add.u32" in report.ptx) == config.dynamic_schedule
    # The epilogue's coordinates derived per tile from opaque copies of the tile and thread index.
    assert ("opaque_i32" in report.ptx) == config.recompute_epilogue
    # Q's load announces its bytes: a whole tile's, or one warp group's 64 rows (q_by_group).
    # The DSL's size_in_bytes would count the cosize of a piece's strided rows.
    q_rows = 64 if config.q_by_group else config.tile_m
    assert q_rows * head_dim * dtype.width // 8 in expect_tx_bytes(report.ptx)
    # O goes out from smem (stmatrix, then a TMA store per tile or per warp group, or 16-byte
    # stores per warp group), or straight from registers in 16-byte stores (o_from_registers: no
    # stmatrix at all).
    from_registers = config.o_from_registers
    assert ("stmatrix" in report.ptx) == (not from_registers)
    by_tma = not from_registers and (not config.wg_epilogue or config.wg_tma_store)
    assert config.wg_tma_store == (by_tma and config.wg_epilogue)
    assert ("cp.async.bulk.tensor.4d.global.shared" in report.ptx) == by_tma
    assert ("st.global.v4.b32" in report.ptx) == (not by_tma)
    # Lazy rescaling: the rare rescale behind a warp vote (softmax.py: rescale_if_grown).
    assert ("vote.sync.any.pred" in report.ptx) == config.lazy_rescale
    # L2 eviction priorities on the TMA copies (cache_hints): the DSL passes every TMA copy a
    # policy operand, 0 unless given one; ours are evict-first (Q, O) and evict-last (K, V).
    policies = {int(v) for v in re.findall(r"mov\.b64\s+%rd\d+,\s*(\d+);", report.ptx)}
    hints = {0x12F0000000000000, 0x14F0000000000000}
    assert hints & policies == (hints if config.cache_hints else set())
    # Programmatic dependent launch: the grid waits for the one before it ahead of any memory access.
    assert "griddepcontrol.wait" in report.ptx
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"
    assert logs, "no ptxas log"
    advisories = re.findall(r"\((C751\d)\)", logs[0])
    assert not advisories, f"ptxas serialized or waited for wgmma instructions: {advisories}"


def expect_tx_bytes(ptx: str) -> set[int]:
    """The byte counts that mbarrier.arrive.expect_tx announces (immediates moved into its operand)."""
    immediates = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    operands = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+[^,]+,\s*\[[^\]]+\],\s*(%r\d+|\d+);", ptx)
    return {int(immediates.get(op, op)) for op in operands if op.isdigit() or op in immediates}


def test_can_implement_rejects_what_this_path_does_not_serve():
    assert forward_config(cutlass.Float32, 128, False, "long", 132) is None
    assert forward_config(cutlass.BFloat16, 40, False, "long", 132) is None
    assert not can_implement(Sm90FwdConfig(cutlass.BFloat16, 512, False))
    # Too many stages for shared memory.
    assert not can_implement(Sm90FwdConfig(cutlass.BFloat16, 256, False, tile_m=128, tile_n=128, num_stages=4))
    # Per-warp-group O stores need rows of O that 128 threads cover in 16-byte pieces.
    assert not can_implement(Sm90FwdConfig(cutlass.BFloat16, 96, False, wg_epilogue=True))
    with pytest.raises(AssertionError):
        Sm90FwdConfig.create(cutlass.BFloat16, 96, False, wg_epilogue=True)
    for head_dim in (64, 96, 128, 192, 256):
        for causal, dtype in itertools.product((False, True), (cutlass.BFloat16, cutlass.Float16)):
            for length in dispatch.length_classes(causal):
                config = forward_config(dtype, head_dim, causal, length, 132)
                assert can_implement(config)
                # Resolved: creating it again from its own fields changes nothing.
                fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
                assert Sm90FwdConfig.create(**fields) == config


def test_tail_split_plan():
    plan = tile_scheduler.tail_split_plan
    assert plan(1320, 100, 132) == (0, 1)  # ten full rounds: nothing to split
    assert plan(1376, 100, 132) == (56, 2)  # 56 tiles left for 132 SMs: two pieces each
    assert plan(1408, 100, 132) == (0, 1)  # 88 left: two pieces each would take two rounds
    assert plan(10, 100, 132) == (10, 4)  # fewer tiles than SMs: at most four pieces
    assert plan(10, 5, 132) == (10, 2)  # pieces keep at least two K/V blocks
    assert plan(10, 3, 132) == (0, 1)
    # A head's last tile costs only its warp groups with rows: 4096 rows of 192 leave 64 (a third).
    work = tile_scheduler.tail_work
    assert work(4096, 192, 64) == work(8192, 192, 32) == 1366 and work(4096, 128, 64) == 2048
    assert work(256, 192, 45) == 60
    assert plan(1408, 52, 132, 1366) == (46, 2)  # 88 tiles left, but only 46 of work
    assert plan(90, 32, 132, 60) == (60, 2)
    assert plan(1376, 103, 132, 1366) == (56, 2)  # the tiles' own plan comes first
    assert plan(2048, 32, 132, 2048) == (0, 1)
    for tiles in range(1, 600):
        split_tiles, splits = plan(tiles, 64, 132)
        assert split_tiles * splits <= 132 and split_tiles <= tiles
        assert (split_tiles, splits) == (0, 1) or (split_tiles == tiles % 132 and 2 <= splits <= 4)


def _greedy_end(plan, whole_tiles: int, num_n_blocks: int, num_sms: int) -> int:
    """When the last SM ends, in K/V blocks, if each unit goes to the first SM free (the dynamic
    schedule) and costs its blocks."""
    free = [0] * num_sms
    for cost in [num_n_blocks] * whole_tiles + [hi - lo for _, lo, hi in plan.units]:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


@pytest.mark.parametrize("num_tiles,num_n_blocks", [(1024, 205), (512, 206), (256, 130), (208, 150), (224, 175),
                                                    (96, 176), (80, 200), (1280, 147), (200, 128)])
def test_stream_k_tail(num_tiles, num_n_blocks):
    """TailPlan.stream_k covers every block of its tiles once, cuts no tile in more than
    tile_scheduler.MAX_SPLITS pieces nor any piece under tile_scheduler.MIN_PIECE_BLOCKS (but a tile's own length), and on
    the dynamic schedule ends within a piece's rounding of the ideal (all blocks over all SMs),
    where whole tiles end a tile later. Its words give each piece its tile in the walk, its blocks
    and the slots of all its tile's pieces."""
    plan = tile_scheduler.tail_plan(num_tiles, num_n_blocks, 132, num_tiles, dynamic_schedule=True)
    assert plan.tiles == min(num_tiles, num_tiles % 132 + 132)
    covered = Counter((tile, n) for tile, lo, hi in plan.units for n in range(lo, hi))
    assert set(covered.values()) == {1} and len(covered) == plan.tiles * num_n_blocks
    pieces = Counter(tile for tile, _, _ in plan.units)
    assert max(pieces.values()) <= tile_scheduler.MAX_SPLITS
    assert min(hi - lo for _, lo, hi in plan.units) >= tile_scheduler.MIN_PIECE_BLOCKS
    words = plan.words(num_tiles)
    assert len(words) == TailPlan.UNIT_WORDS * len(plan.units)
    for slot, (tile, lo, hi) in enumerate(plan.units):
        row = words[slot * TailPlan.UNIT_WORDS:(slot + 1) * TailPlan.UNIT_WORDS]
        assert row[:4] == [num_tiles - plan.tiles + tile, lo, hi, pieces[tile]]
        assert slot in row[4:] and {plan.units[s][0] for s in row[4:]} == {tile}
        assert len(set(row[4:])) == pieces[tile] and row[4 + pieces[tile]:] == row[3 + pieces[tile]:-1]
    end = _greedy_end(plan, plan.whole_tiles(num_tiles), num_n_blocks, 132)
    ideal = num_tiles * num_n_blocks / 132
    assert ideal <= end <= ideal + 2 * tile_scheduler.MIN_PIECE_BLOCKS
    assert end < -(-num_tiles // 132) * num_n_blocks


def test_tail_plan_choice():
    """Equal pieces in the last round where tail_split_plan finds them; stream-K shares only on the
    dynamic schedule, for tiles of equal cost and long enough keys; nothing for full rounds."""
    plan = tile_scheduler.tail_plan
    even = plan(1376, 100, 132, 1376, dynamic_schedule=True)
    assert (even.tiles, len(even.units)) == (56, 112)
    assert even.units[:3] == [(0, 0, 50), (0, 50, 100), (1, 0, 50)]
    assert even.words(1376)[:10] == [1320, 0, 50, 2, 0, 1, 1, 1, 1320, 50]
    assert plan(1024, 205, 132, 1024, dynamic_schedule=True).tiles == 232
    assert plan(1024, 205, 132, 1024, dynamic_schedule=False) is None  # a static walk keeps its order
    assert plan(1024, 205, 132, 1020, dynamic_schedule=True) is None  # heads' last tiles cost less
    assert plan(1024, 127, 132, 1024, dynamic_schedule=True) is None  # pieces too short
    assert plan(1056, 205, 132, 1056, dynamic_schedule=True) is None  # eight full rounds


@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_batch,tile_m,tile_n,planned", [
    (512, 512, 512, 128, 128, True),     # causal d128 at 512 keys, 16k tokens: 2048 tiles
    (1024, 1024, 512, 128, 128, True),   # causal d64 at 1k keys
    (2048, 2048, 64, 128, 80, True),     # causal d256 at 2k keys
    (1000, 1000, 48, 128, 128, True),    # the GPU test's short shape (tests/gpu/test_forward.py)
    (1800, 2000, 32, 192, 96, True),     # and its short_2k one for d96 (192-row tiles)
    (512, 512, 64, 128, 64, False),      # causal d256 at 512 keys: no plan ends before the snake
    (113, 203, 5, 128, 128, False),      # fewer tiles than SMs
])
def test_walk_plan(seqlen_q, seqlen_k, heads_batch, tile_m, tile_n, planned):
    """The planned tail (plan_walk) and the snake before it run every tile once, each CTA's planned
    units come first in its column, and the modeled work of the busiest CTA drops."""
    from cute_flash.kernels.common.blocks import BlockRanges
    plan = tile_scheduler.plan_walk(seqlen_q, seqlen_k, heads_batch, tile_m, tile_n, 132)
    assert (plan != [tile_scheduler.NO_UNIT]) == planned
    m_blocks = -(-seqlen_q // tile_m)
    num_tiles = m_blocks * heads_batch
    grid = min(num_tiles, 132)
    first = plan[0] if planned else -(-num_tiles // grid)  # unplanned: the snake to the end
    units = plan[1:]
    assert len(units) % grid == 0 and set(units[-grid:]) <= {tile_scheduler.NO_UNIT}
    assert first * grid <= num_tiles or not planned
    ranges = BlockRanges(tile_m, tile_n, True)

    def cost(unit):
        return tile_scheduler.TILE_COST_BLOCKS + ranges.n_block_end((m_blocks - unit % m_blocks) * tile_m, seqlen_q, seqlen_k)

    walked, snake_end, planned_end = [], [0.0] * grid, [0.0] * grid
    for unit in range(num_tiles):
        round_idx, lane = divmod(unit, grid)
        cta = grid - 1 - lane if round_idx % 2 else lane
        snake_end[cta] += cost(unit)
        if round_idx < first:
            walked.append(unit)
            planned_end[cta] += cost(unit)
    for cta in range(grid):
        column = units[cta::grid]
        ran = column[:column.index(tile_scheduler.NO_UNIT)] if planned else []
        assert set(column[len(ran):]) <= {tile_scheduler.NO_UNIT}
        walked += ran
        planned_end[cta] += sum(cost(unit) for unit in ran)
    assert sorted(walked) == list(range(num_tiles))
    if planned:
        assert max(planned_end) < max(snake_end)
