"""The Hopper backward compiles for sm_90a on a CPU-only machine, into the code we intend: wgmma
fed by TMA (bulk tensor copies) through mbarriers, register reallocation between the producer and
the MMA warp groups, dQ added by one bulk reduce per query block, no register spills and no ptxas
advisory that wgmmas wait or are serialized (C751x), for every variant dispatch serves."""

import re

import pytest

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.tensor_utils.layout import LayoutEnum

from cute_flash import compile_report as compile_report_module
from cute_flash import dispatch
from cute_flash.compile_report import compile_report
from cute_flash.device import capability_of
from cute_flash.kernels.common.layouts import transpose_view
from cute_flash.kernels.sm90.bwd import FlashAttnBwdSm90, ds_store_copy, swizzle_free
from cute_flash.kernels.sm90.bwd_post import FlashAttnBwdPostprocessSm90
from cute_flash.kernels.sm90.config import BWD_HEAD_DIMS, SMEM_BYTES, backward_config, backward_smem_bytes

ARCH = "sm_90a"
TORCH_DTYPES = {cutlass.BFloat16: torch.bfloat16, cutlass.Float16: torch.float16}


def backward_plan(dtype, head_dim, causal, deterministic=False, gqa=False, mods=dispatch.NO_MODS):
    return dispatch.plan_backward(capability_of(ARCH), TORCH_DTYPES[dtype], head_dim, causal, deterministic, gqa,
                                  family="sm90", mods=mods)


# Every (head dim, causal, deterministic) the Hopper backward serves, each dtype at least once.
VARIANTS = [(dtype, head_dim, causal, deterministic)
            for head_dim in BWD_HEAD_DIMS for causal in (False, True) for deterministic in (False, True)
            for dtype in ((cutlass.BFloat16, cutlass.Float16) if not deterministic else (cutlass.BFloat16,))]


