"""Dropout on the GPU: out, lse and gradients against the float64 reference with the mask
regenerated on the host (cute_flash.dropout.dropout_keep_mask, the kernels' own Philox mapping),
within the yardstick (tests/gpu/common.py, its emulation dropping the same entries); the keep rate;
reproducibility from torch's generator. The forward runs the Hopper forward on an H100 / H200 for
fp16 / bf16 at head dims 64, 96 and 128, the sm80 one otherwise; the backward the Hopper backward
at every head dim it serves (it draws the mask on S^T), the sm80 one otherwise. The mask is a
function of element coordinates, so every kernel draws the same one.
`python -m tests.gpu.test_dropout --warm` compiles every kernel the tests below run, several at once.
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.dropout import draw_rng_state, dropout_keep_mask
from cute_flash.flash_attn_interface import flash_attn_func, flash_attn_qkvpacked_func

from .common import (assert_backward_accurate, assert_forward_accurate, expected_backward_family,
                     expected_forward_family, randn, served_by)

pytestmark = pytest.mark.gpu

# (dtype, head dim, nheads, nheads_kv): both 16-bit dtypes, fp32, 64 to 256, a padded head dim, GQA
CONFIGS = [(torch.float16, 64, 4, 4), (torch.bfloat16, 128, 4, 2), (torch.bfloat16, 72, 2, 1),
           (torch.float32, 64, 2, 2), (torch.bfloat16, 96, 4, 2), (torch.float16, 256, 2, 1)]
SHAPES = [(1, 1), (113, 203), (640, 77), (517, 1000)]
P = 0.17


def inputs(config, sq, sk, batch=2):
    dtype, head_dim, nheads, nheads_kv = config
    q = randn(batch, sq, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, sk, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, randn(batch, sq, nheads, head_dim, dtype=dtype)


def dropout_forward_family(head_dim: int, dtype, alibi: bool = False) -> str:
    """The Hopper forward has dropout up to head dim 128, without ALiBi (its Philox rounds spill
    beyond), and not for fp32 (its split-TF32 forward has none)."""
    hopper = head_dim <= 128 and not alibi and dtype != torch.float32
    return expected_forward_family(head_dim, dtype) if hopper else "sm80"


def run(q, k, v, dout, causal, p=P, seed=0, deterministic=False, **mods):
    """flash_attn_func with dropout from torch's generator after manual_seed(seed): out, lse,
    grads and the call's (seed, offset)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(seed)
    offset = torch.cuda.default_generators[torch.cuda.current_device()].get_offset()
    with served_by(dropout_forward_family(q.shape[-1], q.dtype, mods.get("alibi_slopes") is not None)):
        out, lse = flash_attn_func(q, k, v, p, causal=causal, deterministic=deterministic, return_lse=True, **mods)
    with served_by(expected_backward_family(q.shape[-1], q.dtype)):
        grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads, torch.tensor([seed, offset], dtype=torch.int64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_dropout_matches_reference_with_regenerated_mask(config, shape, causal):
    sq, sk = shape
    q, k, v, dout = inputs(config, sq, sk)
    out, lse, grads, rng_state = run(q, k, v, dout, causal)
    keep = dropout_keep_mask(q.shape[0], q.shape[2], sq, sk, P, rng_state, device="cuda")
    assert_forward_accurate(out, lse, q, k, v, causal, dropout_p=P, dropout_keep=keep)
    assert_backward_accurate(grads, dout, q, k, v, causal, dropout_p=P, dropout_keep=keep)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mods", [dict(window_size=(17, 0)), dict(softcap=20.0),
                                  dict(window_size=(90, 40), softcap=20.0, alibi_slopes=True)], ids=str)
@pytest.mark.parametrize("config", [(torch.bfloat16, 128, 4, 2), (torch.float16, 64, 4, 2)], ids=str)
def test_dropout_with_score_modifications(config, mods, deterministic):
    q, k, v, dout = inputs(config, 300, 333)
    if "alibi_slopes" in mods:
        mods = dict(mods, alibi_slopes=torch.rand(2, 4, device="cuda", dtype=torch.float32))
    out, lse, grads, rng_state = run(q, k, v, dout, False, deterministic=deterministic, **mods)
    keep = dropout_keep_mask(2, 4, 300, 333, P, rng_state, device="cuda")
    assert_forward_accurate(out, lse, q, k, v, False, dropout_p=P, dropout_keep=keep, **mods)
    assert_backward_accurate(grads, dout, q, k, v, False, dropout_p=P, dropout_keep=keep, **mods)


