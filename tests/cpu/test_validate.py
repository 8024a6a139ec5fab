"""Every typed error, raised before anything runs; nothing written."""

import math
import types

import numpy as np
import pytest
import torch

import cute_flash
from cute_flash import ErrorCode
from cute_flash.validate import check_device

from .typed_errors import expect


def qkv(b=2, sq=16, sk=16, h=4, hkv=4, d=64, dtype=torch.float16):
    return (torch.randn(b, sq, h, d).to(dtype), torch.randn(b, sk, hkv, d).to(dtype), torch.randn(b, sk, hkv, d).to(dtype))


def test_error_codes_match_c_abi():
    assert [c.value for c in ErrorCode] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert ErrorCode.UNSUPPORTED_DTYPE.name == "UNSUPPORTED_DTYPE"
    assert issubclass(cute_flash.InvalidDimensionError, ValueError)
    assert issubclass(cute_flash.UnsupportedDtypeError, TypeError)


@pytest.mark.parametrize("shape", [(16, 4, 64), (1, 2, 16, 4, 64)])
def test_wrong_rank(shape):
    q, k, v = qkv()
    expect(ErrorCode.INVALID_DIMENSION, ValueError, cute_flash.forward, torch.randn(shape).half(), k, v)


def test_empty_dimension():
    q, k, v = qkv()
    msg = expect(ErrorCode.INVALID_DIMENSION, ValueError, cute_flash.forward, q[:, :0], k, v)
    assert "empty" in msg


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda q, k, v: (q, k[:1], v[:1]), "batch"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), "head dim"),
        (lambda q, k, v: (q, k, v[:, :8]), "same shape"),
        (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), "multiple of nheads_kv"),
    ],
)
def test_dimension_mismatch(change, fragment):
    msg = expect(ErrorCode.DIMENSION_MISMATCH, ValueError, cute_flash.forward, *change(*qkv()))
    assert fragment in msg


def test_out_and_lse_shape_mismatch():
    q, k, v = qkv()
    out = torch.full_like(q, 7.0)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, cute_flash.forward, q, k, v, out=out[:, :8])
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, cute_flash.forward, q, k, v, lse=torch.zeros(2, 4, 15))
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, cute_flash.forward, q, k, v, lse=torch.zeros(2, 4, 16, dtype=torch.float64))
    assert torch.all(out == 7.0), "a rejected call must write nothing"


@pytest.mark.parametrize("d", [4, 12, 33, 264, 512])
def test_unsupported_head_dim_lists_supported(d):
    msg = expect(ErrorCode.UNSUPPORTED_HEAD_DIM, ValueError, cute_flash.forward, *qkv(d=d))
    assert "multiple of 8" in msg and "256" in msg


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, cute_flash.forward, q.to(dtype), k.to(dtype), v.to(dtype))


def test_mixed_dtypes():
    q, k, v = qkv()
    msg = expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, cute_flash.forward, q, k.bfloat16(), v)
    assert "mixed" in msg


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -0.5])
def test_bad_softmax_scale(scale, monkeypatch):
    monkeypatch.setattr("cute_flash.api.check_device", lambda tensors: torch.device("cuda", 0))
    msg = expect(ErrorCode.INVALID_DIMENSION, ValueError, cute_flash.forward, *qkv(), softmax_scale=scale)
    assert "softmax_scale" in msg


def test_missing_tensor():
    q, k, v = qkv()
    expect(ErrorCode.NULL_POINTER, TypeError, cute_flash.forward, q, None, v)
    expect(ErrorCode.NULL_POINTER, TypeError, cute_flash.forward, q, k, [1, 2, 3])


def test_cpu_tensors_rejected():
    msg = expect(ErrorCode.CUDA_ERROR, RuntimeError, cute_flash.forward, *qkv())
    assert "CUDA GPU" in msg


def test_dlpack_inputs_are_accepted_without_copy():
    """Non-torch DLPack producers (numpy here) reach validation as zero-copy torch views."""
    q, k, v = (t.float().numpy() for t in qkv())
    expect(ErrorCode.CUDA_ERROR, RuntimeError, cute_flash.forward, q, k, v)
    arr = np.arange(8, dtype=np.float32)
    view = cute_flash.api.as_torch("x", arr)
    arr[0] = 42.0
    assert view[0].item() == 42.0


def fake(device):
    return types.SimpleNamespace(device=device)


def test_devices_must_match():
    with pytest.raises(cute_flash.CudaError, match="different devices"):
        check_device({"q": fake(torch.device("cuda", 0)), "k": fake(torch.device("cuda", 1))})


def test_gpu_older_than_sm80_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(cute_flash.CudaError, match=r"Tesla T4.*7\.5.*sm_80") as info:
        check_device({"q": fake(torch.device("cuda", 0))})
    assert info.value.code == ErrorCode.CUDA_ERROR


def test_backward_validates_gradient_shapes():
    q, k, v = qkv()
    lse = torch.zeros(2, 4, 16)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, cute_flash.backward, q[:, :8], q, k, v, q, lse)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, cute_flash.backward, q, q, k, v, q, lse, dk=torch.empty_like(k)[:1])
    expect(ErrorCode.CUDA_ERROR, RuntimeError, cute_flash.backward, q, q, k, v, q, lse)


def test_zero_softmax_scale_reaches_the_kernels_as_zero_scores_at_scale_one():
    """softmax_scale = 0: the kernels (which mask with -inf before scaling, and -inf * 0 is NaN)
    get q = 0 at scale 1, the same uniform probabilities; any other scale passes q through."""
    from cute_flash import api

    q = torch.randn(2, 5, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # strided: a fresh tensor anyway
    q_k, scale_k = api._uniform_scores(q, 0.0)
    assert scale_k == 1.0 and q_k.shape == q.shape and q_k.dtype == q.dtype and not q_k.any()
    q_k, scale_k = api._uniform_scores(q.contiguous(), 0.125)
    assert scale_k == 0.125 and torch.equal(q_k, q.contiguous())