@pytest.mark.parametrize("dtype,head_dim,causal,deterministic", VARIANTS,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_main_kernel_compiles_to_wgmma_and_tma_without_spills(dtype, head_dim, causal, deterministic, capsys,
                                                              monkeypatch):
    plan = backward_plan(dtype, head_dim, causal, deterministic)
    assert plan.main.kernel_cls is FlashAttnBwdSm90 and plan.post.kernel_cls is FlashAttnBwdPostprocessSm90
    # CompileReport has no field for ptxas advisories: keep the log it parses.
    logs = []
    parse = compile_report_module._parse
    monkeypatch.setattr(compile_report_module, "_parse", lambda log: (logs.append(log), parse(log))[1])
    kernel, args = plan.main.build()
    with capsys.disabled():  # compile_report reads the ptxas remarks from the real stderr
        report = compile_report(kernel, args, arch=ARCH)
    ptx = report.ptx
    # Five GEMMs per query block and warp group, each as k-blocks of 16: S^T and dP^T over
    # head_dim, dV and dK over the query block, dQ over the key block.
    cfg = plan.main.config
    k_blocks = 2 * head_dim // 16 + 2 * cfg.m_block_size // 16 + cfg.n_block_size // 16
    assert ptx.count("wgmma.mma_async") == k_blocks
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and the dK / dV stores
    assert "cp.reduce.async.bulk.global.shared::cta" in ptx and ".add.f32" in ptx  # dQ's sums
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "mbarrier.try_wait" in ptx
    assert ("ld.acquire" in ptx) == deterministic  # the ordered dQ semaphore
    # launched dependent on the preprocess: one wait, before any load of its outputs
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor")
    # 128-row blocks take 32 LSE values per query block by shuffle (4 other shuffles in every variant).
    assert (ptx.count("shfl.sync.idx") >= 32) == cfg.shared_stats
    assert cfg.shared_stats == (head_dim == 64)  # where 128-row blocks fit the registers
    if cfg.split_head_dim:  # the groups split S^T's query columns and dV's / dK's head-dim columns
        assert f".m64n{cfg.m_block_size // 2}k16." in ptx and f".m64n{head_dim // 2}k16." in ptx
    assert cfg.split_head_dim == (head_dim > 128)
    # dS^T to smem by stmatrix (ds_by_stmatrix): one per 16 query rows of the block per thread.
    assert ptx.count("stmatrix") == (cfg.m_block_size // 16 if kernel.ds_by_stmatrix else 0)
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"
    assert logs, "no ptxas log"
    advisories = re.findall(r"\((C751\d)\)", logs[0])
    # -D filled after the S GEMM is issued made ptxas wait for S before issuing dP (C7517).
    assert not advisories, f"ptxas serialized or waited for wgmma instructions: {advisories}"


@pytest.mark.parametrize("head_dim", [64])
def test_ds_stmatrix_store_writes_each_element_where_the_accumulator_store_does(head_dim):
    """The stmatrix store of dS^T (ds_store_copy through swizzle_free's layout) against the
    element-wise store of the accumulator (thr_SdP.partition_C of dS^T's swizzled smem), for every
    MMA thread and both stages, traced with compile-time thread indices (no GPU): each source value
    is the accumulator element the copy expects there, and each lane's row address is the swizzled
    address of the elements the copy puts in that row."""
    cfg = backward_plan(cutlass.BFloat16, head_dim, False).main.config
    assert FlashAttnBwdSm90(cfg).ds_by_stmatrix
    m, n, d, stages, dtype = cfg.m_block_size, cfg.n_block_size, cfg.head_dim, cfg.q_stages, cfg.dtype
    found = {}

    def collect(copy, tiled_mma, sdSt, offsets):
        identity = cute.make_identity_tensor((n, m))
        swizzle = sdSt.iterator.type.swizzle_type
        bits, base, shift = swizzle.num_bits, swizzle.num_base, swizzle.num_shift
        width = dtype.width // 8

        def swizzled(offset):  # element offset -> its element offset through the pointer's swizzle (on bytes)
            byte = offset * width
            return (byte ^ (((byte >> (base + shift)) & ((1 << bits) - 1)) << base)) // width

        wrong_source, wrong_address, written = [], [], set()
        for t in range(cfg.num_mma_threads):
            thr = copy.get_slice(t)
            source = thr.partition_S(identity)
            accumulator = thr.retile(tiled_mma.get_slice(t).partition_C(identity))
            for f in range(cute.size(source)):
                if tuple(source[f]) != tuple(accumulator[f]):
                    wrong_source.append((t, f))
            rows, addresses = thr.partition_D(identity), thr.partition_D(offsets)
            for stage in range(stages):
                lane_rows = addresses[None, None, None, stage]
                for f in range(cute.size(rows)):
                    key, query = rows[f]
                    if lane_rows.iterator + lane_rows.layout(f) != swizzled(sdSt.layout((key, query, stage))):
                        wrong_address.append((t, stage, f))
                    written.add((key, query, stage))
        found.update(wrong_source=wrong_source, wrong_address=wrong_address, written=len(written))

    @cute.jit
    def trace():
        # S^T / dP^T's tiled MMA and dS's smem layout as FlashAttnBwdSm90.launch makes them.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            atom_layout_mnk=(cfg.num_wg_mma, 1, 1), tiler_mn=(64, m),
        )
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (m, d, n), dtype, stages)
        smem = cute.make_ptr(dtype, 0, cute.AddressSpace.smem, assumed_align=1024)
        sdSt = transpose_view(cute.make_tensor(cute.recast_ptr(smem, sdS_layout.inner, dtype=dtype), sdS_layout.outer))
        # swizzle_free's layout on an integer iterator: the partitions' offsets are Python ints.
        collect(ds_store_copy(tiled_mma, dtype), tiled_mma, sdSt, cute.make_tensor(0, swizzle_free(sdSt).layout))

    cute.compile(trace, options=f"--gpu-arch={ARCH}")
    assert not found["wrong_source"], found["wrong_source"][:8]
    assert not found["wrong_address"], found["wrong_address"][:8]
    assert found["written"] == n * m * stages


@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
def test_postprocess_compiles_without_spills(head_dim, capsys):
    plan = backward_plan(cutlass.BFloat16, head_dim, False)
    with capsys.disabled():
        post = compile_report(*plan.post.build(), arch=ARCH)
    assert post.spill_bytes == 0
    assert "ld.global.v4" in post.ptx  # dQ's sums read back as 16-byte vectors, coalesced
    assert "st.global.v4" in post.ptx  # dQ leaves through smem as 16-byte vectors
    # launched dependent on the main kernel: it waits before it reads the dQ sums
    assert post.ptx.count("griddepcontrol.wait") == 1
    assert post.ptx.index("griddepcontrol.wait") < post.ptx.index("ld.global")


def test_dispatch_serves_hopper_head_dims_and_keeps_sm80_for_the_rest():
    for head_dim in range(8, 257, 8):
        plan = backward_plan(cutlass.BFloat16, head_dim, True, gqa=True)
        hopper = head_dim in BWD_HEAD_DIMS
        assert (plan.main.kernel_cls is FlashAttnBwdSm90) == hopper, head_dim
        assert plan.gqa == (not hopper)  # the Hopper kernel sums a query-head group itself
    assert backward_config(cutlass.Float32, 64, False, False) is None


