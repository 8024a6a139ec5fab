"""The decode kernel and its split merge compile (no GPU needed) for sm_80 and sm_90a, to the
instructions they are built from, without spills; dispatch plans them for every page size rule."""

import pytest
import torch

import cutlass

from cute_flash import dispatch
from cute_flash.compile_report import compile_report
from cute_flash.kernels.sm80.decode import FlashDecodeSm80
from cute_flash.kernels.sm80.decode_combine import SPLIT_UNROLL
from cute_flash.validate import MAX_SPLITS

# (arch, dtype, head_dim, causal, page_size): contiguous and paged (a page below, at and above the
# 64-key tile, one not a power of two), padded head dim 96, the largest head dim.
VARIANTS = [
    ("sm_80", torch.bfloat16, 128, True, 0),
    ("sm_80", torch.float16, 64, False, 48),
    ("sm_90a", torch.bfloat16, 128, False, 16),
    ("sm_90a", torch.bfloat16, 96, True, 256),
    ("sm_90a", torch.float16, 256, True, 0),
]


def _compile(plan, arch):
    kernel, args = plan.build()
    return compile_report(kernel, args, arch=arch)


@pytest.mark.parametrize("arch,dtype,head_dim,causal,page_size", VARIANTS,
                         ids=[f"{a}-{str(d)[6:]}-d{h}-{'causal' if c else 'full'}-page{p}" for a, d, h, c, p in VARIANTS])
def test_decode_compiles_without_spills(monkeypatch, arch, dtype, head_dim, causal, page_size):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    plan = dispatch.plan_decode(capability, dtype, head_dim, causal, page_size)
    report = _compile(plan.main, arch)
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in report.ptx  # V read transposed
    assert "cp.async.cg.shared.global" in report.ptx  # 16-byte K/V row gathers
    assert "ex2.approx" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    assert report.registers <= 255


# (arch, dtype, head_dim, causal, page_size, (window, softcap, alibi), cache_leftpad): each
# modification alone and all three, contiguous and paged, the largest head dim, left padding.
MOD_VARIANTS = [
    ("sm_80", torch.bfloat16, 128, False, 0, (True, False, False), False),
    ("sm_90a", torch.float16, 64, True, 16, (False, True, False), True),
    ("sm_90a", torch.bfloat16, 128, False, 0, (False, False, True), False),
    ("sm_80", torch.bfloat16, 128, False, 256, (True, True, True), False),
    ("sm_90a", torch.bfloat16, 256, True, 0, (False, True, True), True),
    ("sm_90a", torch.bfloat16, 128, True, 0, (False, False, False), True),
]


@pytest.mark.parametrize("arch,dtype,head_dim,causal,page_size,mods,leftpad", MOD_VARIANTS, ids=str)
def test_decode_with_score_modifications_compiles_without_spills(monkeypatch, arch, dtype, head_dim, causal,
                                                                 page_size, mods, leftpad):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    plan = dispatch.plan_decode((9, 0) if arch == "sm_90a" else (8, 0), dtype, head_dim, causal, page_size, mods,
                                leftpad)
    config = plan.main.config
    assert (config.window, config.softcap, config.alibi, config.leftpad) == (*mods, leftpad)
    assert plan.main.entry == ("call_with_mods" if any(mods) else None)
    report = _compile(plan.main, arch)
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    if mods[1]:
        assert "rcp.approx" in report.ptx  # tanh from ex2 and rcp
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


