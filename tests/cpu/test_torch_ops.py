"""The torch.library ops behind flash_attn_func, without a GPU: shape propagation for tracing
(torch.compile's fake tensors) and validation at trace time."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_flash
import cute_flash.autograd  # noqa: F401  (registers the ops)


def fake_inputs(mode, b=2, sq=300, sk=257, h=8, hkv=2, d=64, dtype=torch.bfloat16):
    return (mode.from_tensor(torch.empty(b, sq, h, d, dtype=dtype)),
            mode.from_tensor(torch.empty(b, sk, hkv, d, dtype=dtype)),
            mode.from_tensor(torch.empty(b, sk, hkv, d, dtype=dtype)))


def test_forward_op_shapes_under_fake_tensors():
    with FakeTensorMode() as mode:
        q, k, v = fake_inputs(mode)
        out, lse, _ = torch.ops.cute_flash.attention_forward(q, k, v, 0.125, True)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32


def test_dropout_forward_op_returns_its_stream_under_fake_tensors():
    with FakeTensorMode() as mode:
        q, k, v = fake_inputs(mode)
        out, lse, rng_state = torch.ops.cute_flash.attention_forward(q, k, v, 0.125, True, dropout_p=0.1)
        assert out.shape == q.shape and rng_state.shape == (2,) and rng_state.dtype == torch.int64
        with pytest.raises(cute_flash.InvalidDimensionError, match="dropout_p"):
            torch.ops.cute_flash.attention_forward(q, k, v, 0.125, True, dropout_p=1.5)


def test_backward_op_shapes_under_fake_tensors():
    with FakeTensorMode() as mode:
        q, k, v = fake_inputs(mode)
        out, lse, _ = torch.ops.cute_flash.attention_forward(q, k, v, 0.125, False)
        dq, dk, dv = torch.ops.cute_flash.attention_backward(out, q, k, v, out, lse, 0.125, False, True)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_tracing_reports_shape_errors_with_typed_errors():
    with FakeTensorMode() as mode:
        q, k, v = fake_inputs(mode, h=6, hkv=4)
        with pytest.raises(cute_flash.DimensionMismatchError):
            torch.ops.cute_flash.attention_forward(q, k, v, 0.125, False)


def test_flash_attn_func_validates_scale_before_the_op():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(cute_flash.InvalidDimensionError):
        cute_flash.flash_attn_func(q, q, q, softmax_scale=float("nan"))


def test_autograd_wiring_with_reference_kernels(monkeypatch):
    """flash_attn_func's autograd, run on the CPU with the float64 reference standing in for the
    kernels: gradients reach q, k, v through the backward op, lse carries none."""
    from cute_flash import reference_attention

    from .reference_kernels import install

    install(monkeypatch)
    q = torch.randn(1, 5, 4, 8, dtype=torch.float32, requires_grad=True)
    k = torch.randn(1, 7, 2, 8, dtype=torch.float32, requires_grad=True)
    v = torch.randn(1, 7, 2, 8, dtype=torch.float32, requires_grad=True)
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_out, _ = reference_attention(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), (q, k, v))
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5)
