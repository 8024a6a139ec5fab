"""The float64 reference against a direct, loop-based evaluation of the definition."""

import math

import numpy as np
import pytest
import torch

import cute_flash
from cute_flash import ErrorCode, reference_attention


def naive(q, k, v, scale, causal):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = torch.stack([(q[bi, i, hi].double() * k[bi, j, kh].double()).sum() * scale for j in keys])
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.exp(s - lse[bi, hi, i])
                out[bi, i, hi] = sum(p[n] * v[bi, j, kh].double() for n, j in enumerate(keys))
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, h, hkv", [(5, 7, 4, 2), (7, 3, 2, 1), (1, 1, 1, 1), (6, 6, 3, 3)])
def test_matches_definition(sq, sk, h, hkv, causal):
    torch.manual_seed(sq * 100 + sk)
    q, k, v = torch.randn(2, sq, h, 8), torch.randn(2, sk, hkv, 8), torch.randn(2, sk, hkv, 8)
    out, lse = reference_attention(q, k, v, softmax_scale=0.3, causal=causal)
    ref_out, ref_lse = naive(q, k, v, 0.3, causal)
    assert out.dtype == torch.float64 and out.shape == q.shape and lse.shape == (2, h, sq)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_rows_without_keys_and_gradients_are_finite():
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = reference_attention(q, k, v, causal=True)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isneginf(lse[..., :3]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :3] == 0)


def test_default_scale_and_gradcheck():
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = reference_attention(q, k, v)
    out2, _ = reference_attention(q, k, v, softmax_scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, out2)
    assert torch.autograd.gradcheck(lambda a, b, c: reference_attention(a, b, c, causal=True)[0], (q, k, v))


def typed(exc_type, code, *args, **kwargs):
    with pytest.raises(exc_type) as info:
        reference_attention(*args, **kwargs)
    assert isinstance(info.value, cute_flash.CuteFlashError) and info.value.code == code
    return str(info.value)


def inputs(sq=5, sk=7, h=4, hkv=2, d=8):
    return torch.randn(2, sq, h, d), torch.randn(2, sk, hkv, d), torch.randn(2, sk, hkv, d)


@pytest.mark.parametrize("bad", [None, [[1.0]], np.zeros((2, 5, 4, 8)), 1.0], ids=["None", "list", "numpy", "float"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_tensors_are_typed_errors(bad, position):
    args = list(inputs())
    args[position] = bad
    msg = typed(cute_flash.MissingTensorError, ErrorCode.NULL_POINTER, *args)
    assert "qkv"[position] in msg


@pytest.mark.parametrize("change, exc_type, code, fragment", [
    (lambda q, k, v: (q[0], k[0], v[0]), cute_flash.InvalidDimensionError, ErrorCode.INVALID_DIMENSION, "4 dimensions"),
    (lambda q, k, v: (q, k[..., None], v), cute_flash.InvalidDimensionError, ErrorCode.INVALID_DIMENSION, "4 dimensions"),
    (lambda q, k, v: (q[:, :0], k, v), cute_flash.InvalidDimensionError, ErrorCode.INVALID_DIMENSION, "empty"),
    (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)),
     cute_flash.DimensionMismatchError, ErrorCode.DIMENSION_MISMATCH, "multiple of nheads_kv"),
    (lambda q, k, v: (q, k[:1], v[:1]), cute_flash.DimensionMismatchError, ErrorCode.DIMENSION_MISMATCH, "batch"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), cute_flash.DimensionMismatchError, ErrorCode.DIMENSION_MISMATCH, "head dim"),
    (lambda q, k, v: (q, k, v[:, :3]), cute_flash.DimensionMismatchError, ErrorCode.DIMENSION_MISMATCH, "same shape"),
    (lambda q, k, v: (q.int(), k, v), cute_flash.UnsupportedDtypeError, ErrorCode.UNSUPPORTED_DTYPE, "floating"),
    (lambda q, k, v: (q, k.to("meta"), v), cute_flash.CudaError, ErrorCode.CUDA_ERROR, "different devices"),
], ids=["rank3", "rank5", "empty", "gqa", "batch", "headdim", "kv", "int", "devices"])
def test_shape_rules_are_the_kernels(change, exc_type, code, fragment):
    assert fragment in typed(exc_type, code, *change(*inputs()))


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -0.5, True, "0.5", [0.5]])
def test_bad_scales_are_typed_errors(scale):
    assert "softmax_scale" in typed(cute_flash.InvalidDimensionError, ErrorCode.INVALID_DIMENSION, *inputs(),
                                    softmax_scale=scale)


@pytest.mark.parametrize("causal", [None, "yes", 2])
def test_bad_causal_is_a_typed_error(causal):
    assert "causal" in typed(cute_flash.InvalidDimensionError, ErrorCode.INVALID_DIMENSION, *inputs(), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_scale_is_uniform_attention(causal):
    q, k, v = inputs(sq=6, sk=4)
    out, lse = reference_attention(q, k, v, softmax_scale=0.0, causal=causal)
    vh = v.double().repeat_interleave(2, dim=2)  # (b, sk, h, d)
    for i in range(6):
        seen = i + 4 - 6 + 1 if causal else 4  # keys j <= i + sk - sq
        if seen <= 0:
            assert torch.all(out[:, i] == 0) and torch.all(torch.isneginf(lse[..., i]))
            continue
        torch.testing.assert_close(out[:, i], vh[:, :seen].mean(dim=1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[..., i], torch.full_like(lse[..., i], math.log(seen)), rtol=1e-12, atol=1e-12)


def test_half_precision_and_any_head_dim_are_accepted():
    q, k, v = (t.half() for t in inputs(d=12))
    out, lse = reference_attention(q, k, v, causal=True)
    ref_out, ref_lse = naive(q, k, v, 1 / math.sqrt(12), True)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
