"""The sm80 backward (preprocess, main, postprocess) compiles for sm_80 on a CPU-only machine,
into the code we intend: mma.sync fed by ldmatrix (plain and transposed) from cp.async-filled
smem, fp32 reductions for dQ, and no register spills for any head dim we serve.
"""

import pytest

import cutlass

import torch

import cute_flash
from cute_flash import dispatch
from cute_flash.compile_report import compile_report
from cute_flash.device import capability_of
from cute_flash.kernels.sm80.bwd_post import FlashAttnBwdPostprocessSm80
from cute_flash.kernels.sm80.bwd_pre import FlashAttnBwdPreprocessSm80
from cute_flash.kernels.sm80.config import bwd_can_implement, bwd_default_tiles, bwd_smem_bytes, smem_capacity

ARCH = "sm_80"
BF16, FP16, FP32 = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
TORCH_DTYPES = {BF16: torch.bfloat16, FP16: torch.float16, FP32: torch.float32}


def backward_plan(dtype, head_dim, causal, deterministic=False, gqa=False, arch=ARCH):
    # On sm_90a the Hopper backward serves some head dims; the sm80 backward, planned here, serves
    # the others there (and every head dim under CUTE_FLASH_KERNEL_ARCH=sm80).
    return dispatch.plan_backward(capability_of(arch), TORCH_DTYPES[dtype], head_dim, causal, deterministic, gqa,
                                  family="sm80")

# (dtype, head_dim, causal, deterministic, gqa): every tile family, both dtypes, an odd multiple
# of 8 (40, padded to 64), deterministic dQ ordering and the fp32 dK/dV output used for GQA.
MAIN_VARIANTS = [
    (BF16, 32, False, False, False),
    (BF16, 64, True, False, False),
    (FP16, 96, False, True, False),
    (BF16, 128, True, False, False),
    (BF16, 128, False, False, True),
    (FP16, 192, True, False, False),
    (BF16, 256, False, True, False),
    (BF16, 40, True, False, True),
    (BF16, 128, True, True, False),  # causal deterministic: descending dQ turns
    (FP16, 64, True, True, True),
]


def _id(v):
    dtype, d, causal, det, gqa = v
    return f"{dtype.__name__}-d{d}-{'causal' if causal else 'full'}{'-det' if det else ''}{'-gqa' if gqa else ''}"


# The H100 runs this kernel compiled for sm_90a, where ptxas allocates differently and d = 128
# and 256 keep the fp32 P; the head dims that sit at 255 registers (64, 128, 256) are checked for
# that target too, d = 128 in both dtypes (bf16 non-causal is the variant that spills for sm_80
# with the fp32 P) and d = 256 in fp16 (which spills for sm_80).
MAIN_TARGETS = (
    [(v, ARCH) for v in MAIN_VARIANTS]
    + [(v, "sm_90a") for v in MAIN_VARIANTS if v[1] in (64, 128, 256)]
    + [((BF16, 128, False, False, False), "sm_90a"), ((FP16, 128, True, False, True), "sm_90a"),
       ((FP16, 128, False, False, False), "sm_90a"), ((BF16, 128, False, True, False), "sm_90a"),
       ((FP16, 256, True, False, True), "sm_90a")]
    # d = 192-256 keep a second Q buffer there, d = 256 computes dQ in 64-column chunks: grouped-
    # query and deterministic variants of those, which sit at 255 registers too.
    + [((BF16, 256, True, False, True), "sm_90a"), ((FP16, 256, False, True, True), "sm_90a"),
       ((FP16, 256, False, False, False), "sm_90a"), ((BF16, 224, True, False, False), "sm_90a"),
       ((FP16, 192, False, True, True), "sm_90a")]
)


@pytest.mark.parametrize("variant,arch", MAIN_TARGETS, ids=[f"{_id(v)}-{a}" for v, a in MAIN_TARGETS])
def test_main_kernel_compiles_to_mma_sync_without_spills(variant, arch, capsys):
    dtype, head_dim, causal, deterministic, gqa = variant
    plan = backward_plan(dtype, head_dim, causal, deterministic, gqa, arch).main
    tiles = {k: v for k, v in plan.settings().items() if k not in ("dtype", "head_dim", "causal", "deterministic")}
    assert bwd_can_implement(dtype, head_dim, causal, arch, **tiles)
    with capsys.disabled():  # compile_report reads the ptxas remarks from the real stderr
        report = compile_report(*plan.build(), arch=arch)
    ptx = report.ptx
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx
    assert "cp.async" in ptx
    assert "red." in ptx and ".add.f32" in ptx  # dQ accumulation
    if deterministic:
        assert "ld.acquire" in ptx  # the ordered dQ semaphore
    # causal deterministic: the grid runs from the last key block (Sm80BwdConfig.shortest_walk_first)
    assert ("%nctaid.x" in ptx) == (deterministic and causal)
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"


