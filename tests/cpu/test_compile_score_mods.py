"""The kernels with sliding windows, softcap and ALiBi compile (no GPU needed) without spills,
through the plans dispatch makes for them: the sm80 kernels' `call_with_mods` entry point on every
GPU, but for fp16 / bf16 at the Hopper kernels' head dims on sm_90, which the Hopper forward's
`call_with_mods` serves here (the Hopper backward's: test_compile_sm90_bwd.py). That the plain
kernels' PTX is unchanged by these switches is shown with scripts/ptx-hashes.py
(docs/kernels/sm80-forward.md, docs/kernels/sm90-forward.md)."""

import re

import pytest
import torch

from cute_flash import compile_report as compile_report_module
from cute_flash import dispatch
from cute_flash.compile_report import compile_report

# (pass, mods (window, softcap, alibi), dtype, head dim, causal, deterministic, gqa, capability)
VARIANTS = [
    ("fwd", (True, True, True), torch.bfloat16, 128, False, False, False, (8, 0)),
    ("fwd", (True, False, False), torch.float16, 64, False, False, False, (8, 0)),
    ("fwd", (False, True, False), torch.bfloat16, 72, True, False, False, (9, 0)),
    ("fwd", (False, False, True), torch.float16, 256, True, False, False, (8, 0)),
    # d128 on sm_80 reads P back from smem: softcap's factor waits in dS's tile
    ("bwd", (True, True, True), torch.bfloat16, 128, False, False, False, (8, 0)),
    # on sm_90a (head dims the Hopper backward does not take) the fp32 P stays in registers: the
    # factor is folded into it
    ("bwd", (True, True, True), torch.bfloat16, 120, False, True, True, (9, 0)),
    ("bwd", (True, False, False), torch.float16, 64, False, True, False, (8, 0)),
    ("bwd", (False, False, True), torch.bfloat16, 72, True, False, True, (9, 0)),
]


def _id(v):
    flags = "".join(name for name, on in zip(("window", "softcap", "alibi"), v[1]) if on)
    return f"{v[0]}-{flags}-{str(v[2])[6:]}-d{v[3]}-{'causal' if v[4] else 'full'}{'-det' if v[5] else ''}" \
           f"{'-gqa' if v[6] else ''}-sm{v[7][0]}0"


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_modified_kernels_compile_without_spills(variant):
    pass_name, mods, dtype, head_dim, causal, deterministic, gqa, capability = variant
    if pass_name == "fwd":
        # the GPU's own family: on sm_90 the Hopper forward's (head dim 72: none, so sm80)
        plan = dispatch.plan_forward(capability, dtype, head_dim, causal, num_sms=132, mods=mods)
    else:
        # the GPU's own family: these (softcap, head dim 72, sm_80) are the sm80 backward's
        plan = dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods=mods).main
    assert plan.family == "sm80" and plan.entry == "call_with_mods"
    assert (plan.config.window, plan.config.softcap, plan.config.alibi) == mods
    kernel, args = plan.build()
    report = compile_report(kernel, args, arch=plan.arch)
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    if mods[1]:
        assert "rcp.approx" in report.ptx  # tanh from ex2 and rcp
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


# The Hopper forward's modified variants, through dispatch's plans (capability 9.0, 132 SMs):
# (mods, dtype, head dim, causal, length class), one per setting a modification meets: three
# consumer warp groups (long d64 / d96 / d128), two Q stages, per-group and TMA O stores, O from
# registers (short d256), the planned causal walk, stale and lazy softmax forms.
SM90_VARIANTS = [
    ((True, True, True), torch.bfloat16, 128, False, "long"),
    ((True, False, False), torch.float16, 64, False, "long"),
    ((False, True, True), torch.bfloat16, 64, True, "short"),
    ((False, False, True), torch.float16, 256, True, "long"),
    ((True, False, False), torch.bfloat16, 256, False, "short"),
    ((False, True, False), torch.float16, 192, False, "long"),
    ((True, True, False), torch.bfloat16, 96, False, "short_2k"),
    ((False, True, False), torch.float16, 128, True, "short"),
    ((True, False, True), torch.bfloat16, 128, False, "short_512"),
    # three-group classes that causal ALiBi / softcap at hd 64 move to 128-row tiles (they spill on 192)
    ((False, False, True), torch.bfloat16, 128, True, "long"),
    ((False, False, True), torch.float16, 96, True, "short_2k"),
    ((False, True, False), torch.bfloat16, 64, False, "long"),
    ((False, True, True), torch.float16, 64, True, "mid"),
    ((False, False, True), torch.bfloat16, 256, True, "mid"),  # O stored by all groups together
]


def _leaves_three_groups(mods, head_dim, causal) -> bool:
    return (mods[2] and causal) or (mods[1] and head_dim <= 64)


