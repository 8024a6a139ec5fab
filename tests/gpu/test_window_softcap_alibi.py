"""Sliding windows, softcap and ALiBi on the GPU: forward and backward against the float64
reference with the same window, cap and bias, within the yardstick (tests/gpu/common.py).

A modified forward runs the forward of the GPU's family where that family serves the dtype and
head dim (the Hopper forward on an H100 for fp16 / bf16 at 64, 96, 128, 192, 256; the sm80 one
otherwise, and under CUTE_FLASH_KERNEL_ARCH=sm80). A modified backward runs the Hopper backward
for fp16 / bf16 at 64, 96, 128, 192 and 256 with any modification, the sm80 one otherwise (other
head dims, other GPUs).
Modifications that change nothing (a window wider than both sequences, a causal window unbounded
on the left) run the plain kernels of the GPU's family. `python -m tests.gpu.test_window_softcap_alibi
--warm` compiles every kernel the tests below run into the disk cache, several at once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cute_flash

from cute_flash import dispatch
from cute_flash.validate import score_mods

from .common import (
    assert_backward_accurate, assert_forward_accurate, expected_backward_family, expected_forward_family,
    families_of, kernels_used, randn, served_by,
)

pytestmark = pytest.mark.gpu

WINDOWS = [(0, 0), (17, 0), (128, 128), (-1, 64)]
SHAPES = [(1, 1), (113, 203), (640, 77), (1000, 1000), (517, 1500)]
# (dtype, head dim, nheads, nheads_kv): both dtypes, 64 and 128, an odd (padded) head dim, GQA
CONFIGS = [(torch.float16, 64, 4, 4), (torch.bfloat16, 128, 4, 2), (torch.bfloat16, 72, 2, 1)]


def inputs(config, sq, sk, batch=2):
    dtype, head_dim, nheads, nheads_kv = config
    q = randn(batch, sq, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, sk, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, randn(batch, sq, nheads, head_dim, dtype=dtype)


def slopes(batch, nheads, per_batch):
    """ALiBi's geometric slopes (2^-8/n ... as in the paper), per batch row shuffled a little."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], device="cuda")
    return base * torch.rand(batch, 1, device="cuda").add(0.5) if per_batch else base


def kernel_problem(sq, sk, causal, mods):
    """(causal, (window, softcap, ALiBi) flags) of the kernels a call runs (validate.score_mods)."""
    kernel = score_mods(causal, tuple(mods.get("window_size", (-1, -1))), mods.get("softcap", 0.0),
                        mods.get("alibi_slopes"), sq, sk)
    return kernel.causal, kernel.flags


def families(head_dim, dtype):
    """The kernel families of the forward and the backward: each plain kernel's own (the Hopper
    kernels serve every modification at the head dims they take)."""
    return expected_forward_family(head_dim, dtype, plain=False), expected_backward_family(head_dim, dtype)


