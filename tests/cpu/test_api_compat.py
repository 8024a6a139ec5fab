"""The flash-attn 2 interface without a GPU: signatures that bind like flash-attn's, a typed error
for every bad or unsupported argument (raised before any kernel runs), return conventions, and the
plumbing of the packed variants and of `deterministic`, with float64 stand-ins for the kernels."""

import inspect
import math

import numpy as np
import pytest
import torch

import cute_flash
from cute_flash import ErrorCode, reference_attention
from cute_flash.flash_attn_interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

from .reference_kernels import install

from .typed_errors import expect

# flash-attn 2's signatures (flash_attn/flash_attn_interface.py): name, default, in order.
FLASH_ATTN_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                      ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                      ("return_attn_probs", False)]
SIGNATURES = {
    flash_attn_func: ["q", "k", "v"],
    flash_attn_qkvpacked_func: ["qkv"],
    flash_attn_kvpacked_func: ["q", "kv"],
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_match_flash_attn_2(fn):
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == SIGNATURES[fn] + [name for name, _ in FLASH_ATTN_OPTIONS]
    tensors = len(SIGNATURES[fn])
    assert all(p.default is p.empty for p in positional[:tensors])
    assert [p.default for p in positional[tensors:]] == [default for _, default in FLASH_ATTN_OPTIONS]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert keyword_only == (["return_lse"] if fn is flash_attn_func else [])
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def test_package_exports_the_interface():
    assert cute_flash.flash_attn_func is flash_attn_func
    assert cute_flash.flash_attn_qkvpacked_func is flash_attn_qkvpacked_func
    assert cute_flash.flash_attn_kvpacked_func is flash_attn_kvpacked_func


def qkv(b=2, sq=5, sk=7, h=4, hkv=2, d=8, dtype=torch.float32, grad=False):
    torch.manual_seed(0)
    q, k, v = torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


@pytest.fixture
def kernels(monkeypatch):
    return install(monkeypatch)


def test_flash_attn_positional_call_is_dropout_then_scale(kernels):
    """flash_attn_func(q, k, v, 0.0, None, True): dropout 0, default scale, causal, as in flash-attn."""
    q, k, v = qkv()
    out = flash_attn_func(q, k, v, 0.0, None, True)
    (call,) = kernels.forward_calls
    assert call["causal"] is True and call["softmax_scale"] == 1 / math.sqrt(8)
    ref, _ = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref.float(), rtol=1e-6, atol=1e-6)
    out = flash_attn_func(q, k, v, 0.0, 0.3)
    assert kernels.forward_calls[-1]["softmax_scale"] == 0.3 and kernels.forward_calls[-1]["causal"] is False


UNSUPPORTED = [
    ({"dropout_p": 0.1, "return_attn_probs": True}, "dropout_keep_mask"),
]


@pytest.mark.parametrize("kwargs, supported", UNSUPPORTED, ids=lambda x: str(x))
def test_unsupported_arguments_are_rejected_before_any_kernel(kernels, kwargs, supported):
    q, k, v = qkv(grad=True)
    calls = [
        lambda: flash_attn_func(q, k, v, **kwargs),
        lambda: flash_attn_qkvpacked_func(torch.stack((q, q, q), dim=2), **kwargs),
        lambda: flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), **kwargs),
    ]
    for call in calls:
        msg = expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, call)
        assert supported in msg
    assert kernels.forward_calls == [] and kernels.backward_calls == []


SCORE_MODS = [
    {"window_size": (4, 0)},
    {"window_size": (-1, 2), "causal": True},
    {"window_size": [3, 5]},
    {"softcap": 1.5},
    {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    {"alibi_slopes": torch.rand(2, 4), "window_size": (2, 1), "softcap": 2.0, "causal": True},
]


@pytest.mark.parametrize("kwargs", SCORE_MODS, ids=lambda x: str(sorted(x)))
def test_score_mods_reach_the_kernels_forward_and_backward(kernels, kwargs):
    """window_size, softcap and alibi_slopes travel through autograd to both passes, and the
    gradients equal float64 autograd through the reference with the same arguments."""
    q, k, v = qkv(grad=True)
    out = flash_attn_func(q, k, v, **kwargs)
    ref_kwargs = dict(kwargs, window_size=tuple(kwargs.get("window_size", (-1, -1))))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, **ref_kwargs)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for got, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)
    (fwd,), (bwd,) = kernels.forward_calls, kernels.backward_calls
    for call in (fwd, bwd):
        assert tuple(call["window_size"]) == ref_kwargs["window_size"] and call["softcap"] == kwargs.get("softcap", 0.0)
        assert (call["alibi_slopes"] is None) == ("alibi_slopes" not in kwargs)
    assert call["alibi_slopes"] is None or torch.equal(call["alibi_slopes"].reshape(-1), kwargs["alibi_slopes"].reshape(-1))


