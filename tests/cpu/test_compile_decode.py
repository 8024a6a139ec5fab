"""The decode kernel and its split merge compile (no GPU needed) for sm_80 and sm_90a, to the
instructions they are built from, without spills; dispatch plans them for every page size rule."""

import pytest
import torch

import cutlass

from cute_flash import dispatch
from cute_flash.compile_report import compile_report

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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_combine_compiles(monkeypatch, arch):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    plan = dispatch.plan_decode((8, 0) if arch == "sm_80" else (9, 0), torch.bfloat16, 128, False)
    report = _compile(plan.combine, arch)
    assert "ld.global.v4.b32" in report.ptx  # each lane's 4 columns of a piece in one load
    assert "st.global.v2.b32" in report.ptx  # and its 4 bf16 columns of O in one store
    assert "ex2.approx" in report.ptx and "lg2.approx" in report.ptx
    assert report.spill_bytes == 0


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
    assert dispatch.decode_splits(1, 8, 1, 1024, 64, 132) == 4  # 16 blocks, at least 4 per split
    assert dispatch.decode_splits(1, 1, 1, 64, 64, 132) == 1
    assert dispatch.decode_splits(1, 1, 1, 10 ** 7, 64, 132) == 128
