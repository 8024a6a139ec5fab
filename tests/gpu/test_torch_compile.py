"""flash_attn_func inside torch.compile (no graph break), checked against the float64 reference,
and the ops' registration checks."""

import pytest
import torch

import cute_flash
from cute_flash.autograd import attention_backward, attention_forward

from .common import assert_backward_accurate, assert_forward_accurate, randn

pytestmark = pytest.mark.gpu


def weighted_sum(q, k, v, weights):
    """A training step's forward: attention, then a loss whose gradient w.r.t. out is `weights`."""
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    return (out.float() * weights.float()).sum(), out, lse


def test_compiled_training_step_matches_reference():
    q, k, v = (randn(2, 257, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    weights = randn(2, 257, 4, 64, dtype=torch.bfloat16)
    compiled = torch.compile(weighted_sum, fullgraph=True)  # fullgraph: a graph break is an error
    loss, out, lse = compiled(q, k, v, weights)
    grads = torch.autograd.grad(loss, (q, k, v))
    q, k, v = (t.detach() for t in (q, k, v))
    assert_forward_accurate(out.detach(), lse, q, k, v, True)
    assert_backward_accurate(grads, weights, q, k, v, True)


def test_compiled_inference_matches_reference():
    q, k, v = (randn(1, 300, 8, 128, dtype=torch.float16) for _ in range(3))
    compiled = torch.compile(lambda a, b, c: cute_flash.flash_attn_func(a, b, c, return_lse=True), fullgraph=True)
    out, lse = compiled(q, k, v)
    assert_forward_accurate(out, lse, q, k, v, False)


def test_opcheck():
    q, k, v = (randn(1, 64, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    torch.library.opcheck(attention_forward, (q, k, v, 0.125, True))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, _ = attention_forward(q, k, v, 0.125, True)  # the third output: the (unused) dropout state
    torch.library.opcheck(attention_backward, (torch.randn_like(out), q, k, v, out, lse, 0.125, True, True))


@pytest.mark.parametrize("page_size", [0, 16])
def test_compiled_decode_step_matches_eager(page_size):
    """flash_attn_with_kvcache inside torch.compile(fullgraph=True): one op that appends to the
    caches; outputs, LSE and both caches as the eager call's on copies of the same inputs."""
    batch, heads_kv, head_dim, capacity = 3, 2, 128, 512
    lengths = torch.tensor([7, 300, 511], dtype=torch.int32, device="cuda")
    if page_size:
        pages = capacity // page_size
        k_cache = randn(batch * pages, page_size, heads_kv, head_dim, dtype=torch.bfloat16)
        block_table = torch.randperm(batch * pages, device="cuda").to(torch.int32).reshape(batch, pages)
    else:
        k_cache = randn(batch, capacity, heads_kv, head_dim, dtype=torch.bfloat16)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = randn(batch, 1, 8, head_dim, dtype=torch.bfloat16)
    k, v = (randn(batch, 1, heads_kv, head_dim, dtype=torch.bfloat16) for _ in range(2))

    def step(q, k_cache, v_cache, k, v, lengths):
        return cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                  block_table=block_table, causal=True, return_softmax_lse=True)

    eager_caches = (k_cache.clone(), v_cache.clone())
    ref_out, ref_lse = step(q, *eager_caches, k, v, lengths)
    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k, v, lengths)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])