@pytest.mark.parametrize("arch,head_dim,page_size", [("sm_80", 128, 0), ("sm_90a", 256, 16), ("sm_90a", 64, 48)])
def test_deep_decode_compiles_without_spills(monkeypatch, arch, head_dim, page_size):
    """The deep CTA (dispatch.DECODE_DEEP_STAGES K/V buffers) fits the shared memory of sm_80 and
    sm_90 at every head dim, and runs the same loop."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    plan = dispatch.plan_decode(capability, torch.bfloat16, head_dim, True, page_size, deep=True)
    assert plan.main.config.num_stages == dispatch.DECODE_DEEP_STAGES
    report = _compile(plan.main, arch)
    assert "cp.async.cg.shared.global" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    # sm_86 / sm_89 (99 KB per CTA) keep two stages
    assert dispatch.plan_decode((8, 6), torch.bfloat16, head_dim, True, page_size, deep=True).main.config.num_stages == 2


@pytest.mark.parametrize("arch,head_dim,page_size,mods", [("sm_80", 128, 0, (False, False, False)),
                                                         ("sm_90a", 64, 16, (True, True, True)),
                                                         ("sm_90a", 256, 0, (False, False, False))])
def test_narrow_decode_compiles_without_spills(monkeypatch, arch, head_dim, page_size, mods):
    """dispatch.DECODE_NARROW_TILE (32 packed rows, 2 warps) runs the same loop spill-free."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    plan = dispatch.plan_decode(capability, torch.bfloat16, head_dim, False, page_size, mods, narrow=True)
    assert (plan.tile_m, plan.main.config.num_warps) == (32, 2)
    report = _compile(plan.main, arch)
    assert "mma.sync.aligned.m16n8k16" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


@pytest.mark.parametrize("arch,head_dim,page_size,mods,causal,deep", [
    ("sm_80", 128, 0, (False, False, False), False, False), ("sm_90a", 128, 256, (False, False, False), True, False),
    ("sm_90a", 64, 16, (True, True, True), True, False), ("sm_90a", 128, 0, (False, False, False), False, True),
    ("sm_80", 64, 0, (False, False, False), True, True)])
def test_warps_along_keys_compile_without_spills(monkeypatch, arch, head_dim, page_size, mods, causal, deep):
    """dispatch.DECODE_KEYS_TILE: 16 rows, each warp its 16-key slice of a block (a quarter of the
    64-row tile's mma.sync), the warps' states merged through shared memory (two more barriers);
    `deep`: on the deep CTA's stages, as a one-tile call takes it."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    plan = dispatch.plan_decode(capability, torch.bfloat16, head_dim, causal, page_size, mods, deep=deep,
                                warps_along_keys=True)
    assert plan.main.config.warps_along_keys and plan.tile_m == 16
    three = capability in dispatch.DECODE_KEYS_TILE_THREE_CAPABILITIES  # an A100's 164 KB per SM holds two
    resident = dispatch.DECODE_KEYS_TILE_CTAS_PER_SM if three else dispatch.DECODE_CTAS_PER_SM
    assert plan.ctas_per_sm == (1 if deep else resident)
    wide = _compile(dispatch.plan_decode(capability, torch.bfloat16, head_dim, causal, page_size, mods,
                                         deep=deep).main, arch)
    report = _compile(plan.main, arch)
    assert report.ptx.count("mma.sync.aligned.m16n8k16") * 4 == wide.ptx.count("mma.sync.aligned.m16n8k16")
    assert report.ptx.count("bar.sync") == 4  # two per key block, two for the merge
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    if not deep and three:  # DECODE_KEYS_TILE_CTAS_PER_SM of them fit an SM: registers and shared memory
        cfg, ctas = plan.main.config, dispatch.DECODE_KEYS_TILE_CTAS_PER_SM
        assert ctas * cfg.num_warps * 32 * (-(-report.registers // 8) * 8) <= 64 * 1024, report.registers
        smem = 2 * (cfg.tile_m + 2 * cfg.num_stages * cfg.tile_n) * head_dim + 4 * cfg.tile_m * cfg.num_warps
        assert ctas * (smem + 1024 + 3 * 1024) <= 228 * 1024  # Q, K and V stages, merge scratch; alignment, reserve
    # head dims whose merge scratch or Q copy do not fit keep the 64-row tile
    assert not FlashDecodeSm80.can_implement(cutlass.BFloat16, 96, False, **dict(
        FlashDecodeSm80.default_tiles(96), **dispatch.DECODE_KEYS_TILE))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("head_dim,page_size,mods,shape", [(128, 0, (False, False, False), "default"),
                                                           (64, 16, (True, True, True), "default"),
                                                           (256, 0, (False, False, False), "default"),
                                                           (96, 48, (False, False, False), "narrow"),
                                                           (128, 256, (False, False, False), "deep")])
def test_fp32_decode_compiles_without_spills(monkeypatch, arch, head_dim, page_size, mods, shape):
    """fp32 caches: split TF32 (three m16n8k8 TF32 products per pair, operands read through the
    MMA's partitions, no ldmatrix), fp32 tiles (FlashDecodeSm80.default_tiles), spill-free."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    plan = dispatch.plan_decode(capability, torch.float32, head_dim, True, page_size, mods,
                                deep=shape == "deep", narrow=shape == "narrow")
    assert plan.main.config.num_stages == (dispatch.DECODE_DEEP_STAGES if shape == "deep" else 2)
    report = _compile(plan.main, arch)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in report.ptx
    assert "ldmatrix" not in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    assert all(_compile(merge, arch).spill_bytes == 0 for merge in plan.combines.values())


