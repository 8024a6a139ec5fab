"""Backward correctness on the GPU: dq, dk, dv against float64 autograd through the reference."""

import contextlib

import pytest
import torch

import cute_flash

from .common import (
    assert_backward_accurate,
    backward_determinism_flags,
    expected_backward_family,
    expected_forward_family,
    families_of,
    kernels_used,
    randn,
    run_backward,
    served_by,
)

pytestmark = pytest.mark.gpu

# Each head dim runs in one dtype (both for 128), so every dtype meets several head dims
# without compiling every (dtype, head dim) pair.
CASES = [(torch.float16, 32), (torch.bfloat16, 64), (torch.float16, 96), (torch.bfloat16, 128),
         (torch.float16, 128), (torch.float16, 192), (torch.bfloat16, 256)]
SEQLENS = [(1, 1), (113, 203), (64, 700), (1000, 1000)]


def autograd_grads(q, k, v, dout, causal, softmax_scale=None):
    """Gradients through flash_attn_func and torch.autograd (the custom ops' path)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    cute_flash.flash_attn_func(*leaves, softmax_scale=softmax_scale, causal=causal).backward(dout)
    return tuple(t.grad for t in leaves)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype, head_dim", CASES, ids=lambda c: str(c).split(".")[-1])
def test_backward_matches_float64_autograd(dtype, head_dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = randn(2, sq, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype)
    dout = randn(2, sq, 4, head_dim, dtype=dtype)
    assert_backward_accurate(run_backward(q, k, v, dout, causal), dout, q, k, v, causal)


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
    assert_backward_accurate(run_backward(q, k, v, dout, causal, deterministic), dout, q, k, v, causal)


@pytest.mark.parametrize("nheads, nheads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa_sum_over_query_heads(nheads, nheads_kv, causal):
    q = randn(2, 300, nheads, 64, dtype=torch.bfloat16)
    k, v = (randn(2, 257, nheads_kv, 64, dtype=torch.bfloat16) for _ in range(2))
    dout = randn(2, 300, nheads, 64, dtype=torch.bfloat16)
    assert_backward_accurate(run_backward(q, k, v, dout, causal), dout, q, k, v, causal)


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
    with served_by(expected_backward_family(128)):
        cute_flash.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=causal)
    assert_backward_accurate((dq, dk, dv), dout, q, k, v, causal)


@pytest.mark.parametrize("dtype, head_dim, causal, softmax_scale", [
    (torch.bfloat16, 64, True, 0.37),    # between the default 0.125 and 1
    (torch.float16, 128, False, 0.02),   # flat softmax: every key matters
    (torch.bfloat16, 128, True, 0.5),    # 5.7x the default: a peaked softmax, large dS
], ids=str)
def test_backward_with_softmax_scale(dtype, head_dim, causal, softmax_scale):
    """A scale other than 1/sqrt(d) reaches the backward's P and the final dQ/dK scaling, through
    the API and through autograd (which keeps the scale for the backward)."""
    q = randn(2, 300, 4, head_dim, dtype=dtype)
    k, v = (randn(2, 280, 2, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(2, 300, 4, head_dim, dtype=dtype)
    grads = run_backward(q, k, v, dout, causal, softmax_scale=softmax_scale)
    assert_backward_accurate(grads, dout, q, k, v, causal, softmax_scale=softmax_scale)
    assert_backward_accurate(autograd_grads(q, k, v, dout, causal, softmax_scale), dout, q, k, v, causal,
                             softmax_scale=softmax_scale)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside the block only: torch's own CUDA matmuls,
    which the yardstick uses, refuse to run in that mode without a cuBLAS workspace setting."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# Variants whose deterministic kernels other tests compile too, and on the H100 the Hopper
# backward's 128-row query blocks (hd 64 non-causal) in fp16 with grouped-query heads and its
# 16-column swizzle for dQ (hd 96).
DETERMINISTIC_CASES = [
    (torch.bfloat16, 64, True, (1000, 1000), 2),
    (torch.float16, 64, False, (1000, 777), 2),
    (torch.bfloat16, 64, True, (517, 333), 4),
    (torch.float16, 256, False, (300, 700), 2),
    (torch.bfloat16, 256, True, (700, 300), 4),
    (torch.float16, 224, True, (113, 203), 4),
    (torch.bfloat16, 96, True, (700, 900), 2),
]


@pytest.mark.parametrize("dtype, head_dim, causal, seqlens, nheads_kv", DETERMINISTIC_CASES, ids=str)
def test_deterministic_mode_is_bit_identical(dtype, head_dim, causal, seqlens, nheads_kv):
    """With torch.use_deterministic_algorithms(True) autograd asks for the deterministic backward,
    and three runs give bitwise-equal gradients (torch also fills its fresh buffers with NaN in
    this mode, so a workspace the kernels read before writing shows)."""
    sq, sk = seqlens
    q = randn(2, sq, 4, head_dim, dtype=dtype)
    k, v = (randn(2, sk, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(2, sq, 4, head_dim, dtype=dtype)
    with deterministic_algorithms(), backward_determinism_flags() as flags:
        runs = [autograd_grads(q, k, v, dout, causal) for _ in range(3)]
    assert flags == [True] * 3
    for other in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(first, again), f"{name} differs between deterministic runs"
    assert_backward_accurate(runs[0], dout, q, k, v, causal)


def test_autograd_through_flash_attn_func():
    q, k, v = (randn(2, 257, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    dout = randn(2, 257, 4, 64, dtype=torch.bfloat16)
    with kernels_used() as keys, backward_determinism_flags() as flags:
        grads = autograd_grads(q, k, v, dout, True)
    assert families_of(keys) == {expected_forward_family(64), expected_backward_family(64)}
    assert flags == [False]
    assert_backward_accurate(grads, dout, q, k, v, True)


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
