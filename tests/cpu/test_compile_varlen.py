"""The packed variable-length variants (config.varlen, the `call_varlen` entry points) compile
without a GPU to the instructions they are built from, without spills, through the plans dispatch
makes for them: the Hopper forward on sm_90 (every head dim it serves, causal or not, with score
modifications), the sm80 forward elsewhere and for fp32, the sm80 backward on every GPU. The dense
kernels' PTX is unchanged by the switch (scripts/ptx-hashes.py; docs/kernels/sm80-forward.md,
docs/kernels/sm90-forward.md)."""

import pytest
import torch

from cute_flash import dispatch
from cute_flash.compile_report import compile_report

# (pass, mods (window, softcap, alibi), dtype, head dim, causal, deterministic, gqa, capability)
VARIANTS = [
    ("fwd", (True, True, False), torch.float16, 64, False, False, False, (8, 0)),
    ("fwd", (False, False, False), torch.float32, 128, False, False, False, (8, 0)),
    ("bwd", (False, False, False), torch.bfloat16, 128, True, False, False, (8, 0)),
    ("bwd", (True, True, True), torch.float16, 64, False, True, True, (8, 0)),
    ("bwd", (False, False, False), torch.float32, 64, True, False, False, (8, 0)),
]


def _id(v):
    flags = "".join(name for name, on in zip(("window", "softcap", "alibi"), v[1]) if on) or "plain"
    return f"{v[0]}-{flags}-{str(v[2])[6:]}-d{v[3]}-{'causal' if v[4] else 'full'}{'-det' if v[5] else ''}" \
           f"{'-gqa' if v[6] else ''}-sm{v[7][0]}0"


def _check(plan, mma, family="sm80"):
    assert plan.family == family and plan.entry == "call_varlen" and plan.config.varlen
    kernel, args = plan.build()
    report = compile_report(kernel, args, arch=plan.arch)
    assert report.spill_bytes == 0, \
        f"{plan.kernel_cls.__name__}: {report.registers} registers, {report.spill_bytes} B spilled"
    if mma:
        assert mma in report.ptx
    return report


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_varlen_kernels_compile_without_spills(variant):
    pass_name, mods, dtype, head_dim, causal, deterministic, gqa, capability = variant
    mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" if dtype is torch.float32 else \
        "mma.sync.aligned.m16n8k16.row.col.f32"
    if pass_name == "fwd":
        plan = dispatch.plan_forward(capability, dtype, head_dim, causal, num_sms=132, mods=mods,
                                     varlen=True)
        report = _check(plan, mma)
        assert "cp.async.cg.shared.global" in report.ptx and "ex2.approx" in report.ptx
        return
    plans = dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods=mods, varlen=True)
    # each sequence's dQ workspace rows zeroed in 16-byte vectors (its packed offset is a multiple of 128 rows)
    assert "st.global.v4" in _check(plans.pre, None).ptx
    report = _check(plans.main, mma)
    assert "red." in report.ptx and ".add.f32" in report.ptx  # dQ into the workspace
    _check(plans.post, None)


# The Hopper forward: (mods (window, softcap, alibi), dtype, head dim, causal)
HOPPER_FORWARD_VARIANTS = [
    ((False, False, False), torch.bfloat16, 128, False),
    ((False, False, False), torch.bfloat16, 128, True),
    ((True, True, False), torch.float16, 64, False),
    ((False, False, True), torch.bfloat16, 96, True),
    ((False, False, False), torch.bfloat16, 192, False),
    ((False, True, False), torch.float16, 256, True),
]


@pytest.mark.parametrize("variant", HOPPER_FORWARD_VARIANTS,
                         ids=lambda v: _id(("fwd", v[0], v[1], v[2], v[3], False, False, (9, 0))))