def test_keep_rate_within_four_sigma():
    """The kernels' own keep rate over 2^20 elements: with zero scores and v = 1 every output is
    the row's kept count / (seqlen_k (1 - p)); the counts equal the host mask's, and its rate is
    within 4 sigma of 1 - p."""
    p, n = 0.3, 1024
    q = torch.zeros(1, n, 1, 64, dtype=torch.float16, device="cuda")
    v = torch.ones(1, n, 1, 64, dtype=torch.float16, device="cuda")
    torch.manual_seed(5)
    offset = torch.cuda.default_generators[torch.cuda.current_device()].get_offset()
    out = flash_attn_func(q, q, v, p)
    keep = dropout_keep_mask(1, 1, n, n, p, torch.tensor([5, offset]), device="cuda")
    assert abs(keep.double().mean().item() - (1 - p)) <= 4 * (p * (1 - p) / keep.numel()) ** 0.5
    kept = out[0, :, 0].double() * (1 - p) * n
    torch.testing.assert_close(kept, keep[0, 0].double().sum(-1, keepdim=True).expand_as(kept), rtol=2e-3, atol=0.5)


def test_same_seed_is_bit_identical_and_another_seed_differs():
    q, k, v, dout = inputs((torch.bfloat16, 64, 4, 2), 300, 300)
    out_a, _, grads_a, state_a = run(q, k, v, dout, True, seed=3, deterministic=True)
    out_b, _, grads_b, state_b = run(q, k, v, dout, True, seed=3, deterministic=True)
    out_c, _, _, state_c = run(q, k, v, dout, True, seed=4, deterministic=True)
    assert torch.equal(state_a, state_b)
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert not torch.equal(out_a, out_c)
    assert not torch.equal(dropout_keep_mask(2, 4, 300, 300, P, state_a), dropout_keep_mask(2, 4, 300, 300, P, state_c))


def test_generator_offset_advances_per_call():
    torch.manual_seed(0)
    first = draw_rng_state("cuda", 2, 3)
    second = draw_rng_state("cuda", 2, 3)
    assert first.tolist() == [0, 0] and second.tolist() == [0, 8]  # 6 streams, rounded up to 4
    qkv = randn(2, 64, 3, 3, 64, dtype=torch.float16)  # drawing it advances the generator too
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    before = generator.get_offset()
    flash_attn_qkvpacked_func(qkv, P)
    assert generator.get_offset() == before + 8  # 2 x 3 streams, rounded up to 4


def test_functional_api_takes_the_stream_explicitly():
    q = randn(1, 64, 2, 64, dtype=torch.float16)
    state = torch.tensor([11, 0], dtype=torch.int64)
    out_a, lse_a = cute_flash.forward(q, q, q, dropout_p=0.5, rng_state=state)
    out_b, _ = cute_flash.forward(q, q, q, dropout_p=0.5, rng_state=state)
    out_plain, lse_plain = cute_flash.forward(q, q, q)
    assert torch.equal(out_a, out_b) and not torch.equal(out_a, out_plain)
    torch.testing.assert_close(lse_a, lse_plain, rtol=0, atol=1e-5)
    with pytest.raises(cute_flash.MissingTensorError, match="rng_state"):
        cute_flash.forward(q, q, q, dropout_p=0.5)


def _jobs():
    """(dtype, head dim, causal, mods flags, deterministic, gqa) of every kernel set the tests run."""
    jobs = {(str(dtype), head_dim, causal, (False, False, False), False, nheads != nheads_kv)
            for dtype, head_dim, nheads, nheads_kv in CONFIGS for causal in (False, True)}
    jobs |= {(dtype, head_dim, False, flags, det, True)
             for dtype, head_dim in (("torch.bfloat16", 128), ("torch.float16", 64))
             for flags in ((True, False, False), (False, True, False), (True, True, True)) for det in (False, True)}
    jobs |= {("torch.bfloat16", 64, True, (False, False, False), True, True),
             ("torch.float16", 64, False, (False, False, False), False, False)}
    return sorted(jobs, key=str)


def _compile(job):
    from cute_flash import dispatch

    dtype, head_dim, causal, flags, det, gqa = job
    dtype = getattr(torch, dtype.split(".")[-1])
    capability = torch.cuda.get_device_capability()
    backward = dispatch.plan_backward(capability, dtype, head_dim, causal, det, gqa, mods=flags, dropout=True)
    for plan in (dispatch.plan_forward(capability, dtype, head_dim, causal, mods=flags, dropout=True),
                 backward.pre, backward.main, backward.post):
        plan.compiled()
    return job


if __name__ == "__main__":  # python -m tests.gpu.test_dropout --warm: compile the tests' kernels in parallel
    import sys

    from .common import warm_in_parallel

    if "--warm" in sys.argv:
        warm_in_parallel(_compile, _jobs())
