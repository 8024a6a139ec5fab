"""`forward` and `backward` on CuPy and JAX arrays hand back arrays of the caller's framework (zero
copy through DLPack), with the same results as on torch tensors. Skipped where a framework is
missing or has no GPU."""

import os

import pytest
import torch

import cute_flash

from .common import assert_backward_accurate, assert_forward_accurate, randn

pytestmark = pytest.mark.gpu

# JAX takes most of the GPU's memory at its first use unless told otherwise; torch shares the GPU here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CuPy sees no GPU")
    return cupy


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    return jax


def inputs(dtype, sq=200, sk=300, h=4, hkv=2, d=64):
    return randn(2, sq, h, d, dtype=dtype), randn(2, sk, hkv, d, dtype=dtype), randn(2, sk, hkv, d, dtype=dtype)


def test_cupy_arrays_in_cupy_arrays_out(cupy):
    q, k, v = inputs(torch.float16)  # CuPy has no bfloat16
    cq, ck, cv = (cupy.from_dlpack(t) for t in (q, k, v))
    out, lse = cute_flash.forward(cq, ck, cv, causal=True)
    assert type(out) is cupy.ndarray and type(lse) is cupy.ndarray
    assert out.shape == q.shape and out.dtype == cupy.float16 and lse.dtype == cupy.float32
    assert_forward_accurate(torch.from_dlpack(out), torch.from_dlpack(lse), q, k, v, causal=True)

    dout = randn(*q.shape, dtype=torch.float16)
    grads = cute_flash.backward(cupy.from_dlpack(dout), cq, ck, cv, out, lse, causal=True)
    assert all(type(g) is cupy.ndarray for g in grads)
    assert_backward_accurate([torch.from_dlpack(g) for g in grads], dout, q, k, v, True)


def test_cupy_outputs_given_are_written_and_returned(cupy):
    q, k, v = inputs(torch.float16)
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float16)
    lse = cupy.full((2, 4, 200), cupy.nan, dtype=cupy.float32)
    got = cute_flash.forward(*(cupy.from_dlpack(t) for t in (q, k, v)), out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert_forward_accurate(torch.from_dlpack(out), torch.from_dlpack(lse), q, k, v, causal=False)


def test_jax_arrays_in_jax_arrays_out(jax):
    q, k, v = inputs(torch.bfloat16)
    jq, jk, jv = (jax.numpy.from_dlpack(t) for t in (q, k, v))
    jax.block_until_ready((jq, jk, jv))
    out, lse = cute_flash.forward(jq, jk, jv, causal=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.shape == q.shape and out.dtype == jax.numpy.bfloat16 and lse.dtype == jax.numpy.float32
    assert_forward_accurate(torch.from_dlpack(out), torch.from_dlpack(lse), q, k, v, causal=True)

    dout = randn(*q.shape, dtype=torch.bfloat16)
    grads = cute_flash.backward(jax.numpy.from_dlpack(dout), jq, jk, jv, out, lse, causal=True)
    assert all(isinstance(g, jax.Array) for g in grads)
    assert_backward_accurate([torch.from_dlpack(g) for g in grads], dout, q, k, v, True)