def test_hopper_varlen_forward_compiles_without_spills(variant):
    """wgmma and TMA loads as the dense kernel; O leaves from registers (st.global, no TMA store:
    a box would cross into the next sequence's rows); the sequence bounds are read from cu_seqlens."""
    mods, dtype, head_dim, causal = variant
    plan = dispatch.plan_forward((9, 0), dtype, head_dim, causal, family="sm90", num_sms=132, mods=mods, varlen=True)
    report = _check(plan, "wgmma.mma_async", family="sm90")
    assert plan.config.o_from_registers and not plan.config.splits_tail and not plan.config.planned_tail
    assert "cp.async.bulk.tensor" in report.ptx and "global.shared" not in report.ptx
    assert "st.global.v4" in report.ptx


# The Hopper backward: (mods, dtype, head dim, causal, deterministic)
HOPPER_BACKWARD_VARIANTS = [
    ((False, False, False), torch.bfloat16, 128, False, False),
    ((False, False, False), torch.bfloat16, 128, False, True),
    ((False, False, False), torch.float16, 64, True, False),
    ((True, True, True), torch.float16, 64, False, False),
    ((False, False, False), torch.bfloat16, 96, True, True),
    ((False, False, False), torch.bfloat16, 128, True, False),
    ((False, False, False), torch.float16, 128, True, True),
    ((True, False, True), torch.bfloat16, 128, False, False),
    ((False, False, False), torch.float16, 192, True, False),
    ((True, True, False), torch.bfloat16, 256, False, True),
]


@pytest.mark.parametrize("variant", HOPPER_BACKWARD_VARIANTS,
                         ids=lambda v: _id(("bwd", v[0], v[1], v[2], v[3], v[4], True, (9, 0))))
def test_hopper_varlen_backward_compiles_without_spills(variant):
    """The main kernel and its postprocess: wgmma, dQ's bulk reduce, TMA loads; dK and dV by
    16-byte stores (no TMA store: a box would cross into the next sequence's rows)."""
    mods, dtype, head_dim, causal, deterministic = variant
    plans = dispatch.plan_backward((9, 0), dtype, head_dim, causal, deterministic, True, family="sm90", mods=mods,
                                   varlen=True)
    report = _check(plans.main, "wgmma.mma_async", family="sm90")
    assert "cp.reduce.async.bulk" in report.ptx and "cp.async.bulk.tensor" in report.ptx
    assert "global.shared" not in report.ptx.replace("cp.reduce.async.bulk.global.shared", "")
    assert "st.global.v4" in report.ptx
    _check(plans.post, None, family="sm90")
    assert plans.pre.family == "sm80" and plans.pre.entry == "call_varlen" and not plans.gqa


def test_hopper_varlen_backward_takes_a_plain_window_at_hd128_on_64_keys_per_cta():
    # 128 keys per CTA spill 32 bytes per MMA thread there (kernels/sm90/config.py: backward_config)
    plans = dispatch.plan_backward((9, 0), torch.bfloat16, 128, False, False, False, family="sm90",
                                   mods=(True, False, False), varlen=True)
    assert plans.main.config.n_block_size == 64 and plans.main.config.split_head_dim
    _check(plans.main, "wgmma.mma_async", family="sm90")


def test_dense_plans_keep_their_entries():
    assert dispatch.plan_forward((8, 0), torch.bfloat16, 128, True, family="sm80").entry is None
    dense = dispatch.plan_backward((8, 0), torch.bfloat16, 128, True, family="sm80")
    assert (dense.pre.entry, dense.main.entry, dense.post.entry) == (None, None, None)
    assert not dense.main.config.varlen and not dense.pre.config.varlen and not dense.post.config.varlen
    # the Hopper forward serves varlen at its dtypes and head dims; fp32 and other head dims the sm80
    assert dispatch.plan_forward((9, 0), torch.bfloat16, 128, False, family="sm90", num_sms=132,
                                 varlen=True).family == "sm90"
    assert dispatch.plan_forward((9, 0), torch.float32, 128, False, family="sm90", num_sms=132,
                                 varlen=True).family == "sm80"
    assert dispatch.plan_forward((9, 0), torch.bfloat16, 72, False, family="sm90", num_sms=132,
                                 varlen=True).family == "sm80"
