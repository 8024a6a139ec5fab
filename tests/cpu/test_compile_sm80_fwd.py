"""The sm80 forward compiles (no GPU needed) to the instructions it is built from, without spills."""

import pytest

import cutlass

from cute_flash.compile_report import compile_report
from cute_flash.tensors import fake_bshd, fake_rowstat, fake_stream
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


@pytest.mark.parametrize(
    "dtype,head_dim,causal", VARIANTS,
    ids=[f"{d.__name__}-d{h}-{'causal' if c else 'full'}" for d, h, c in VARIANTS],
)
def test_sm80_fwd_compiles_without_spills(dtype, head_dim, causal):
    tiles = FlashAttnFwdSm80.default_tiles(dtype, head_dim, causal)
    assert FlashAttnFwdSm80.can_implement(dtype, head_dim, causal, **tiles)
    kernel = FlashAttnFwdSm80(dtype, head_dim, causal, **tiles)
    args = [fake_bshd(dtype, head_dim) for _ in range(4)]
    args += [fake_rowstat(), cutlass.Float32(1.0), fake_stream()]
    report = compile_report(kernel, args, arch="sm_80")

    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    assert "ldmatrix.sync.aligned" in report.ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in report.ptx  # V read transposed
    assert "cp.async.cg.shared.global" in report.ptx
    assert "ex2.approx" in report.ptx
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    assert report.registers <= 255


def test_default_tiles_fit_every_head_dim():
    for dtype in (cutlass.BFloat16, cutlass.Float16):
        for head_dim in range(8, 257, 8):
            for causal in (False, True):
                tiles = FlashAttnFwdSm80.default_tiles(dtype, head_dim, causal)
                assert FlashAttnFwdSm80.can_implement(dtype, head_dim, causal, **tiles)