def test_fp32_decode_with_plain_tf32_runs_a_third_of_the_products(monkeypatch):
    """tf32_products=1 (torch's fp32 matmul precision "high" / "medium", kvcache's _decode)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
    reports = {n: _compile(dispatch.plan_decode((9, 0), torch.float32, 128, False, tf32_products=n).main, "sm_90a")
               for n in (1, 3)}
    assert reports[1].ptx.count(mma) * 3 == reports[3].ptx.count(mma) > 0
    assert reports[1].spill_bytes == 0


@pytest.mark.parametrize("arch,shape", [("sm_80", dispatch.DECODE_MERGE), ("sm_90a", dispatch.DECODE_MERGE),
                                        ("sm_90a", dispatch.DECODE_WIDE_MERGE), ("sm_80", dispatch.DECODE_ROWS_MERGE),
                                        ("sm_90a", dispatch.DECODE_ROWS_MERGE)])
def test_combine_compiles(monkeypatch, arch, shape):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    plan = dispatch.plan_decode((8, 0) if arch == "sm_80" else (9, 0), torch.bfloat16, 128, False)
    combine = plan.combines[shape]
    warps, rows = shape
    assert (combine.config.num_warps, combine.config.rows_per_cta) == shape
    report = _compile(combine, arch)
    assert f".reqntid {32 * warps}, 1, 1" in report.ptx
    # the row's split statistics loaded at once (one per lane per 32 splits of MAX_SPLITS), and only
    # there: the walk takes the splits' weights from shared memory
    assert report.ptx.count("ld.global.b32") == MAX_SPLITS // 32
    # each lane's 4 columns of a piece in one load, SPLIT_UNROLL pieces per turn of the split walk
    assert report.ptx.count("ld.global.v4.b32") >= SPLIT_UNROLL
    assert report.ptx.count("shfl.sync.bfly") >= 10  # the split statistics' max and sum over the warp
    if rows == 1:
        # the warps' partial sums meet in shared memory; each thread stores one bf16 column of O
        assert "st.shared.v4.b32" in report.ptx and report.ptx.count("bar.sync") == 2
        assert "st.global.b16" in report.ptx
    else:
        # a warp per row: its lanes' 4 columns straight to O (8 bytes each), one barrier (the weights)
        assert "st.shared.v4.b32" not in report.ptx and report.ptx.count("bar.sync") == 1
        assert "st.global.v2.b32" in report.ptx or "st.global.v4.b16" in report.ptx
    assert "ex2.approx" in report.ptx and "lg2.approx" in report.ptx
    assert report.spill_bytes == 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dependent_launch_from_sm90(monkeypatch, arch):
    """On sm_90 the decode kernel and both merges wait for the grid ahead (griddepcontrol.wait, once,
    before any global access); sm_80 has no such instruction and keeps its PTX."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    plan = dispatch.plan_decode((9, 0) if arch == "sm_90a" else (8, 0), torch.bfloat16, 128, True, 0, (True, False, False),
                                deep=True, warps_along_keys=True)
    for part in (plan.main, *plan.combines.values()):
        assert part.config.dependent_launch == (arch == "sm_90a")
        ptx = _compile(part, arch).ptx
        assert ptx.count("griddepcontrol.wait") == (1 if arch == "sm_90a" else 0)
        if arch == "sm_90a":  # the wait comes before the kernel's first global load
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_page_sizes_and_split_heuristic():
    from cute_flash.kernels.sm80.decode import FlashDecodeSm80

    for page in (0, 16, 48, 64, 256, 1024):
        assert FlashDecodeSm80.can_implement(cutlass.BFloat16, 128, True, page, **FlashDecodeSm80.default_tiles(128))
    for page in (8, 24, -16):
        assert not FlashDecodeSm80.can_implement(cutlass.BFloat16, 128, True, page)
    for head_dim in range(8, 257, 8):
        assert FlashDecodeSm80.can_implement(cutlass.Float16, head_dim, False, 0,
                                             **FlashDecodeSm80.default_tiles(head_dim))
    # enough CTAs already: no split; one long sequence: split up to the SM target, bounded by the keys
    assert dispatch.decode_splits(64, 8, 1, 8192, 64, 132) == 1
    assert dispatch.decode_splits(1, 8, 1, 131072, 64, 132) == 33
    assert dispatch.decode_splits(1, 8, 1, 1024, 64, 132) == 8  # 16 blocks, at least 2 per split
    assert dispatch.decode_splits(1, 1, 1, 4096, 64, 132, ctas_per_sm=1) == 32  # batch 1 4k 8:1
    assert dispatch.decode_splits(1, 1, 1, 64, 64, 132) == 1
    assert dispatch.decode_splits(1, 1, 1, 10 ** 7, 64, 132) == 256  # validate.MAX_SPLITS
    assert dispatch.decode_splits(8, 8, 1, 32768, 64, 132) == 4  # one wave of 256 CTAs, not 320 in two
    assert dispatch.decode_splits(64, 8, 1, 4096, 64, 132) == 1
    # DECODE_KEYS_TILE's wave (3 per SM): 512 tiles are 1.3 waves, split 3 ways; 4 waves or more: unsplit
    assert dispatch.decode_splits(64, 8, 1, 4096, 64, 132, ctas_per_sm=3) == 3
    assert dispatch.decode_splits(256, 8, 1, 4096, 64, 132, ctas_per_sm=3) == 1
    assert dispatch.decode_splits(132, 8, 1, 4096, 64, 132) == 1  # 4 waves of 2 per SM
    # a deep CTA: one per SM, so one wave is 132 CTAs
    assert dispatch.decode_splits(1, 1, 1, 131072, 64, 132, ctas_per_sm=1) == 128
    assert dispatch.decode_splits(8, 8, 1, 32768, 64, 132, ctas_per_sm=1) == 2
    # deep where the whole call is one row tile: batch 1, 8:1 heads, 1 token
    assert dispatch.decode_is_deep(1, 8, 1, 1, 128)
    assert not dispatch.decode_is_deep(8, 8, 1, 1, 128)  # 8 tiles
    assert not dispatch.decode_is_deep(1, 32, 8, 1, 128)  # 8 tiles
    assert not dispatch.decode_is_deep(1, 8, 1, 2000, 128)  # a 2000-token chunk
    # narrow where each (sequence, KV head) fits 32 packed rows and its tiles number 2 to SMs - 1
    assert dispatch.decode_is_narrow(8, 32, 8, 1, 132)  # 64 tiles of 4 rows
    assert dispatch.decode_is_narrow(8, 32, 8, 8, 132)  # 32 rows each
    assert not dispatch.decode_is_narrow(8, 8, 1, 8, 132)  # 64 rows: two narrow tiles would read each key twice
    assert not dispatch.decode_is_narrow(64, 32, 8, 1, 132)  # 512 tiles
    assert not dispatch.decode_is_narrow(1, 8, 1, 1, 132)  # one tile: the deep CTA's
    # warps along the keys where 16 packed rows hold a sequence's group and the tiles fill the SMs
    assert dispatch.decode_warps_along_keys(64, 32, 8, 1, 128, 132)  # 512 tiles of 4 rows
    assert dispatch.decode_warps_along_keys(132, 8, 1, 2, 64, 132)  # 16 rows each
    assert not dispatch.decode_warps_along_keys(64, 32, 8, 8, 128, 132)  # 32 rows
    assert not dispatch.decode_warps_along_keys(8, 32, 8, 1, 128, 132)  # 64 tiles: the narrow tile's
    assert not dispatch.decode_warps_along_keys(64, 32, 8, 1, 96, 132)
    assert dispatch.decode_warps_along_keys(1, 8, 1, 1, 128, 132)  # one tile: with the deep CTA's stages
    assert dispatch.decode_cta_shape(1, 8, 1, 1, 128, 132) == (True, False, True)  # what kvcache asks, per shape
    assert dispatch.decode_cta_shape(8, 32, 8, 1, 128, 132) == (False, True, False)
    # the merge's wide CTA for a few rows split many ways
    assert dispatch.decode_merge_shape(8, 128) == dispatch.DECODE_WIDE_MERGE
    assert dispatch.decode_merge_shape(8, 8) == dispatch.DECODE_MERGE
    assert dispatch.decode_merge_shape(64, 128) == dispatch.DECODE_MERGE
    assert dispatch.decode_merge_shape(4096, 4) == dispatch.DECODE_ROWS_MERGE  # batch 64, 8 tokens, 8 heads
    assert dispatch.decode_merge_shape(512, 4) == dispatch.DECODE_ROWS_MERGE  # batch 64, one token, 8 heads
    assert dispatch.decode_merge_shape(64, 16) == dispatch.DECODE_MERGE  # batch 8, one token, 8 heads
    assert dispatch.decode_merge_shape(1024, 32) == dispatch.DECODE_MERGE
    assert not dispatch.decode_warps_along_keys(1, 32, 1, 1, 128, 132)  # one tile of 32 rows: the deep 64-row CTA


