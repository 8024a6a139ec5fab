"""Backward correctness on the GPU: dq, dk, dv against float64 autograd through the reference."""

import math

import pytest
import torch

import cute_flash
from cute_flash import reference_attention

from .common import max_err, randn, same_dtype_attention

pytestmark = pytest.mark.gpu

# Each head dim runs in one dtype (both for 128), so every dtype meets several head dims
# without compiling every (dtype, head dim) pair.
CASES = [(torch.float16, 32), (torch.bfloat16, 64), (torch.float16, 96), (torch.bfloat16, 128),
         (torch.float16, 128), (torch.float16, 192), (torch.bfloat16, 256)]
SEQLENS = [(1, 1), (113, 203), (64, 700), (1000, 1000)]


def reference_grads(q, k, v, dout, causal, scale):
    """(float64 gradients, torch's same-dtype gradients) for the error budget."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = reference_attention(q64, k64, v64, softmax_scale=scale, causal=causal)
    exact = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    lowp = torch.autograd.grad(same_dtype_attention(ql, kl, vl, scale, causal), (ql, kl, vl), dout)
    return exact, lowp


def run_backward(q, k, v, dout, causal, deterministic=False):
    out, lse = cute_flash.forward(q, k, v, causal=causal)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    dq, dk, dv = cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                     causal=causal, deterministic=deterministic)
    assert dq is grads[0] and dk is grads[1] and dv is grads[2]
    return dq, dk, dv


def assert_grads_close(grads, q, k, v, dout, causal):
    scale = 1 / math.sqrt(q.shape[-1])
    exact, lowp = reference_grads(q, k, v, dout, causal, scale)
    for name, got, ref, torch_grad in zip(("dq", "dk", "dv"), grads, exact, lowp):
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten poison or a real NaN)"
        bound = 2 * max_err(torch_grad, ref) + 1e-4
        err = max_err(got, ref)
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype, head_dim", CASES, ids=lambda c: str(c).split(".")[-1])
def test_backward_matches_float64_autograd(dtype, head_dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = randn(2, sq, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype)
    dout = randn(2, sq, 4, head_dim, dtype=dtype)
    assert_grads_close(run_backward(q, k, v, dout, causal), q, k, v, dout, causal)


# On the H100, d = 192-256 keep a second Q buffer (and dO up to 224), and d = 256 computes dQ in
# 64-column chunks, with the fp32 P only without grouped-query heads: those paths with grouped-query
# heads and the deterministic order, in both dtypes.
WIDE = [(torch.float16, 256, False, False, False), (torch.float16, 256, True, False, True),
        (torch.bfloat16, 256, False, False, True), (torch.bfloat16, 256, True, True, False),
        (torch.float16, 256, False, True, True), (torch.bfloat16, 224, False, False, True),
        (torch.float16, 224, True, True, False), (torch.bfloat16, 192, True, False, True)]


@pytest.mark.parametrize("dtype, head_dim, causal, deterministic, gqa", WIDE,
                         ids=lambda c: str(c).split(".")[-1])
def test_wide_head_dims_with_gqa_and_deterministic_order(dtype, head_dim, causal, deterministic, gqa):
    q = randn(2, 517, 4, head_dim, dtype=dtype)
    k, v = (randn(2, 333, 2 if gqa else 4, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(2, 517, 4, head_dim, dtype=dtype)
    assert_grads_close(run_backward(q, k, v, dout, causal, deterministic), q, k, v, dout, causal)


@pytest.mark.parametrize("nheads, nheads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa_sum_over_query_heads(nheads, nheads_kv, causal):
    q = randn(2, 300, nheads, 64, dtype=torch.bfloat16)
    k, v = (randn(2, 257, nheads_kv, 64, dtype=torch.bfloat16) for _ in range(2))
    dout = randn(2, 300, nheads, 64, dtype=torch.bfloat16)
    assert_grads_close(run_backward(q, k, v, dout, causal), q, k, v, dout, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_and_gradient_outputs(causal):
    q = randn(2, 200, 4, 128, dtype=torch.float16, transposed=True)
    k = randn(2, 190, 4, 128, dtype=torch.float16, transposed=True)
    v = randn(2, 190, 4, 128, dtype=torch.float16)
    dout = randn(2, 200, 4, 128, dtype=torch.float16, transposed=True)
    out, lse = cute_flash.forward(q, k, v, causal=causal)
    dq = torch.full((2, 4, 200, 128), float("nan"), device="cuda", dtype=torch.float16).transpose(1, 2)
    dk = torch.full((2, 4, 190, 128), float("nan"), device="cuda", dtype=torch.float16).transpose(1, 2)
    dv = torch.full_like(v, float("nan"))
    cute_flash.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=causal)
    assert_grads_close((dq, dk, dv), q, k, v, dout, causal)


@pytest.mark.parametrize("nheads_kv", [4, 2])
def test_deterministic_mode_is_bit_identical(nheads_kv):
    q = randn(2, 1000, 4, 64, dtype=torch.bfloat16)
    k, v = (randn(2, 1000, nheads_kv, 64, dtype=torch.bfloat16) for _ in range(2))
    dout = randn(2, 1000, 4, 64, dtype=torch.bfloat16)
    runs = [run_backward(q, k, v, dout, causal=True, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert_grads_close(runs[0], q, k, v, dout, True)


def test_autograd_through_flash_attn_func():
    q, k, v = (randn(2, 257, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = randn(2, 257, 4, 64, dtype=torch.bfloat16)
    out = cute_flash.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    assert_grads_close((q.grad, k.grad, v.grad), q.detach(), k.detach(), v.detach(), dout, True)


def test_forward_backward_memory_is_linear_in_seqlen():
    """B=1, H=8, N=16k, D=64: peak extra memory of forward + backward stays O(N)."""
    q, k, v = (randn(1, 16384, 8, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = randn(1, 16384, 8, 64, dtype=torch.bfloat16)
    cute_flash.flash_attn_func(q, k, v, causal=True).backward(dout)  # compile first
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cute_flash.flash_attn_func(q, k, v, causal=True).backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    per_tensor = q.numel() * q.element_size()
    # out, dq, dk, dv in bf16 plus an fp32 dq accumulator and row statistics: a small multiple of one
    # (N x H x D) tensor; the N^2 score matrix alone would be 4 GiB in fp16.
    print(f"peak extra memory fwd+bwd B=1 H=8 N=16k D=64: {extra / 2**20:.1f} MiB ({extra / per_tensor:.2f} x q)")
    assert extra <= 8 * per_tensor
