"""The sm80 forward compiles (no GPU needed) to the instructions it is built from, without spills."""

import dataclasses

import pytest

import cutlass

from cute_flash.compile_report import compile_report
from cute_flash.tensors import fake_bshd, fake_rowstat, fake_stream
from cute_flash.kernels.sm80.config import Sm80FwdConfig
from cute_flash.kernels.sm80.fwd import FlashAttnFwdSm80

# (dtype, head_dim, causal): both dtypes, small / odd (72 -> padded to 96) / large head dims
VARIANTS = [
    (cutlass.BFloat16, 128, True),
    (cutlass.Float16, 128, False),
    (cutlass.BFloat16, 64, False),
    (cutlass.Float16, 72, True),
    (cutlass.BFloat16, 256, False),
]


@pytest.fixture(autouse=True)
def _sm80_target(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")


def _compile_default_tiles(dtype, head_dim, causal):
    tiles = FlashAttnFwdSm80.default_tiles(dtype, head_dim, causal)
    assert FlashAttnFwdSm80.can_implement(dtype, head_dim, causal, **tiles)
    kernel = FlashAttnFwdSm80(Sm80FwdConfig(dtype, head_dim, causal, **tiles))
    args = [fake_bshd(dtype, head_dim) for _ in range(4)]
    args += [fake_rowstat(), cutlass.Float32(1.0), fake_stream()]
    return compile_report(kernel, args, arch="sm_80")


@pytest.mark.parametrize(
    "dtype,head_dim,causal", VARIANTS,
    ids=[f"{d.__name__}-d{h}-{'causal' if c else 'full'}" for d, h, c in VARIANTS],
)
def test_sm80_fwd_compiles_without_spills(dtype, head_dim, causal):
    report = _compile_default_tiles(dtype, head_dim, causal)

    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    assert "ldmatrix.sync.aligned" in report.ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in report.ptx  # V read transposed
    assert "cp.async.cg.shared.global" in report.ptx
    assert "ex2.approx" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    assert report.registers <= 255


# fp32 (split TF32): one variant per tile class of FlashAttnFwdSm80._fp32_tiles, an odd head dim.
FP32_VARIANTS = [(32, True), (64, False), (40, False), (128, True), (256, False)]


@pytest.mark.parametrize("head_dim,causal", FP32_VARIANTS,
                         ids=[f"float32-d{h}-{'causal' if c else 'full'}" for h, c in FP32_VARIANTS])
def test_sm80_fwd_fp32_compiles_to_split_tf32_without_spills(head_dim, causal):
    report = _compile_default_tiles(cutlass.Float32, head_dim, causal)

    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in report.ptx
    assert "cvt.rna.tf32.f32" in report.ptx  # the hi / lo split
    assert "ldmatrix" not in report.ptx and "m16n8k16" not in report.ptx
    assert "cp.async.cg.shared.global" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


@pytest.mark.parametrize("head_dim,causal", [(72, False), (128, False), (120, True), (64, True)], ids=str)
def test_sm80_fwd_fp32_sums_key_blocks_apart_without_spills_on_sm90a(head_dim, causal, monkeypatch):
    """On the H100 / H200 (the sm80 family compiled for sm_90a) split TF32 up to d128 takes the same
    64 x 64 tiles as on sm_80, with each key block's P V summed apart from O (block_accumulator):
    the second accumulator spilled with 128-row tiles. Plain TF32 keeps 128 x 32 at d72-d128."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    tiles = FlashAttnFwdSm80.default_tiles(cutlass.Float32, head_dim, causal, arch="sm_90a")
    assert tiles == FlashAttnFwdSm80.default_tiles(cutlass.Float32, head_dim, causal)
    assert (tiles["tile_m"], tiles["tile_n"], tiles["block_accumulator"]) == (64, 64, True)
    if head_dim > 64:
        plain = FlashAttnFwdSm80.default_tiles(cutlass.Float32, head_dim, causal, arch="sm_90a", tf32_products=1)
        assert (plain["tile_m"], plain["tile_n"]) == (128, 32) and "block_accumulator" not in plain
    kernel = FlashAttnFwdSm80(Sm80FwdConfig(cutlass.Float32, head_dim, causal, **tiles))
    args = [fake_bshd(cutlass.Float32, head_dim) for _ in range(4)] + [fake_rowstat(), cutlass.Float32(1.0), fake_stream()]
    report = compile_report(kernel, args, arch="sm_90a")
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


def test_fp32_forward_sums_key_blocks_apart_up_to_d128():
    import torch

    from cute_flash import dispatch

    for capability, family in (((8, 0), None), ((9, 0), "sm80"), ((8, 6), None)):
        for head_dim in (32, 96, 128, 256):
            for dtype in (torch.float32, torch.bfloat16):
                config = dispatch.plan_forward(capability, dtype, head_dim, True, family=family).config
                assert config.block_accumulator == (dtype == torch.float32 and head_dim <= 128)
            plain = dispatch.plan_forward(capability, torch.float32, head_dim, True, family=family, tf32_products=1)
            assert not plain.config.block_accumulator
    assert not FlashAttnFwdSm80.can_implement(cutlass.BFloat16, 64, False, tile_m=64, block_accumulator=True)
    with pytest.raises(ValueError, match="block_accumulator"):
        FlashAttnFwdSm80(Sm80FwdConfig(cutlass.BFloat16, 64, False, block_accumulator=True))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_plain_tf32_runs_a_third_of_the_products(arch, monkeypatch):
    """tf32_products=1 (torch's fp32 matmul precision "high" / "medium"): one TF32 product per
    operand pair in the forward and the backward, spill-free; the split kernels keep three."""
    import torch

    from cute_flash import dispatch

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    capability = (9, 0) if arch == "sm_90a" else (8, 0)
    mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
    split_forward = dispatch.plan_forward(capability, torch.float32, 64, True, family="sm80")
    # the split forward's tiles with one product (the dispatched plain forward has larger ones)
    same_tiles = dataclasses.replace(split_forward, config=dataclasses.replace(split_forward.config, tf32_products=1))
    for plan_of in (lambda n: split_forward if n == 3 else same_tiles,
                    lambda n: dispatch.plan_backward(capability, torch.float32, 64, False, family="sm80",
                                                     tf32_products=n).main):
        reports = {n: compile_report(*plan_of(n).build(), arch=arch) for n in (1, 3)}
        assert reports[1].ptx.count(mma) * 3 == reports[3].ptx.count(mma) > 0
        assert reports[1].spill_bytes == 0, f"{reports[1].registers} registers, {reports[1].spill_bytes} B spilled"
    # plain TF32 keeps 128 query rows and O as the one accumulator
    plain = dispatch.plan_forward(capability, torch.float32, 64, True, family="sm80", tf32_products=1)
    assert (plain.config.tile_m, plain.config.block_accumulator) == (128, False)
    report = compile_report(*plain.build(), arch=arch)
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    with pytest.raises(ValueError, match="tf32_products"):
        dispatch.plan_forward(capability, torch.bfloat16, 64, True, family="sm80", tf32_products=1)


def test_tf32_products_follow_torchs_fp32_matmul_precision():
    import torch

    from cute_flash import dispatch

    saved = torch.get_float32_matmul_precision()
    try:
        for precision, products in (("highest", 3), ("high", 1), ("medium", 1)):
            torch.set_float32_matmul_precision(precision)
            assert dispatch.tf32_products_for(torch.float32) == products
            assert dispatch.tf32_products_for(torch.bfloat16) == 3
    finally:
        torch.set_float32_matmul_precision(saved)


def test_default_tiles_fit_every_head_dim():
    for arch in ("sm_80", "sm_86", "sm_89"):
        for dtype in (cutlass.BFloat16, cutlass.Float16, cutlass.Float32):
            for head_dim in range(8, 257, 8):
                for causal in (False, True):
                    tiles = FlashAttnFwdSm80.default_tiles(dtype, head_dim, causal, arch=arch)
                    assert FlashAttnFwdSm80.can_implement(dtype, head_dim, causal, **tiles, arch=arch)
    # sm_86 / sm_89 hold 99 KB per CTA: fewer keys per block there, the sm_80 tiles elsewhere
    assert FlashAttnFwdSm80.default_tiles(cutlass.BFloat16, 256, True, arch="sm_86")["tile_n"] == 32
    assert FlashAttnFwdSm80.default_tiles(cutlass.BFloat16, 256, True)["tile_n"] == 64
    assert FlashAttnFwdSm80.default_tiles(cutlass.BFloat16, 64, True, arch="sm_89") == \
        FlashAttnFwdSm80.default_tiles(cutlass.BFloat16, 64, True)


@pytest.mark.parametrize("dtype,head_dim,causal", [(cutlass.BFloat16, 256, True), (cutlass.Float16, 192, False),
                                                   (cutlass.Float32, 128, False), (cutlass.Float32, 256, True)],
                         ids=str)
def test_sm86_fwd_tiles_compile_without_spills(dtype, head_dim, causal, monkeypatch):
    """RTX 30 / 40, A10, L4, L40 (sm_86 / sm_89): the forward's tiles fit their 99 KB per CTA."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_86")
    tiles = FlashAttnFwdSm80.default_tiles(dtype, head_dim, causal, arch="sm_86")
    assert FlashAttnFwdSm80.smem_bytes(head_dim, **tiles, dtype=dtype) <= 99 * 1024
    kernel = FlashAttnFwdSm80(Sm80FwdConfig(dtype, head_dim, causal, **tiles))
    args = [fake_bshd(dtype, head_dim) for _ in range(4)] + [fake_rowstat(), cutlass.Float32(1.0), fake_stream()]
    report = compile_report(kernel, args, arch="sm_86")
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("tile_m,tile_n", [(128, 64), (64, 64), (128, 32)])
def test_causal_block_ranges_match_brute_force(tile_m, tile_n):
    # The block-range formulas are plain integer arithmetic: run the undecorated functions on
    # Python ints and compare with the visibility of every (query, key) pair.
    from cute_flash.kernels.common.blocks import BlockRanges

    r = BlockRanges(tile_m, tile_n, True)
    fn = {name: getattr(BlockRanges, name).__wrapped__ for name in (
        "n_block_min_max", "n_block_min_causal_mask", "m_block_min_max", "m_block_max_causal_mask")}
    for sq, sk in [(1, 1), (7, 7), (113, 203), (517, 33), (300, 900), (900, 300)]:
        def rows(m):
            return range(m * tile_m, min((m + 1) * tile_m, sq))

        def cols(n):
            return range(n * tile_n, min((n + 1) * tile_n, sk))

        def seen(m, n, test):
            return test(j <= i + sk - sq for i in rows(m) for j in cols(n))

        for m in range(_cdiv(sq, tile_m)):
            lo, hi = (int(x) for x in fn["n_block_min_max"](r, m, sq, sk))
            first_masked = int(fn["n_block_min_causal_mask"](r, m, sq, sk, lo))
            for n in range(_cdiv(sk, tile_n)):
                assert lo <= n < hi or not seen(m, n, any), (sq, sk, m, n)
                assert not (lo <= n < min(first_masked, hi)) or seen(m, n, all), (sq, sk, m, n)
            # The sm90 forward's warp groups: the rows below row_end see no key block from
            # n_block_end on, and some of them see the block before it.
            for row_end in range(m * tile_m + 64, min((m + 1) * tile_m, sq) + 64, 64):
                end = int(r.n_block_end(row_end, sq, sk))
                visible = [n for n in range(_cdiv(sk, tile_n))
                           if any(j <= i + sk - sq for i in range(min(row_end, sq)) for j in cols(n))]
                assert end == (max(visible) + 1 if visible else 0), (sq, sk, row_end, end)
        for n in range(_cdiv(sk, tile_n)):
            lo, hi = (int(x) for x in fn["m_block_min_max"](r, n, sq, sk))
            last_masked = int(fn["m_block_max_causal_mask"](r, n, sq, sk, lo))
            for m in range(_cdiv(sq, tile_m)):
                assert lo <= m < hi or not seen(m, n, any), (sq, sk, n, m)
                assert not (max(last_masked, lo) <= m < hi) or seen(m, n, all), (sq, sk, n, m)