def test_split_block_ranges_match_brute_force():
    # The decode kernel's split ranges are plain integer arithmetic: run them on Python ints and
    # compare with the keys every packed row (q_idx * group + h) of a tile sees.
    from cute_flash.kernels.common.blocks import split_block_range

    tile_m, tile_n = 64, 64
    # (causal, window): windows as the kernel takes them, an unbounded side as a bound no row reaches
    for causal, window in [(False, None), (True, None), (False, (100, 0)), (False, (0, 0)), (False, (5000, 70)),
                           (False, (130, 5000)), (False, (3, 2))]:
        for seqlen_q, seqlen_k, group in [(1, 1, 4), (1, 1000, 4), (4, 130, 8), (16, 64, 4), (200, 1201, 4),
                                          (200, 150, 1), (3, 1, 4), (3, 0, 2), (8, 4096, 8)]:
            rows = seqlen_q * group
            for m_block in range(-(-rows // tile_m)):
                seen = set()
                for r in range(m_block * tile_m, min((m_block + 1) * tile_m, rows)):
                    q_idx = r // group
                    first, last = 0, seqlen_k - 1 if not causal else min(seqlen_k - 1, q_idx + seqlen_k - seqlen_q)
                    if window is not None:
                        first = max(first, q_idx + seqlen_k - seqlen_q - window[0])
                        last = min(last, q_idx + seqlen_k - seqlen_q + window[1])
                    seen |= {j // tile_n for j in range(first, last + 1)}
                for num_splits in (1, 2, 3, 7, 64):
                    ranges = [tuple(int(x) for x in split_block_range(
                        m_block, s, num_splits, seqlen_q, seqlen_k, group, tile_m, tile_n, causal, window))
                        for s in range(num_splits)]
                    covered = [n for lo, hi in ranges for n in range(lo, hi)]
                    assert sorted(covered) == sorted(set(covered)), "splits overlap"
                    # exactly the blocks some row sees (consecutive rows' keys overlap: no gaps)
                    assert set(covered) == seen, (causal, window, seqlen_q, seqlen_k, group, m_block)
                    # equal runs, the last one possibly shorter
                    sizes = [hi - lo for lo, hi in ranges if hi > lo]
                    assert all(x == sizes[0] for x in sizes[:-1]) and (not sizes or sizes[-1] <= sizes[0])
