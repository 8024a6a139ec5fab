"""flash-attn 2's interface on the GPU: positional calls, the packed variants against the unpacked
function, `deterministic`, and the return conventions, against the float64 reference."""

import pytest
import torch

import cute_flash
from cute_flash.flash_attn_interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

from .common import assert_backward_accurate, assert_forward_accurate, randn

pytestmark = pytest.mark.gpu


def test_positional_flash_attn_call_matches_the_reference():
    """flash_attn_func(q, k, v, 0.0, None, True): dropout 0, default scale, causal (the call that
    used to run with scale 0)."""
    q = randn(2, 300, 8, 64, dtype=torch.bfloat16)
    k, v = randn(2, 300, 2, 64, dtype=torch.bfloat16), randn(2, 300, 2, 64, dtype=torch.bfloat16)
    out = flash_attn_func(q, k, v, 0.0, None, True)
    out2, lse, probs = flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    assert probs is None and torch.equal(out, out2)
    assert_forward_accurate(out, lse, q, k, v, True)


def test_unsupported_arguments_raise_before_the_kernel_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(cute_flash.api, "forward", lambda *a, **kw: calls.append(a))
    q = randn(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(cute_flash.UnsupportedArgumentError):  # dropout is implemented, its probabilities are not
        flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(cute_flash.InvalidDimensionError):
        flash_attn_func(q, q, q, dropout_p=1.0)
    # score modifications are implemented, but a bad one stops before the kernel too
    with pytest.raises(cute_flash.DimensionMismatchError):
        flash_attn_func(q, q, q, alibi_slopes=torch.zeros(3, device="cuda", dtype=torch.float32))
    assert calls == []


def grads(out, dout, *inputs):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_equals_unpacked(causal):
    qkv = randn(2, 257, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    dout = randn(2, 257, 4, 64, dtype=torch.bfloat16)
    out = flash_attn_qkvpacked_func(qkv, 0.0, None, causal, deterministic=True)
    (dqkv,) = grads(out, dout, qkv)
    q, k, v = (qkv.detach()[:, :, i].contiguous().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=causal, deterministic=True)
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, torch.stack(grads(ref, dout, q, k, v), dim=2))
    check_against_float64(dqkv.unbind(2), q, k, v, dout, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_kvpacked_equals_unpacked_with_gqa(causal):
    q = randn(2, 200, 8, 128, dtype=torch.float16).requires_grad_()
    kv = randn(2, 333, 2, 2, 128, dtype=torch.float16).requires_grad_()
    dout = randn(2, 200, 8, 128, dtype=torch.float16)
    out, lse, probs = flash_attn_kvpacked_func(q, kv, causal=causal, deterministic=True, return_attn_probs=True)
    assert probs is None
    dq, dkv = grads(out, dout, q, kv)
    k, v = (kv.detach()[:, :, i].contiguous().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref = flash_attn_func(q2, k, v, causal=causal, deterministic=True)
    assert torch.equal(out, ref)
    ref_dq, ref_dk, ref_dv = grads(ref, dout, q2, k, v)
    assert torch.equal(dq, ref_dq) and torch.equal(dkv, torch.stack((ref_dk, ref_dv), dim=2))
    assert_forward_accurate(out.detach(), lse, q2.detach(), k.detach(), v.detach(), causal)
    check_against_float64((dq, *dkv.unbind(2)), q2, k, v, dout, causal)


def check_against_float64(got_grads, q, k, v, dout, causal):
    assert_backward_accurate(got_grads, dout, q.detach(), k.detach(), v.detach(), causal)


@pytest.mark.parametrize("nheads_kv", [4, 1])
def test_deterministic_true_gives_bit_identical_gradients(nheads_kv):
    assert not torch.are_deterministic_algorithms_enabled()
    q = randn(2, 1000, 4, 64, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(2, 1000, nheads_kv, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = randn(2, 1000, 4, 64, dtype=torch.bfloat16)
    runs = [grads(flash_attn_func(q, k, v, causal=True, deterministic=True), dout, q, k, v) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    check_against_float64(runs[0], q, k, v, dout, True)