def test_configurations_fit_and_key_only_what_changes_code():
    for head_dim in BWD_HEAD_DIMS:
        for causal in (False, True):
            config = backward_config(cutlass.BFloat16, head_dim, causal, False)
            assert backward_smem_bytes(config) <= SMEM_BYTES
            assert config.num_threads == 384
    key = backward_plan(cutlass.BFloat16, 128, True).main.key
    assert key == backward_plan(cutlass.BFloat16, 128, True, gqa=True).main.key  # GQA is not a variant
    assert key != backward_plan(cutlass.BFloat16, 128, True, deterministic=True).main.key
    assert key != backward_plan(cutlass.BFloat16, 128, False).main.key
    assert key != backward_plan(cutlass.Float16, 128, True).main.key


# Sliding windows (causal ones come as right = 0 with causal=False), softcap and ALiBi, each head
# dim, the deterministic order with a window (its turns count from the window's first key block).
MOD_VARIANTS = [  # (dtype, head_dim, causal, deterministic, (window, softcap, alibi))
    (cutlass.BFloat16, 128, False, False, (True, False, False)),
    (cutlass.Float16, 64, False, True, (True, False, False)),
    (cutlass.BFloat16, 128, False, True, (True, False, True)),
    (cutlass.BFloat16, 64, True, False, (False, False, True)),
    (cutlass.Float16, 128, False, False, (False, False, True)),
    (cutlass.BFloat16, 64, False, False, (False, True, False)),
    (cutlass.Float16, 64, True, True, (False, True, False)),
    (cutlass.BFloat16, 96, True, False, (False, True, False)),
    (cutlass.Float16, 96, False, False, (False, True, False)),
    (cutlass.BFloat16, 64, False, False, (True, True, True)),
    (cutlass.BFloat16, 96, False, True, (True, False, False)),
    # split_head_dim (hd 192 / 256): every modification, causal ALiBi and softcap included
    (cutlass.BFloat16, 192, True, False, (False, True, True)),
    (cutlass.Float16, 192, False, True, (True, False, True)),
    (cutlass.BFloat16, 256, True, True, (False, False, True)),
    (cutlass.Float16, 256, False, False, (True, True, False)),
]


@pytest.mark.parametrize("dtype,head_dim,causal,deterministic,mods", MOD_VARIANTS, ids=str)
def test_window_and_alibi_variants_compile_without_spills(dtype, head_dim, causal, deterministic, mods, capsys):
    plan = backward_plan(dtype, head_dim, causal, deterministic, mods=mods)
    cfg = plan.main.config
    assert plan.main.kernel_cls is FlashAttnBwdSm90 and plan.main.entry == "call_with_mods"
    assert (cfg.window, cfg.softcap, cfg.alibi) == mods and cfg.m_block_size == 64
    with capsys.disabled():
        report = compile_report(*plan.main.build(), arch=ARCH)
    assert report.ptx.count("wgmma.mma_async") == 2 * head_dim // 16 + 2 * cfg.m_block_size // 16 + cfg.n_block_size // 16
    assert ("ld.acquire" in report.ptx) == deterministic
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"


# The classes whose two-times-64-key kernel spills (causal ALiBi at hd 96 / 128: 56 bytes per MMA
# thread; softcap at hd 128: 8-88) take one 64-key block per CTA, split by head-dim columns.
SPLIT_AT_HD128_AND_BELOW = [(96, True, False, (False, False, True)), (128, True, False, (False, False, True)),
                            (128, False, False, (False, True, False)), (128, False, True, (True, True, False))]


@pytest.mark.parametrize("head_dim,causal,deterministic,mods", SPLIT_AT_HD128_AND_BELOW, ids=str)
def test_spilling_classes_take_the_split_shape_without_spills(head_dim, causal, deterministic, mods, capsys):
    plan = backward_plan(cutlass.BFloat16, head_dim, causal, deterministic, mods=mods)
    cfg = plan.main.config
    assert plan.main.kernel_cls is FlashAttnBwdSm90 and cfg.n_block_size == 64 and cfg.split_head_dim
    assert backward_plan(cutlass.BFloat16, head_dim, causal, deterministic).main.config.n_block_size == 128
    with capsys.disabled():
        report = compile_report(*plan.main.build(), arch=ARCH)
    assert f".m64n{cfg.m_block_size // 2}k16." in report.ptx and f".m64n{head_dim // 2}k16." in report.ptx
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"
