"""torch.nn.functional.scaled_dot_product_attention routed to cute-flash through torch's
flash-attention registry: results equal calling cute-flash directly (forward and backward), and
the calls cute-flash does not serve really run torch's own path (same result as torch without
cute-flash, and the kernels never called)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_flash
from cute_flash import sdpa

from .common import FORWARD_FLOOR, assert_within_yardstick, emulate_forward, randn
from .kernel_spy import count_kernel_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                       reason=f"torch {torch.__version__} has no flash-attention registry"),
]


@pytest.fixture
def spy(monkeypatch):
    return count_kernel_calls(monkeypatch)


def bhsd(b, h, s, d, dtype=torch.bfloat16, grad=False):
    """SDPA's (batch, nheads, seqlen, headdim) layout, as a transposed view, the way models make it."""
    return randn(b, s, h, d, dtype=dtype).transpose(1, 2).requires_grad_(grad)


def grads(out, dout, *inputs):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_runs_cute_flash_forward_and_backward(spy, causal):
    q, k, v = (bhsd(2, 8, 257, 64, grad=True) for _ in range(3))
    dout = randn(2, 8, 257, 64, dtype=torch.bfloat16)
    with sdpa.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        got = grads(out, dout, q, k, v)
    assert spy == {"forward": 1, "backward": 1}
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    direct = cute_flash.flash_attn_func(qt, kt, vt, causal=causal)
    assert torch.equal(out, direct.transpose(1, 2)), "same kernel, same inputs: bit-identical forward"
    expected = grads(direct, dout.transpose(1, 2), qt, kt, vt)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        # The backward accumulates dq with atomics in a run-dependent order: equal up to rounding.
        err, size = _max_err(g, e.transpose(1, 2)), e.abs().max().item()
        assert err <= 1e-2 * size, f"{name}: {err:.3e} (max |grad| {size:.3e})"
    assert not sdpa.is_active()


def test_sdpa_with_enable_gqa_is_right_whichever_backend_torch_picks():
    """With enable_gqa=True, torch 2.11 on the H100 picks a backend other than flash even when flash
    comes first in the priority order (measured 2026-11-27), so cute-flash is not called there. The
    result must still be exact attention, whichever backend computed it."""
    q = bhsd(2, 8, 257, 64)
    k, v = (bhsd(2, 2, 257, 64) for _ in range(2))
    with sdpa.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref, _ = cute_flash.reference_attention(qt, kt, vt, causal=True)
    assert _max_err(out.transpose(1, 2), ref) <= 2e-2 * ref.abs().max().item()


def test_deterministic_mode_reaches_the_sdpa_backward(spy):
    q, k, v = (bhsd(1, 4, 500, 64, grad=True) for _ in range(3))
    dout = randn(1, 4, 500, 64, dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa.enabled():
            runs = [grads(F.scaled_dot_product_attention(q, k, v, is_causal=True), dout, q, k, v) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert spy == {"forward": 2, "backward": 2}
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_head_dim_padded_by_sdpa_keeps_the_original_scale(spy):
    """SDPA pads head dim 36 to 40 for its flash backend and passes scale 1/sqrt(36)."""
    q, k, v = (bhsd(2, 4, 130, 36) for _ in range(3))
    with sdpa.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert spy["forward"] == 1
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scale = 36 ** -0.5  # head dim 36 itself has no kernel: only `out` (of the padded call) is checked
    ref, _ = cute_flash.reference_attention(qt, kt, vt, softmax_scale=scale, causal=True)
    emulated, _ = emulate_forward(qt, kt, vt, scale, True)
    assert_within_yardstick("out", out.transpose(1, 2), emulated, ref, FORWARD_FLOOR)


def test_activate_and_deactivate(spy):
    q, k, v = (bhsd(1, 2, 64, 64) for _ in range(3))
    sdpa.activate()
    try:
        assert sdpa.is_active()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
        assert spy["forward"] == 1
    finally:
        sdpa.deactivate()
    assert not sdpa.is_active()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v)
    assert spy["forward"] == 1, "after deactivate, torch's own flash kernel runs"


def torch_and_routed(fn, seed=0):
    """fn() with torch's own kernels (flash preferred, as `enabled()` does) and with cute-flash active."""
    with sdpa_kernel(sdpa._flash_first(), set_priority=True):
        torch.manual_seed(seed)
        expected = fn()
    with sdpa.enabled():
        torch.manual_seed(seed)
        got = fn()
    return expected, got


def test_attn_mask_runs_torch(spy):
    q, k, v = (bhsd(2, 4, 100, 64) for _ in range(3))
    mask = torch.rand(2, 1, 100, 100, device="cuda") > 0.3
    expected, got = torch_and_routed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert spy["forward"] == 0 and torch.equal(got, expected)


def test_fp32_runs_torch(spy):
    q, k, v = (bhsd(2, 4, 100, 64, dtype=torch.float32) for _ in range(3))
    expected, got = torch_and_routed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert spy["forward"] == 0 and torch.equal(got, expected)
    ref, _ = cute_flash.reference_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert _max_err(got, ref.transpose(1, 2)) <= 1e-4


def test_dropout_runs_torch_forward_and_backward(spy):
    q, k, v = (bhsd(2, 4, 128, 64, grad=True) for _ in range(3))
    dout = randn(2, 4, 128, 64, dtype=torch.bfloat16)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        return out, grads(out, dout, q, k, v)

    (expected, expected_grads), (got, got_grads) = torch_and_routed(run)
    assert spy == {"forward": 0, "backward": 0}
    assert torch.equal(got, expected), "same seed, same torch kernel: the same dropout pattern"
    for g, e in zip(got_grads, expected_grads):
        assert _max_err(g, e) <= 1e-2 * e.abs().max().item()


def test_direct_op_call_with_non_square_causal_runs_torch(spy):
    """torch's flash backend never gets is_causal with seqlen_q != seqlen_k from SDPA; a direct call
    of the op keeps the op's own semantics."""
    q, (k, v) = bhsd(1, 4, 100, 64), (bhsd(1, 4, 300, 64) for _ in range(2))

    def run():
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)[0]

    expected, got = torch_and_routed(run)
    assert spy["forward"] == 0 and torch.equal(got, expected)
