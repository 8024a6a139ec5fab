"""Dropout on the GPU: out and gradients against the float64 reference with the mask regenerated on
the host (cute_flash.dropout.dropout_keep_mask, the kernels' own Philox mapping), the keep rate, and
reproducibility from torch's generator. Every dropout kernel is an sm80 kernel, on every GPU.
`python -m tests.gpu.test_dropout --warm` compiles the kernels the tests below run.
"""

from __future__ import annotations

import sys

import pytest
import torch

import cute_flash
from cute_flash.dropout import draw_rng_state, dropout_keep_mask
from cute_flash.flash_attn_interface import flash_attn_func
from cute_flash.reference import reference_attention

from .common import randn

pytestmark = pytest.mark.gpu

# (dtype, head dim, nheads, nheads_kv)
CONFIGS = [(torch.float16, 64, 4, 4), (torch.bfloat16, 128, 4, 2), (torch.bfloat16, 72, 2, 1), (torch.float32, 64, 2, 2)]
SHAPES = [(1, 1), (113, 203), (640, 77), (517, 1000)]
P = 0.17


def _run(config, sq, sk, causal, p=P, seed=0, deterministic=False):
    dtype, head_dim, nheads, nheads_kv = config
    torch.manual_seed(1234)
    q = randn(2, sq, nheads, head_dim, dtype=dtype).requires_grad_()
    k, v = (randn(2, sk, nheads_kv, head_dim, dtype=dtype).requires_grad_() for _ in range(2))
    dout = randn(2, sq, nheads, head_dim, dtype=dtype)
    torch.manual_seed(seed)
    offset = torch.cuda.default_generators[0].get_offset()
    out = flash_attn_func(q, k, v, p, causal=causal, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rng_state = torch.tensor([seed, offset], dtype=torch.int64)
    return (q, k, v, dout), out, grads, rng_state


def _tolerance(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-4}[dtype]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_dropout_matches_reference_with_regenerated_mask(config, shape, causal):
    sq, sk = shape
    (q, k, v, dout), out, grads, rng_state = _run(config, sq, sk, causal)
    keep = dropout_keep_mask(2, config[2], sq, sk, P, rng_state, device="cuda")
    ref, _ = reference_attention(q, k, v, causal=causal, dropout_p=P, dropout_keep=keep)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    tol = _tolerance(config[0])
    scale = ref.abs().max().item() + 1
    assert (out.double() - ref).abs().max().item() <= tol * scale
    for grad, ref_grad in zip(grads, ref_grads):
        assert (grad.double() - ref_grad).abs().max().item() <= 4 * tol * (ref_grad.abs().max().item() + 1)


def test_keep_rate_within_four_sigma():
    """The kernels' own keep rate: with v = 1 (one column) every output row is the sum of the kept
    probabilities times 1 / (1 - p), against the same sum of the mask drawn on the host."""
    p, sq, sk = 0.3, 1024, 1024
    torch.manual_seed(5)
    offset = torch.cuda.default_generators[0].get_offset()
    q = torch.zeros(1, sq, 1, 64, dtype=torch.float16, device="cuda")
    v = torch.ones(1, sk, 1, 64, dtype=torch.float16, device="cuda")
    out = flash_attn_func(q, q[:, :sk], v, p)
    keep = dropout_keep_mask(1, 1, sq, sk, p, torch.tensor([5, offset]), device="cuda")
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) <= 4 * (p * (1 - p) / keep.numel()) ** 0.5
    kept_per_row = out[0, :, 0, 0].double() * (1 - p) * sk
    torch.testing.assert_close(kept_per_row, keep[0, 0].double().sum(-1), rtol=2e-3, atol=0.5)


def test_same_seed_is_bit_identical_and_another_seed_differs():
    config = (torch.bfloat16, 64, 4, 2)
    _, out_a, grads_a, state_a = _run(config, 300, 300, True, seed=3, deterministic=True)
    _, out_b, grads_b, state_b = _run(config, 300, 300, True, seed=3, deterministic=True)
    _, out_c, _, _ = _run(config, 300, 300, True, seed=4, deterministic=True)
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert not torch.equal(out_a, out_c)
    assert not torch.equal(dropout_keep_mask(2, 4, 300, 300, P, state_a), dropout_keep_mask(2, 4, 300, 300, P,
                                                                                          torch.tensor([4, 0])))


def test_generator_offset_advances_per_call():
    torch.manual_seed(0)
    first = draw_rng_state("cuda", 2, 3)
    second = draw_rng_state("cuda", 2, 3)
    assert first[0] == second[0] == 0 and second[1] - first[1] == 8  # 6 streams, rounded up to 4


def test_functional_api_takes_the_stream_explicitly():
    q = randn(1, 64, 2, 64, dtype=torch.float16)
    state = torch.tensor([11, 0], dtype=torch.int64)
    out_a, lse_a = cute_flash.forward(q, q, q, dropout_p=0.5, rng_state=state)
    out_b, lse_b = cute_flash.forward(q, q, q, dropout_p=0.5, rng_state=state)
    _, lse_plain = cute_flash.forward(q, q, q)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_plain)


def warm() -> None:
    """Compile every kernel the tests above run (one forward + backward per config and causal)."""
    for config in CONFIGS:
        for causal in (False, True):
            _run(config, 130, 70, causal)
    _run((torch.bfloat16, 64, 4, 2), 300, 300, True, deterministic=True)
    torch.cuda.synchronize()


if __name__ == "__main__" and "--warm" in sys.argv:
    warm()