def test_old_positional_order_is_rejected_not_misread(kernels):
    """Calls written for the former (q, k, v, softmax_scale, causal, return_lse) order."""
    q, k, v = qkv()
    # 0.125 is a valid dropout_p now; the bool in softmax_scale's place is still refused
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, 0.125, True)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, None, True)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, 0.0, True)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, 0.0, None, True, True)
    assert kernels.forward_calls == []


BAD_VALUES = [
    ({"dropout_p": None}, "dropout_p"),
    ({"dropout_p": "0"}, "dropout_p"),
    ({"dropout_p": True}, "dropout_p"),
    ({"dropout_p": -0.5}, "dropout_p"),
    ({"dropout_p": 1.0}, "dropout_p"),
    ({"dropout_p": math.nan}, "dropout_p"),
    ({"softmax_scale": True}, "softmax_scale"),
    ({"softmax_scale": "0.1"}, "softmax_scale"),
    ({"softmax_scale": [0.1]}, "softmax_scale"),
    ({"softmax_scale": math.nan}, "softmax_scale"),
    ({"softmax_scale": -1.0}, "softmax_scale"),
    ({"causal": None}, "causal"),
    ({"causal": "yes"}, "causal"),
    ({"causal": 2}, "causal"),
    ({"window_size": True}, "window_size"),
    ({"window_size": (-1,)}, "window_size"),
    ({"window_size": (-2, 0)}, "window_size"),
    ({"window_size": (0, -5)}, "window_size"),
    ({"window_size": (1.5, 0)}, "window_size"),
    ({"window_size": (True, 0)}, "window_size"),
    ({"softcap": None}, "softcap"),
    ({"softcap": -1.0}, "softcap"),
    ({"softcap": math.inf}, "softcap"),
    ({"softcap": math.nan}, "softcap"),
    ({"deterministic": None}, "deterministic"),
    ({"return_attn_probs": "no"}, "return_attn_probs"),
]


@pytest.mark.parametrize("kwargs, name", BAD_VALUES, ids=lambda x: str(x))
def test_bad_values_raise_typed_errors(kernels, kwargs, name):
    q, k, v = qkv(grad=True)
    msg = expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, **kwargs)
    assert name in msg
    with torch.no_grad():
        expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, **kwargs)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_qkvpacked_func,
           torch.stack((q, q, q), dim=2), **kwargs)
    assert kernels.forward_calls == []


def test_return_lse_is_keyword_only_and_validated(kernels):
    q, k, v = qkv()
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, k, v, return_lse=None)
    with pytest.raises(TypeError):
        flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, False, True)


@pytest.mark.parametrize("bad", [None, [1.0, 2.0], np.zeros((2, 5, 4, 8), dtype=np.float32), 3.0],
                         ids=["None", "list", "numpy", "float"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_tensors_raise_missing_tensor(kernels, bad, position):
    args = list(qkv())
    args[position] = bad
    msg = expect(ErrorCode.NULL_POINTER, cute_flash.MissingTensorError, flash_attn_func, *args)
    assert "qkv"[position] in msg
    if isinstance(bad, np.ndarray):
        assert "torch.Tensor" in msg and "cute_flash.forward" in msg
    assert kernels.forward_calls == []


@pytest.mark.parametrize("bad", [None, [1.0], np.zeros((2, 5, 3, 4, 8), dtype=np.float32)], ids=["None", "list", "numpy"])
def test_packed_inputs_must_be_torch_tensors(kernels, bad):
    q, k, v = qkv()
    expect(ErrorCode.NULL_POINTER, cute_flash.MissingTensorError, flash_attn_qkvpacked_func, bad)
    expect(ErrorCode.NULL_POINTER, cute_flash.MissingTensorError, flash_attn_kvpacked_func, q, bad)
    expect(ErrorCode.NULL_POINTER, cute_flash.MissingTensorError, flash_attn_kvpacked_func, bad, torch.stack((k, v), 2))
    assert kernels.forward_calls == []


def test_packed_shapes(kernels):
    q, k, v = qkv()
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_qkvpacked_func, q)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_kvpacked_func, q, k)
    msg = expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, flash_attn_qkvpacked_func,
                 torch.stack((q, q), dim=2))
    assert "3 tensors" in msg
    expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, flash_attn_kvpacked_func, q,
           torch.stack((k, v, v), dim=2))
    assert kernels.forward_calls == []


def test_shape_errors_are_typed_through_every_path(kernels):
    q, k, v = qkv(hkv=3)
    for grad in (False, True):
        args = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, flash_attn_func, *args)
        expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, flash_attn_kvpacked_func,
               args[0], torch.stack(args[1:], dim=2))
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q[0], k[0], v[0])


def test_return_conventions(kernels):
    q, k, v = qkv()
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    result = flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    torch.testing.assert_close(result[1], lse)
    assert len(flash_attn_func(q, k, v, return_attn_probs=True, return_lse=True)) == 3
    packed = torch.stack((q, q, q), dim=2)
    assert isinstance(flash_attn_qkvpacked_func(packed), torch.Tensor)
    out, lse, probs = flash_attn_qkvpacked_func(packed, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 5)
    out, lse, probs = flash_attn_kvpacked_func(q, torch.stack((k, v), 2), return_attn_probs=True)
    assert probs is None and out.shape == q.shape


