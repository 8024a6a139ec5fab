"""The sm80 kernels with sliding windows, softcap and ALiBi compile (no GPU needed) without spills,
through the plans dispatch makes for them: on every GPU (the Hopper family included) such a call
is planned on the sm80 kernels' `call_with_mods` entry point. That the plain kernels' PTX is
unchanged by these switches is shown with scripts/ptx-hashes.py (docs/kernels/sm80-forward.md)."""

import pytest
import torch

from cute_flash import dispatch
from cute_flash.compile_report import compile_report

# (pass, mods (window, softcap, alibi), dtype, head dim, causal, deterministic, gqa, capability)
VARIANTS = [
    ("fwd", (True, True, True), torch.bfloat16, 128, False, False, False, (8, 0)),
    ("fwd", (True, False, False), torch.float16, 64, False, False, False, (8, 0)),
    ("fwd", (False, True, False), torch.bfloat16, 72, True, False, False, (9, 0)),
    ("fwd", (False, False, True), torch.float16, 256, True, False, False, (9, 0)),
    # d128 on sm_80 reads P back from smem: softcap's factor waits in dS's tile
    ("bwd", (True, True, True), torch.bfloat16, 128, False, False, False, (8, 0)),
    # on sm_90a the fp32 P stays in registers: the factor is folded into it
    ("bwd", (True, True, True), torch.bfloat16, 128, False, True, True, (9, 0)),
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
        plan = dispatch.plan_forward(capability, dtype, head_dim, causal, family="sm90", num_sms=132, mods=mods)
    else:
        plan = dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, family="sm90",
                                      mods=mods).main
    assert plan.family == "sm80" and plan.entry == "call_with_mods"
    assert (plan.config.window, plan.config.softcap, plan.config.alibi) == mods
    kernel, args = plan.build()
    report = compile_report(kernel, args, arch=plan.arch)
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in report.ptx
    if mods[1]:
        assert "rcp.approx" in report.ptx  # tanh from ex2 and rcp
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


def test_plain_plans_keep_their_entry_and_family():
    plan = dispatch.plan_forward((9, 0), torch.bfloat16, 128, True, family="sm90", num_sms=132)
    assert plan.family == "sm90" and plan.entry is None
    main = dispatch.plan_backward((8, 0), torch.bfloat16, 128, True, family="sm80").main
    assert main.entry is None and not main.config.has_mods


def test_a_causal_window_is_planned_as_a_window():
    with pytest.raises(ValueError, match="right = 0"):
        dispatch.plan_forward((8, 0), torch.float16, 64, True, family="sm80", mods=(True, False, False))
