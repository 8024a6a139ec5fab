"""flash_attn_varlen_func without a GPU: flash-attn 2's signatures, a typed error for every bad
argument before anything runs (cu_seqlens' values read back once, skipped during CUDA-graph
capture), the float64 varlen reference, and the autograd / packed-form / torch.compile plumbing
with float64 stand-ins for the kernels (tests/cpu/reference_kernels.py)."""

import contextlib
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_flash
from cute_flash import ErrorCode, reference_attention, varlen
from cute_flash.flash_attn_interface import (
    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
)
from cute_flash.reference import reference_varlen_attention
from cute_flash.validate import check_varlen, raise_for_values, reads_values, varlen_value_flags, varlen_value_messages

from .reference_kernels import install_varlen
from .typed_errors import expect

I32 = dict(dtype=torch.int32)
OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
SIGNATURES = {  # flash-attn 2's flash_attn_interface.py
    flash_attn_varlen_func: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
    flash_attn_varlen_qkvpacked_func: ["qkv", "cu_seqlens", "max_seqlen"],
    flash_attn_varlen_kvpacked_func: ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_match_flash_attn_2(fn):
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == SIGNATURES[fn] + [name for name, _ in OPTIONS]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
    assert [p.default for p in params[len(SIGNATURES[fn]):]] == [default for _, default in OPTIONS]


def test_exported_from_the_package_and_the_interface():
    import cute_flash.flash_attn_interface as interface

    for fn in SIGNATURES:
        assert getattr(cute_flash, fn.__name__) is fn
        assert fn.__name__ in cute_flash.__all__ and fn.__name__ in interface.__all__


def packed(lengths_q, lengths_k=None, h=4, hkv=2, d=16, dtype=torch.float32, grad=False, start=0):
    """Random packed q, k, v and their cu_seqlens; `start` rows of no sequence before the first."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    torch.manual_seed(0)
    cu_q = torch.tensor([start] + lengths_q, **I32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([start] + lengths_k, **I32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v)) + (cu_q, cu_k, max(lengths_q), max(lengths_k))


# ---- typed errors before anything runs ------------------------------------------------------------
@pytest.fixture
def kernels(monkeypatch):
    return install_varlen(monkeypatch)


def test_cu_seqlens_rules_raise_typed_errors_before_any_kernel(kernels):
    q, k, v, cu_q, cu_k, mq, mk = packed([3, 5])
    call = flash_attn_varlen_func
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, k, v, cu_q.long(), cu_k, mq, mk)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, k, v, cu_q, cu_k.float(), mq, mk)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, k, v, cu_q[None], cu_k, mq, mk)
    msg = expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, k, v, cu_q, cu_k[:2], mq, mk)
    assert "batch + 1 = 3" in msg
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, k, v, cu_q[:1], cu_k[:1], mq, mk)
    expect(ErrorCode.NULL_POINTER, TypeError, call, q, k, v, None, cu_k, mq, mk)
    for bad in (5.0, True, torch.tensor(5), -1):
        expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, k, v, cu_q, cu_k, bad, mk)
    # packed shapes: rank 3, heads, head dims, k == v
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q[None], k, v, cu_q, cu_k, mq, mk)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q[:, :3], k, v, cu_q, cu_k, mq, mk)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, k, v[:-1], cu_q, cu_k, mq, mk)
    expect(ErrorCode.UNSUPPORTED_HEAD_DIM, ValueError, call, q[..., :12], k[..., :12], v[..., :12], cu_q, cu_k, mq, mk)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, k.double(), v.double(), cu_q, cu_k, mq, mk)
    # the options as flash_attn_func
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, call, q, k, v, cu_q, cu_k, mq, mk, 0.1)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, k, v, cu_q, cu_k, mq, mk, window_size=(-2, 0))
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, k, v, cu_q, cu_k, mq, mk, softcap=-1.0)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, k, v, cu_q, cu_k, mq, mk,
           alibi_slopes=torch.ones(3, 4))
    assert kernels.forward_calls == []


def test_packed_forms_check_their_packing(kernels):
    q, k, v, cu_q, cu_k, mq, mk = packed([3, 5], h=2, hkv=2)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, flash_attn_varlen_qkvpacked_func,
           torch.stack([q, k], dim=1), cu_q, mq)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, flash_attn_varlen_qkvpacked_func, q, cu_q, mq)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, flash_attn_varlen_kvpacked_func,
           q, torch.stack([k, v, v], dim=1), cu_q, cu_k, mq, mk)
    assert kernels.forward_calls == []


def test_cu_seqlens_on_another_device_than_q():
    q, k, v, cu_q, cu_k, mq, mk = packed([3, 5])
    msg = expect(ErrorCode.CUDA_ERROR, RuntimeError, varlen.forward_varlen, q, k, v, cu_q.to("meta"), cu_k, mq, mk)
    assert "cu_seqlens_q on meta" in msg


def _value_error(lengths_q, lengths_k, cu_q, cu_k, max_q, max_k):
    q, k, v, *_ = packed(lengths_q, lengths_k)
    problem = check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    try:
        raise_for_values(varlen_value_flags(problem, cu_q, cu_k), varlen_value_messages(problem))
    except cute_flash.InvalidDimensionError as error:
        return str(error)
    return None


def test_value_rules():
    t = lambda *xs: torch.tensor(xs, **I32)  # noqa: E731
    assert _value_error([3, 5], [4, 0], t(0, 3, 8), t(0, 4, 4), 5, 4) is None
    assert _value_error([3, 5], [4, 0], t(2, 3, 8), t(0, 4, 4), 5, 4) is None  # rows before the first: allowed
    assert "cu_seqlens_q must start" in _value_error([3, 5], [4, 4], t(-1, 3, 8), t(0, 4, 8), 5, 4)
    assert "cu_seqlens_q must be non-decreasing" in _value_error([3, 5], [4, 4], t(0, 9, 8), t(0, 4, 8), 9, 4)
    assert "cu_seqlens_k must be non-decreasing" in _value_error([3, 5], [4, 4], t(0, 3, 8), t(0, 5, 4), 5, 8)
    assert "last entry of cu_seqlens_q must equal the number of packed q tokens (8)" in \
        _value_error([3, 5], [4, 4], t(0, 3, 7), t(0, 4, 8), 5, 4)
    assert "last entry of cu_seqlens_k" in _value_error([3, 5], [4, 4], t(0, 3, 8), t(0, 4, 9), 5, 4)
    assert "max_seqlen_q=4 is smaller" in _value_error([3, 5], [4, 4], t(0, 3, 8), t(0, 4, 8), 4, 4)
    assert "max_seqlen_k=3 is smaller" in _value_error([3, 5], [4, 4], t(0, 3, 8), t(0, 4, 8), 5, 3)


def test_value_checks_run_before_any_launch_and_skip_during_capture(monkeypatch):
    """The real forward_varlen with the device checks passed on the CPU: a bad cu_seqlens raises
    before a kernel is planned; during a CUDA-graph capture (or with the switch off) nothing is read back."""
    monkeypatch.setattr(varlen, "check_device", lambda tensors: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA
    monkeypatch.setattr(varlen, "_on", lambda device: contextlib.nullcontext())
    launched = []
    monkeypatch.setattr(varlen, "_launcher", lambda *args: launched.append(args) or (lambda *a: None))
    q, k, v, cu_q, cu_k, mq, mk = packed([3, 5])
    bad = torch.tensor([0, 3, 7], **I32)
    with pytest.raises(cute_flash.InvalidDimensionError, match="last entry"):
        varlen.forward_varlen(q, k, v, bad, cu_k, mq, mk)
    with pytest.raises(cute_flash.InvalidDimensionError, match="last entry"):
        varlen.backward_varlen(q, q, k, v, q, torch.zeros(4, 8), bad, cu_k, mq, mk)
    assert launched == []
    varlen.forward_varlen(q, k, v, bad, cu_k, mq, mk, check_values=False)  # the autograd backward's path
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not reads_values(True)
    varlen.forward_varlen(q, k, v, bad, cu_k, mq, mk)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(varlen, "VALUE_CHECKS", False)
    varlen.forward_varlen(q, k, v, bad, cu_k, mq, mk)
    assert len(launched) == 3


# ---- the reference ---------------------------------------------------------------------------------
def test_reference_is_the_dense_reference_per_sequence():
    q, k, v, cu_q, cu_k, _, _ = packed([0, 1, 7, 12], [3, 0, 9, 12], start=2)
    slopes = torch.rand(4, 4)
    out, lse = reference_varlen_attention(q, k, v, cu_q, cu_k, 0.3, True, (5, 0), 4.0, slopes)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and out.dtype == torch.float64
    assert torch.all(out[:2] == 0) and torch.all(lse[:, :2] == float("-inf"))  # rows of no sequence
    assert torch.all(out[2:3] == 0) and torch.all(lse[:, 2:3] == float("-inf"))  # a sequence without keys
    for b, (sq, sk) in enumerate([(slice(3, 10), slice(5, 14)), (slice(10, 22), slice(14, 26))], start=2):
        ref_out, ref_lse = reference_attention(q[sq][None], k[sk][None], v[sk][None], 0.3, True, (5, 0), 4.0,
                                               slopes[b])
        torch.testing.assert_close(out[sq], ref_out[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, sq], ref_lse[0], rtol=0, atol=0)


# ---- plumbing with the stand-ins -------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_matches_the_differentiated_reference(kernels, causal):
    q, k, v, cu_q, cu_k, mq, mk = packed([5, 0, 1, 9], [7, 3, 0, 6], grad=True, start=2)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, causal, (-1, -1), 0.0, None,
                                             True, True)
    assert probs is None and lse.shape == (4, q.shape[0]) and not lse.requires_grad
    assert kernels.forward_calls[-1]["max_seqlen"] == (mq, mk)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
    ref_out, _ = reference_varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    ref_grads = torch.autograd.grad((ref_out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
    torch.testing.assert_close(out[2:], ref_out[2:].float(), rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5)
        assert torch.all(got[:2] == 0)  # rows of no sequence: no gradient
    assert kernels.backward_calls[-1]["deterministic"] is True


def test_packed_forms_match_the_unpacked_call(kernels):
    q, k, v, cu_q, cu_k, mq, mk = packed([4, 6], h=2, hkv=2)
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    out = flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq, causal=True)
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True))
    (dqkv,) = torch.autograd.grad(out.sum(), qkv)
    assert dqkv.shape == qkv.shape and dqkv.abs().sum() > 0
    kv = torch.stack([k, v], dim=1).requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, window_size=(2, 1), softcap=3.0)
    assert kernels.forward_calls[-1]["window_size"] == (2, 1) and kernels.forward_calls[-1]["softcap"] == 3.0
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(2, 1),
                                                           softcap=3.0))


def test_ops_propagate_shapes_under_fake_tensors():
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(torch.empty(n, h, 64, dtype=torch.bfloat16)) for n, h in ((300, 8), (257, 2),
                                                                                               (257, 2)))
        cu = mode.from_tensor(torch.zeros(4, **I32))
        out, lse = torch.ops.cute_flash.varlen_forward(q, k, v, cu, cu, 128, 128, 0.125, True)
        assert out.shape == q.shape and lse.shape == (8, 300) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.cute_flash.varlen_backward(out, q, k, v, out, lse, cu, cu, 128, 128, 0.125, True, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        with pytest.raises(cute_flash.DimensionMismatchError):
            torch.ops.cute_flash.varlen_forward(q, k, v, cu, cu[:3], 128, 128, 0.125, True)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_keeps_the_ops(kernels, dynamic):
    q, k, v, cu_q, cu_k, mq, mk = packed([4, 6], grad=True)

    def step(q, k, v, cu_q, cu_k, mq, mk):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    loss = compiled(q, k, v, cu_q, cu_k, mq, mk)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(step(q, k, v, cu_q, cu_k, mq, mk), (q, k, v))
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref)


def test_backward_checks_its_tensors_before_anything_runs(monkeypatch):
    monkeypatch.setattr(varlen, "_launcher", lambda *args: pytest.fail("a kernel was planned"))
    q, k, v, cu_q, cu_k, mq, mk = packed([3, 5])
    lse = torch.zeros(4, 8)
    call = varlen.backward_varlen
    expect(ErrorCode.NULL_POINTER, TypeError, call, None, q, k, v, q, lse, cu_q, cu_k, mq, mk)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, q, k, v, q, lse[:, :7], cu_q, cu_k, mq, mk)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, q, k, v, q, lse.double(), cu_q, cu_k, mq, mk)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, q, k, v, q, lse, cu_q, cu_k, mq, mk, dk=q)
    msg = expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q, q, k, v, q, lse, cu_q, cu_k, mq, mk,
                 dv=v.to("meta"))
    assert "dv on meta" in msg