def check(q, k, v, dout, causal, deterministic=False, **mods):
    """Forward and backward into NaN-poisoned outputs, on the expected kernels, against the reference."""
    forward_family, backward_family = families(q.shape[-1], q.dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    with served_by(forward_family):
        cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal, **mods)
    assert_forward_accurate(out, lse, q, k, v, causal, **mods)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    with served_by(backward_family):
        cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=causal,
                            deterministic=deterministic, **mods)
    assert_backward_accurate(grads, dout, q, k, v, causal, **mods)
    return out, grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("sq, sk", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-h{c[2]}/{c[3]}")
def test_window(config, sq, sk, window, causal):
    q, k, v, dout = inputs(config, sq, sk)
    check(q, k, v, dout, causal, window_size=window)


@pytest.mark.parametrize("window", [(128, 128), (-1, 64), (1000, 0)], ids=str)
def test_window_2048(window):
    q, k, v, dout = inputs((torch.bfloat16, 128, 2, 1), 2048, 2048, batch=1)
    check(q, k, v, dout, False, window_size=window)


# Past 2048 keys: the long and mid length classes (the Hopper forward's three-warp-group tiles, its
# dynamic schedule and stale-max softmax; a window of 1024 as in the benchmark's band).
LONG_MODS = [{"window_size": (1024, 0)}, {"window_size": (300, 77)}, {"softcap": 30.0}, {"alibi_slopes": True}]
LONG_CONFIGS = [(torch.bfloat16, 128, 2, 1), (torch.float16, 64, 2, 2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", LONG_MODS, ids=lambda m: "-".join(m))
@pytest.mark.parametrize("config", LONG_CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_long_rows(config, mods, causal):
    q, k, v, dout = inputs(config, 3000, 3100, batch=1)
    if "alibi_slopes" in mods:
        mods = {"alibi_slopes": slopes(1, config[2], False)}
    check(q, k, v, dout, causal, **mods)


# The Hopper forward's other head dims, all three modifications, a short and a long length class.
OTHER_HEAD_DIMS = [(torch.bfloat16, 96, 2, 2), (torch.float16, 192, 2, 1), (torch.bfloat16, 256, 2, 2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(700, 900), (2500, 2600)], ids=str)
@pytest.mark.parametrize("config", OTHER_HEAD_DIMS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_other_head_dims(config, sq, sk, causal):
    q, k, v, dout = inputs(config, sq, sk, batch=1)
    check(q, k, v, dout, causal, window_size=(96, 33), softcap=20.0, alibi_slopes=slopes(1, config[2], True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 203), (1000, 1000), (517, 1500)], ids=str)
@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_softcap(config, sq, sk, softcap, causal):
    q, k, v, dout = inputs(config, sq, sk)
    # scores large enough that the cap bends them (|q.k| * scale up to ~30 at softcap 5)
    check(q * 3, k, v, dout, causal, softcap=softcap)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 203), (640, 77), (1000, 1000)], ids=str)
@pytest.mark.parametrize("config", [(torch.bfloat16, 64, 4, 2), (torch.float16, 128, 4, 4)],
                         ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_alibi(config, sq, sk, per_batch, causal):
    q, k, v, dout = inputs(config, sq, sk)
    check(q, k, v, dout, causal, alibi_slopes=slopes(2, config[2], per_batch))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_all_three(config, causal, deterministic):
    q, k, v, dout = inputs(config, 700, 900)
    mods = dict(window_size=(96, 33), softcap=20.0, alibi_slopes=slopes(2, config[2], True))
    _, grads = check(q, k, v, dout, causal, deterministic, **mods)
    if deterministic:  # the window's dQ order: bit-identical again
        _, again = check(q, k, v, dout, causal, deterministic, **mods)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("mods", [{"window_size": (96, 33)}, {"window_size": (300, 0), "alibi_slopes": True}],
                         ids=lambda m: "-".join(m))
@pytest.mark.parametrize("config", [(torch.float16, 64, 4, 2), (torch.bfloat16, 128, 4, 1)],
                         ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}")
def test_deterministic_window_without_softcap(config, mods):
    """Without softcap the Hopper backward serves windows on an H100: its dQ turns count from the
    window's first key block, so a query block's adds come in order and repeat bit for bit."""
    q, k, v, dout = inputs(config, 900, 1300)
    if "alibi_slopes" in mods:
        mods = dict(mods, alibi_slopes=slopes(2, config[2], True))
    _, grads = check(q, k, v, dout, False, True, **mods)
    _, again = check(q, k, v, dout, False, True, **mods)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_flash_attn_func_autograd():
    """The custom ops carry the modifications to both passes (torch.autograd, the flash-attn signature)."""
    q, k, v, dout = inputs((torch.bfloat16, 128, 4, 2), 333, 444)
    mods = dict(window_size=(50, 10), softcap=30.0, alibi_slopes=slopes(2, 4, False))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with kernels_used() as keys:
        out, lse, _ = cute_flash.flash_attn_func(*leaves, 0.0, None, True, (50, 10), 30.0, mods["alibi_slopes"],
                                                 False, True)
        out.backward(dout)
    assert families_of(keys) == set(families(128, q.dtype)), keys
    assert_forward_accurate(out.detach(), lse, q, k, v, True, **mods)
    assert_backward_accurate([t.grad for t in leaves], dout, q, k, v, True, **mods)


def test_zero_scale_with_mods():
    """softmax_scale = 0 (uniform scores) keeps the cap (of zero) and the bias."""
    q, k, v, dout = inputs((torch.float16, 64, 4, 4), 200, 300)
    check(q, k, v, dout, False, softmax_scale=0.0, window_size=(40, 40), softcap=10.0,
          alibi_slopes=slopes(2, 4, False))


# --- --warm: every kernel the tests above run --------------------------------------------------

def _cases():
    """(dtype name, head dim, gqa, sq, sk, causal, mods without tensors, deterministic) of every test."""
    for config in CONFIGS:
        for (sq, sk), window, causal in itertools.product(SHAPES, WINDOWS, (False, True)):
            yield config, sq, sk, causal, {"window_size": window}, False
        for causal, det in itertools.product((False, True), (False, True)):
            yield config, 700, 900, causal, {"window_size": (96, 33), "softcap": 20.0, "alibi_slopes": True}, det
    for window in [(128, 128), (-1, 64), (1000, 0)]:
        yield (torch.bfloat16, 128, 2, 1), 2048, 2048, False, {"window_size": window}, False
    for config, mods, causal in itertools.product(LONG_CONFIGS, LONG_MODS, (False, True)):
        yield config, 3000, 3100, causal, mods, False
    every = {"window_size": (96, 33), "softcap": 20.0, "alibi_slopes": True}
    for config, (sq, sk), causal in itertools.product(OTHER_HEAD_DIMS, [(700, 900), (2500, 2600)], (False, True)):
        yield config, sq, sk, causal, every, False
    for config, (sq, sk), causal in itertools.product(CONFIGS[:2], [(1, 1), (113, 203), (1000, 1000), (517, 1500)],
                                                      (False, True)):
        yield config, sq, sk, causal, {"softcap": 5.0}, False
    for config, (sq, sk), causal in itertools.product([(torch.bfloat16, 64, 4, 2), (torch.float16, 128, 4, 4)],
                                                      [(1, 1), (113, 203), (640, 77), (1000, 1000)], (False, True)):
        yield config, sq, sk, causal, {"alibi_slopes": True}, False
    every = {"window_size": (50, 10), "softcap": 30.0, "alibi_slopes": True}
    yield (torch.bfloat16, 128, 4, 2), 333, 444, True, every, False
    yield (torch.float16, 64, 4, 4), 200, 300, False, dict(every, window_size=(40, 40)), False
    for config in [(torch.float16, 64, 4, 2), (torch.bfloat16, 128, 4, 1)]:
        yield config, 900, 1300, False, {"window_size": (96, 33)}, True
        yield config, 900, 1300, False, {"window_size": (300, 0), "alibi_slopes": True}, True


def _jobs():
    jobs = set()
    for (dtype, head_dim, nheads, nheads_kv), sq, sk, causal, mods, det in _cases():
        kernel_causal, flags = kernel_problem(sq, sk, causal, mods)
        # the Hopper forward compiles per length class, modified or not (the sm80 one ignores it)
        length = dispatch.length_class(sk, kernel_causal)
        jobs.add(("fwd", str(dtype), head_dim, kernel_causal, length, flags))
        jobs.add(("bwd", str(dtype), head_dim, kernel_causal, (det, nheads != nheads_kv), flags))
    return sorted(jobs, key=str)


def _compile(job):
    from cute_flash import device

    pass_name, dtype, head_dim, causal, extra, flags = job
    dtype = getattr(torch, dtype.split(".")[-1])
    capability = torch.cuda.get_device_capability()
    if pass_name == "fwd":
        plans = [dispatch.plan_forward(capability, dtype, head_dim, causal, extra, device.sm_count(0), mods=flags)]
    else:
        plan = dispatch.plan_backward(capability, dtype, head_dim, causal, *extra, mods=flags)
        plans = [plan.pre, plan.main, plan.post]
    for plan in plans:
        plan.compiled()
    return job


if __name__ == "__main__":  # python -m tests.gpu.test_window_softcap_alibi --warm: compile the tests' kernels in parallel
    import sys

    from .common import warm_in_parallel

    if "--warm" in sys.argv:
        warm_in_parallel(_compile, _jobs())
