"""The Hopper fp32 forward (split TF32 on wgmma) compiles for sm_90a on a CPU-only machine, into
the code we intend: TF32 wgmma (m64nNk8 .f32.tf32.tf32) with B from TMA-loaded tiles, three
products per GEMM, register reallocation, no spills and no ptxas C751x advisory (see
test_compile_sm90_fwd.py for what each means), and its prepass. And dispatch routes exactly the
fp32 problems it serves to it."""

import dataclasses
import re

import pytest
import torch

import cutlass

from cute_flash import compile_report as compile_report_module
from cute_flash import dispatch
from cute_flash.compile_report import compile_report
from cute_flash.kernels.sm90.config import (
    Sm90Tf32FwdConfig, tf32_can_implement, tf32_forward_config, tf32_smem_bytes,
)
from cute_flash.kernels.sm90.fwd_tf32 import FlashAttnFwdSm90Tf32
from cute_flash.kernels.sm90.fwd_tf32_prep import key_of_column, padded_seqlen_k

from .test_compile_sm90_fwd import expect_tx_bytes

VARIANTS = [(64, False), (64, True), (128, False), (128, True)]


def _wgmma_counts(ptx: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for shape in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k8)\.f32\.tf32\.tf32", ptx):
        counts[shape] = counts.get(shape, 0) + 1
    return counts


# The other configurations, beside the dispatched kernels (overlap at d64, not at d128; a PV
# accumulator per block except at d128 causal), each as measured 2026-11-29 on an H200
# (perf/results/h200-20261129-run5.md, h200-20261129-run6.md): the next S GEMM issued with the PV
# GEMM (overlap), the warp groups' GEMMs in turns (pingpong), PV straight into O (no block_accumulator).
_SHARED_O = dict(block_accumulator=False)
CANDIDATES = [
    (128, False, dict(overlap=True, **_SHARED_O)), (128, True, dict(overlap=True)),
    (64, False, dict(overlap=False, **_SHARED_O)), (64, True, dict(overlap=False, **_SHARED_O)),
    (128, False, dict(overlap=True, pingpong=True, **_SHARED_O)), (128, True, dict(overlap=True, pingpong=True)),
    (64, False, dict(pingpong=True, **_SHARED_O)), (64, True, dict(pingpong=True, **_SHARED_O)),
    (64, False, _SHARED_O), (64, True, _SHARED_O), (128, False, _SHARED_O),
]


@pytest.mark.parametrize("head_dim,causal,changes", [(d, c, None) for d, c in VARIANTS] + CANDIDATES,
                         ids=[f"d{d}-{'causal' if c else 'full'}" for d, c in VARIANTS]
                         + [f"d{d}-{'causal' if c else 'full'}-" + "-".join(f"{k}={v}" for k, v in ch.items())
                            for d, c, ch in CANDIDATES])
