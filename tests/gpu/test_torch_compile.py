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