# d = 256 on sm_90a reads dQ back in 64-column chunks.
@pytest.mark.parametrize("dtype,head_dim,arch", [(BF16, 64, ARCH), (FP16, 40, ARCH), (BF16, 256, ARCH),
                                                 (FP16, 256, "sm_90a"), (FP16, 8, ARCH), (FP32, 8, ARCH)])
def test_pre_and_post_kernels_compile_without_spills(dtype, head_dim, arch, capsys):
    with capsys.disabled():
        plan = backward_plan(dtype, head_dim, False, arch=arch)
        assert plan.pre.kernel_cls is FlashAttnBwdPreprocessSm80 and plan.post.kernel_cls is FlashAttnBwdPostprocessSm80
        pre = compile_report(*plan.pre.build(), arch=arch)
        post = compile_report(*plan.post.build(), arch=arch)
    assert pre.spill_bytes == 0 and post.spill_bytes == 0
    assert "shfl.sync.bfly" in pre.ptx  # the row dot product is reduced across the row's lanes
    assert "ld.global.v4" in pre.ptx  # O and dO arrive as 16-byte vectors
    assert "st.global.v4" in pre.ptx  # the dQ workspace is zeroed in 16-byte vectors
    assert "ld.global.b32" in post.ptx  # the workspace is read back one float per thread, coalesced
    assert "st.global.v4" in post.ptx  # dQ leaves through smem as 16-byte vectors


def test_preprocess_lays_out_every_head_dim():
    """A row's 16-byte chunks over a power-of-two group of lanes that covers them, a CTA's 32 rows in
    whole passes of its 128 threads, for every head dim and dtype the backward takes."""
    from cute_flash.kernels.sm80.config import Sm80BwdPreConfig
    for dtype in (BF16, FP16, FP32):
        for head_dim in range(8, 257, 8):
            pre = FlashAttnBwdPreprocessSm80(Sm80BwdPreConfig(dtype, head_dim))
            assert pre.lanes_per_row * pre.chunks_per_lane >= pre.chunks == head_dim * dtype.width // 128
            assert pre.lanes_per_row & (pre.lanes_per_row - 1) == 0 and 4 <= pre.lanes_per_row <= 32
            assert pre.rows_per_cta % pre.rows_per_pass == 0


# The grouped-query backward's group sum, which the C library runs (the Python package sums with
# torch): one 16-byte vector per thread and row of the output, two from each fp32 workspace row,
# added in a fixed order (no atomics), and one rounding.
@pytest.mark.parametrize("dtype,head_dim,arch", [(BF16, 64, ARCH), (FP16, 40, ARCH), (BF16, 256, "sm_90a")])
def test_group_sum_kernel_compiles_to_vector_copies_without_atomics(dtype, head_dim, arch, capsys):
    plan = dispatch.plan_group_sum(capability_of(arch), TORCH_DTYPES[dtype], head_dim)
    with capsys.disabled():
        report = compile_report(*plan.build(), arch=arch)
    assert report.spill_bytes == 0
    assert "ld.global.v4.b32" in report.ptx and "st.global.v4.b32" in report.ptx
    assert f"cvt.rn.{'bf16' if dtype is BF16 else 'f16'}x2.f32" in report.ptx
    assert "red." not in report.ptx and "atom." not in report.ptx


def test_tiles_fit_and_cover_every_head_dim():
    for head_dim in range(8, 257, 8):
        for causal in (False, True):
            for arch, gqa in ((ARCH, False), ("sm_90a", False), ("sm_90a", True)):
                tiles = bwd_default_tiles(BF16, head_dim, causal, arch, gqa)
                assert bwd_can_implement(BF16, head_dim, causal, arch, **tiles), (head_dim, tiles)
                assert bwd_smem_bytes(BF16, head_dim, **tiles) <= smem_capacity(arch)
    assert not bwd_can_implement(BF16, 260, False)
    assert not bwd_can_implement(BF16, 44, False)
    # sm_86 / sm_89 (99 KB per CTA): smaller blocks or fewer buffers up to head dim 192 (160 in
    # fp32), a typed error above; sm_80 and sm_90 keep their tiles
    for arch in ("sm_86", "sm_89"):
        for dtype, largest in ((BF16, 192), (FP16, 192), (cutlass.Float32, 160)):
            for head_dim in range(8, 257, 8):
                for causal in (False, True):
                    tiles = bwd_default_tiles(dtype, head_dim, causal, arch)
                    assert (tiles is not None) == (head_dim <= largest), (arch, dtype, head_dim)
                    assert tiles is None or bwd_can_implement(dtype, head_dim, causal, arch, **tiles)
    with pytest.raises(cute_flash.UnsupportedHeadDimError, match="up to 192"):
        dispatch.plan_backward((8, 6), torch.bfloat16, 256, False)


