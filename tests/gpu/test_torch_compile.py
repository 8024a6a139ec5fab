"""flash_attn_func inside torch.compile (no graph break) and the ops' registration checks."""

import pytest
import torch

import cute_flash
from cute_flash.autograd import attention_backward, attention_forward

from .common import randn

pytestmark = pytest.mark.gpu


def loss_fn(q, k, v):
    return cute_flash.flash_attn_func(q, k, v, causal=True).float().sum()


def test_compiled_training_step_matches_eager():
    q, k, v = (randn(2, 257, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    eager_loss = loss_fn(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    compiled = torch.compile(loss_fn, fullgraph=True)  # fullgraph: a graph break is an error
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-3)
    for got, ref in zip(grads, eager_grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-2)


def test_compiled_inference_matches_eager():
    q, k, v = (randn(1, 300, 8, 128, dtype=torch.float16) for _ in range(3))
    compiled = torch.compile(lambda a, b, c: cute_flash.flash_attn_func(a, b, c) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), cute_flash.flash_attn_func(q, k, v) * 2, rtol=0, atol=0)


def test_opcheck():
    q, k, v = (randn(1, 64, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    torch.library.opcheck(attention_forward, (q, k, v, 0.125, True))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = attention_forward(q, k, v, 0.125, True)
    torch.library.opcheck(attention_backward, (torch.randn_like(out), q, k, v, out, lse, 0.125, True, True))