def grads_of(out, *inputs):
    return torch.autograd.grad(out.square().sum(), inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_unpacked_and_differentiates_the_packed_tensor(kernels, causal):
    torch.manual_seed(1)
    packed = torch.randn(2, 6, 3, 4, 8, requires_grad=True)
    out = flash_attn_qkvpacked_func(packed, 0.0, 0.4, causal)
    (grad,) = grads_of(out, packed)
    q, k, v = (packed.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, softmax_scale=0.4, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.stack(grads_of(ref, q, k, v), dim=2), rtol=0, atol=0)
    call = kernels.forward_calls[0]
    assert call["q"]._base is packed or call["q"].data_ptr() == packed.data_ptr()  # views, not copies


def test_kvpacked_matches_unpacked_with_gqa(kernels):
    q, k, v = qkv(grad=False)
    q.requires_grad_()
    kv = torch.stack((k, v), dim=2).requires_grad_()
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    dq, dkv = grads_of(out, q, kv)
    k2, v2 = (t.clone().requires_grad_() for t in (k, v))
    q2 = q.detach().clone().requires_grad_()
    ref = flash_attn_func(q2, k2, v2, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    rq, rk, rv = grads_of(ref, q2, k2, v2)
    torch.testing.assert_close(dq, rq, rtol=0, atol=0)
    torch.testing.assert_close(dkv, torch.stack((rk, rv), dim=2), rtol=0, atol=0)


def test_deterministic_reaches_the_backward(kernels):
    q, k, v = qkv(grad=True)
    assert not torch.are_deterministic_algorithms_enabled()
    for deterministic in (False, True):
        grads_of(flash_attn_func(q, k, v, deterministic=deterministic), q, k, v)
        assert kernels.backward_calls[-1]["deterministic"] is deterministic
    grads_of(flash_attn_qkvpacked_func(torch.stack((q, k[:, :5].repeat(1, 1, 2, 1), q), 2), deterministic=True), q)
    assert kernels.backward_calls[-1]["deterministic"] is True
    torch.use_deterministic_algorithms(True)
    try:
        grads_of(flash_attn_func(q, k, v, deterministic=False), q, k, v)
    finally:
        torch.use_deterministic_algorithms(False)
    assert kernels.backward_calls[-1]["deterministic"] is True


def test_softmax_scale_type_checked_by_the_framework_neutral_api(monkeypatch):
    monkeypatch.setattr("cute_flash.api.check_device", lambda tensors: torch.device("cuda", 0))
    q, k, v = qkv(dtype=torch.float16)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, cute_flash.forward, q, k, v, softmax_scale=True)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, cute_flash.forward, q, k, v, softmax_scale="1")


def test_kernel_support_issue_names_the_reason():
    from cute_flash.validate import kernel_support_issue

    q, k, v = qkv(d=64)
    assert "CUDA" in kernel_support_issue(q, k, v)  # fp32 has kernels: these CPU tensors do not
    assert "not supported" in kernel_support_issue(*(t.double() for t in (q, k, v)))
    q, k, v = (t.bfloat16() for t in (q, k, v))
    assert "CUDA" in kernel_support_issue(q, k, v)
    assert "multiple of nheads_kv" in kernel_support_issue(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))


@pytest.mark.parametrize("kwargs", [{"causal": "no"}, {"causal": None}, {"deterministic": "yes"}], ids=str)
def test_framework_neutral_api_rejects_non_boolean_flags(monkeypatch, kwargs):
    monkeypatch.setattr("cute_flash.api.check_device", lambda tensors: torch.device("cuda", 0))
    q, k, v = qkv(dtype=torch.float16)
    lse = torch.zeros(2, 4, 5)
    if "deterministic" not in kwargs:
        expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, cute_flash.forward, q, k, v, **kwargs)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, cute_flash.backward, q, q, k, v, q, lse,
           **kwargs)


BAD_SLOPES = [
    (torch.zeros(4, dtype=torch.float64), cute_flash.UnsupportedDtypeError, "float32"),
    (torch.zeros(3), cute_flash.DimensionMismatchError, "alibi_slopes"),
    (torch.zeros(1, 4), cute_flash.DimensionMismatchError, "alibi_slopes"),
    (torch.zeros(2, 4, 1), cute_flash.DimensionMismatchError, "alibi_slopes"),
    ([0.5] * 4, cute_flash.MissingTensorError, "alibi_slopes"),
]


@pytest.mark.parametrize("slopes, error, words", BAD_SLOPES, ids=lambda x: str(getattr(x, "shape", x)))
def test_bad_alibi_slopes_raise_typed_errors_before_any_kernel(kernels, slopes, error, words):
    q, k, v = qkv(grad=True)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            with pytest.raises(error, match=words):
                flash_attn_func(q, k, v, alibi_slopes=slopes)
    assert kernels.forward_calls == []