# sm_86 / sm_89's tiles, 16-bit: 128 x 128 with one buffer each, 64 x 128, 64 x 64, 64 x 32
SM86_VARIANTS = [(BF16, 32, False), (BF16, 64, True), (FP16, 128, False), (BF16, 160, True), (BF16, 192, False)]


@pytest.mark.parametrize("dtype,head_dim,causal", SM86_VARIANTS, ids=str)
def test_sm86_backward_tiles_compile_without_spills(dtype, head_dim, causal, capsys, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_86")
    plan = backward_plan(dtype, head_dim, causal, arch="sm_86").main
    settings = {k: v for k, v in plan.settings().items() if k not in ("dtype", "head_dim")}
    assert bwd_smem_bytes(dtype, head_dim, **settings) <= 99 * 1024
    with capsys.disabled():
        report = compile_report(*plan.build(), arch="sm_86")
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"


# fp32 (split TF32): every tile class of config._bwd_fp32_tiles for both targets, an odd
# head dim, deterministic and grouped-query variants.
FP32_TARGETS = [
    ((FP32, 64, False, False, False), ARCH), ((FP32, 40, True, True, True), ARCH),
    ((FP32, 128, True, False, False), ARCH), ((FP32, 256, False, False, False), ARCH),
    ((FP32, 128, False, True, True), "sm_90a"), ((FP32, 256, True, False, False), "sm_90a"),
]


@pytest.mark.parametrize("variant,arch", FP32_TARGETS, ids=[f"{_id(v)}-{a}" for v, a in FP32_TARGETS])
def test_fp32_main_kernel_compiles_to_split_tf32_without_spills(variant, arch, capsys):
    dtype, head_dim, causal, deterministic, gqa = variant
    plan = backward_plan(dtype, head_dim, causal, deterministic, gqa, arch).main
    with capsys.disabled():
        report = compile_report(*plan.build(), arch=arch)
    ptx = report.ptx
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
    assert "cvt.rna.tf32.f32" in ptx  # the hi / lo split
    assert "ldmatrix" not in ptx and "m16n8k16" not in ptx
    assert "cp.async" in ptx and "red." in ptx
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"


def test_fp32_tiles_fit_every_head_dim():
    for head_dim in range(8, 257, 8):
        for arch in (ARCH, "sm_90a"):
            tiles = bwd_default_tiles(FP32, head_dim, True, arch)
            assert bwd_can_implement(FP32, head_dim, True, arch, **tiles), (head_dim, arch, tiles)
            assert bwd_smem_bytes(FP32, head_dim, **tiles) <= smem_capacity(arch)


def test_compile_key_holds_only_code_generating_choices():
    tiles = bwd_default_tiles(BF16, 128, True)
    key = backward_plan(BF16, 128, True).main.key
    assert key[:2] == ("cute_flash.kernels.sm80.bwd", "FlashAttnBwdSm80")
    assert key != backward_plan(BF16, 128, True, deterministic=True).main.key
    assert key != backward_plan(BF16, 128, True, gqa=True).main.key  # fp32 dK / dV
    assert backward_plan(BF16, 128, True).pre.key == backward_plan(BF16, 128, False, True, True).pre.key
    # The H100's target keeps the fp32 P at d = 128; bf16 splits dQ's rows over four warps.
    h100 = bwd_default_tiles(BF16, 128, True, "sm_90a")
    assert h100["p_in_registers"] and h100["atom_m_dq"] == 4 and not tiles["p_in_registers"]
    assert backward_plan(BF16, 128, True, arch="sm_90a").main.key != key
    h100_fp16 = bwd_default_tiles(FP16, 128, True, "sm_90a")
    assert h100_fp16["p_in_registers"] and h100_fp16["atom_m_dq"] == 2
    assert bwd_default_tiles(FP16, 256, False, "sm_90a")["p_in_registers"]
    # The H100's smem holds a second Q buffer at d = 256, with dQ in four chunks; grouped-query
    # heads give up the fp32 P there.
    wide = bwd_default_tiles(BF16, 256, False, "sm_90a")
    assert (wide["num_stages_Q"], wide["num_stages_dO"], wide["dq_chunks"]) == (2, 1, 4)
    assert bwd_default_tiles(BF16, 256, False)["num_stages_Q"] == 1
    assert not bwd_default_tiles(BF16, 256, False, "sm_90a", gqa=True)["p_in_registers"]
    assert backward_plan(BF16, 256, False, arch="sm_90a").main.key != backward_plan(BF16, 256, False).main.key
    assert not bwd_default_tiles(FP16, 256, False)["p_in_registers"]