def _sm90_id(v):
    flags = "".join(name for name, on in zip(("window", "softcap", "alibi"), v[0]) if on)
    return f"{flags}-{str(v[1])[6:]}-d{v[2]}-{'causal' if v[3] else 'full'}-{v[4]}"


@pytest.mark.parametrize("variant", SM90_VARIANTS, ids=_sm90_id)
def test_hopper_forward_with_modifications_compiles_to_wgmma_without_spills(variant, monkeypatch):
    mods, dtype, head_dim, causal, length = variant
    plan = dispatch.plan_forward((9, 0), dtype, head_dim, causal, length, num_sms=132, mods=mods)
    assert plan.family == "sm90" and plan.entry == "call_with_mods"
    config = plan.config
    assert (config.window, config.softcap, config.alibi) == mods
    # The class's own settings with the switches on (128-row tiles where three groups would spill);
    # a window walks no causal order and splits no tail.
    plain = dispatch.plan_forward((9, 0), dtype, head_dim, causal, length, num_sms=132).config
    settings = {**plan.settings(), "window": False, "softcap": False, "alibi": False}
    if plain.tile_m == 192 and _leaves_three_groups(mods, head_dim, causal):
        assert config.tile_m == 128 and config.tile_n == 128
        settings.update(tile_m=plain.tile_m, tile_n=plain.tile_n)
    if mods[2] and causal and head_dim > 192 and length == "mid":
        assert not config.wg_epilogue  # and with it no per-group Q (create resolves it off)
        settings.update(wg_epilogue=plain.wg_epilogue, q_by_group=plain.q_by_group)
    if mods[2]:  # ALiBi's rising row max would overflow a stale max every few blocks
        assert not config.stale_max
        settings.update(stale_max=plain.stale_max, lazy_rescale=plain.lazy_rescale)
    assert type(config)(**settings) == plain
    if mods[0]:
        assert not config.splits_tail and config.tile_order == "none" and not config.planned_tail
    logs = []
    parse = compile_report_module._parse
    monkeypatch.setattr(compile_report_module, "_parse", lambda log: (logs.append(log), parse(log))[1])
    kernel, args = plan.build()
    report = compile_report(kernel, args, arch=plan.arch)
    assert "wgmma.mma_async" in report.ptx and "cp.async.bulk.tensor" in report.ptx and "setmaxnreg" in report.ptx
    if mods[1]:
        # tanh from ex2 and rcp on every score of S, at least once per S fragment element
        assert report.ptx.count("rcp.approx") >= config.tile_n // 2
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"
    advisories = re.findall(r"\((C751\d)\)", logs[0])
    assert not advisories, f"ptxas serialized or waited for wgmma instructions: {advisories}"


def test_plain_plans_keep_their_entry_and_family():
    plan = dispatch.plan_forward((9, 0), torch.bfloat16, 128, True, family="sm90", num_sms=132)
    assert plan.family == "sm90" and plan.entry is None
    main = dispatch.plan_backward((8, 0), torch.bfloat16, 128, True, family="sm80").main
    assert main.entry is None and not main.config.has_mods


def test_a_causal_window_is_planned_as_a_window():
    for capability in ((8, 0), (9, 0)):
        with pytest.raises(ValueError, match="right = 0"):
            dispatch.plan_forward(capability, torch.float16, 64, True, num_sms=132, mods=(True, False, False))


def test_modified_calls_on_hopper_plan_the_hopper_kernels_that_have_them():
    """fp16 / bf16 at the Hopper forward's head dims: its forward for every length class (a
    configuration it can implement); the Hopper backward at its head dims, every modification;
    fp32 and other head dims: sm80."""
    from cute_flash.kernels.sm90.config import BWD_HEAD_DIMS, HEAD_DIMS, can_implement

    for mods in ((True, False, False), (False, True, False), (False, False, True), (True, True, True)):
        for head_dim in (64, 72, 96, 128, 160, 192, 256):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                hopper = head_dim in HEAD_DIMS and dtype != torch.float32
                for causal in ((False,) if mods[0] else (False, True)):
                    for length in dispatch.length_classes(causal):
                        plan = dispatch.plan_forward((9, 0), dtype, head_dim, causal, length, num_sms=132, mods=mods)
                        assert plan.family == ("sm90" if hopper else "sm80") and plan.entry == "call_with_mods"
                        if hopper:
                            assert can_implement(plan.config)
                        if hopper and mods[0]:
                            assert not plan.config.splits_tail
                    backward = dispatch.plan_backward((9, 0), dtype, head_dim, False, mods=mods)
                    hopper_backward = head_dim in BWD_HEAD_DIMS and dtype != torch.float32
                    assert backward.main.family == ("sm90" if hopper_backward else "sm80")
                # CUTE_FLASH_KERNEL_ARCH=sm80's family: sm80 forward too
                forced = dispatch.plan_forward((9, 0), dtype, head_dim, False, "long", num_sms=132, family="sm80",
                                               mods=mods)
                assert forced.family == "sm80"