def test_sm90_tf32_fwd_compiles_to_tma_wgmma_without_spills(head_dim, causal, changes, monkeypatch):
    plan = dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132)
    assert plan.kernel_cls is FlashAttnFwdSm90Tf32 and plan.arch == "sm_90a"
    config = plan.config if changes is None else dataclasses.replace(plan.config, **changes)
    assert tf32_can_implement(config)
    logs = []
    parse = compile_report_module._parse
    monkeypatch.setattr(compile_report_module, "_parse", lambda log: (logs.append(log), parse(log))[1])
    report = compile_report(FlashAttnFwdSm90Tf32(config), plan.fake_args, arch="sm_90a")
    # Only TF32 wgmma, m64 x tile_n for S and m64 x head_dim for O, and no conversion instruction:
    # the raw fp32 words are the operands' hi parts.
    counts = _wgmma_counts(report.ptx)
    assert sum(counts.values()) == len(re.findall(r"wgmma\.mma_async", report.ptx))
    # Three products per GEMM: S over head_dim / 8 k steps, O over tile_n / 8, per copy of the block
    # code (the first block, the masked blocks with causal, the unmasked ones).
    copies = 3 if causal else 2
    expected = {f"m64n{config.tile_n}k8": 3 * head_dim // 8 * copies}
    pv = f"m64n{head_dim}k8"
    expected[pv] = expected.get(pv, 0) + 3 * config.tile_n // 8 * copies
    assert counts == expected
    assert not re.search(r"cvt\.\w*\.tf32", report.ptx)
    assert "cp.async.bulk.tensor" in report.ptx
    assert "setmaxnreg" in report.ptx
    assert "griddepcontrol.wait" in report.ptx
    # Q's TMA announces the whole fp32 tile, a K or V stage its two tiles (hi and lo).
    tile_bytes = 4 * config.tile_n * head_dim
    assert expect_tx_bytes(report.ptx) == {4 * config.tile_m * head_dim, 2 * tile_bytes}
    # O leaves from registers in 8-byte stores.
    assert "st.global.v2.b32" in report.ptx
    # Ping-pong: a named barrier per warp group's turn (bar.sync / bar.arrive on ids 4 and 5).
    assert bool(re.search(r"bar(rier)?\.(sync|arrive)[\w.]*\s+[45],", report.ptx)) == config.pingpong
    assert report.spill_bytes == 0, f"{report.spill_bytes} bytes spilled"
    assert logs, "no ptxas log"
    advisories = re.findall(r"\((C751\d)\)", logs[0])
    assert not advisories, f"ptxas serialized or waited for wgmma instructions: {advisories}"


def test_prepass_compiles_alone():
    """The prepass is the first launch of the same jit function; compiled by itself it reads K, V
    and writes K_lo, V^T, V^T_lo with plain 32-bit accesses."""

    kernel = FlashAttnFwdSm90Tf32(tf32_forward_config(128, False))
    args = dispatch.fake_tf32_forward_args(128)
    k, v, k_lo, vt, vt_lo, stream = args[1], args[2], args[5], args[6], args[7], args[-1]
    report = compile_report(kernel.prepass, (k, v, k_lo, vt, vt_lo, stream), arch="sm_90a")
    assert "wgmma" not in report.ptx
    assert report.spill_bytes == 0
    assert "ld.global" in report.ptx and "st.global" in report.ptx and "bar.sync" in report.ptx


def test_key_permutation_matches_the_fragments():
    """Column j of a group of 8 in V^T holds key 2j (j < 4) or 2(j - 4) + 1: the TF32 A fragment's
    k index t + 4h (thread t, half h) then names the key 2t + h that the S accumulator gives
    thread t in its column pair h."""
    assert [key_of_column(j) for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    for t in range(4):
        for h in range(2):
            assert key_of_column(t + 4 * h) == 2 * t + h
    assert [padded_seqlen_k(n) for n in (1, 8, 9, 203, 4096)] == [8, 8, 16, 208, 4096]


def test_configs_fit_and_dispatch_routes_only_what_they_serve():
    for head_dim in (64, 128):
        for causal in (False, True):
            config = tf32_forward_config(head_dim, causal)
            assert tf32_can_implement(config) and tf32_smem_bytes(config) <= 227 * 1024
            plan = dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132)
            assert plan.family == "sm90" and plan.config == config
            # plain TF32 (one product), score modifications, dropout, packed batches: the sm80 kernels
            assert dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132,
                                         tf32_products=1).family == "sm80"
            assert dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132,
                                         mods=(False, True, False)).family == "sm80"
            assert dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132,
                                         dropout=True).family == "sm80"
            assert dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, num_sms=132,
                                         varlen=True).family == "sm80"
            assert dispatch.plan_forward((8, 0), torch.float32, head_dim, causal).family == "sm80"
            assert dispatch.plan_forward((9, 0), torch.float32, head_dim, causal, family="sm80").family == "sm80"
    for head_dim in (32, 96, 256):
        assert tf32_forward_config(head_dim, False) is None
        assert dispatch.plan_forward((9, 0), torch.float32, head_dim, False, num_sms=132).family == "sm80"
    assert not tf32_can_implement(Sm90Tf32FwdConfig(128, False, tile_n=64, num_stages=2))  # 256 KB
    assert not tf32_can_implement(Sm90Tf32FwdConfig(96, False))
    assert not tf32_can_implement(Sm90Tf32FwdConfig(64, False, tile_n=48))  # V^T rows of 32-word atoms
    assert not tf32_can_implement(Sm90Tf32FwdConfig(64, False, pingpong=True))  # turns only with overlap
    assert not tf32_can_implement(Sm90Tf32FwdConfig(128, True, block_accumulator=True))  # spills
    assert tf32_forward_config(64, False).overlap and not tf32_forward_config(128, False).overlap
    assert [tf32_forward_config(d, c).block_accumulator for d, c in VARIANTS] == [True, True, True, False]
