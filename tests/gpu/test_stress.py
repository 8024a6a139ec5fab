"""Back-to-back calls, hundreds of them, each compared bit for bit with the first: a race (a
counter not back at zero when the next call starts, a tile written twice, a read before the
write it depends on, a dependent launch that does not wait) shows as a call that differs."""

import pytest
import torch

import cute_flash

from .common import (
    assert_backward_accurate,
    assert_counters_at_zero,
    assert_forward_accurate,
    expected_backward_family,
    force_kernel_family,
    randn,
    run_forward,
    served_by,
)

pytestmark = pytest.mark.gpu

ROUNDS, RING = 8, 8
"""Each round poisons RING outputs, queues RING calls with nothing between them (so that each
call starts while the one before it ends) and compares them on the GPU: 64 calls per shape."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that equality is exact (NaN poison included)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def differing_elements(results, first):
    """Count, on the GPU (no synchronization), the elements of `results` that differ from `first`."""
    return sum((bits(got) != bits(ref)).sum() for got, ref in zip(results, first))


# (batch, (seqlen_q, seqlen_k), nheads, nheads_kv, head_dim, causal, dtype); comments: the sm90
# forward's schedule for each on an H100's 132 SMs (tests/gpu/test_forward.py checks the plans).
FORWARD_SHAPES = [
    (1, (2300, 3001), 58, 29, 128, False, torch.bfloat16),  # long: dynamic schedule, last 36 tiles in 3 pieces
    (2, (3000, 2500), 5, 1, 64, False, torch.float16),      # long: last 28 tiles in 4 pieces, MQA
    (2, (3001, 3500), 8, 4, 128, True, torch.bfloat16),     # mid causal: dynamic schedule, 192-row tiles
    (3, (1000, 1000), 16, 4, 128, True, torch.float16),     # short causal: static walk, planned tail
    (4, (1000, 1000), 16, 4, 128, False, torch.bfloat16),   # short non-causal: dynamic schedule
]


@pytest.mark.parametrize("family", ["native", "sm80"])
@pytest.mark.parametrize("batch, seqlens, nheads, nheads_kv, head_dim, causal, dtype", FORWARD_SHAPES, ids=str)
def test_forward_repeats_bit_for_bit(monkeypatch, family, batch, seqlens, nheads, nheads_kv, head_dim, causal, dtype):
    force_kernel_family(monkeypatch, family == "sm80")
    sq, sk = seqlens
    q = randn(batch, sq, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, sk, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    first = run_forward(q, k, v, causal)
    assert_forward_accurate(*first, q, k, v, causal)
    outs = [torch.empty_like(q) for _ in range(RING)]
    lses = [torch.empty_like(first[1]) for _ in range(RING)]
    differing = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(ROUNDS):
        for t in outs + lses:
            t.fill_(float("nan"))
        for out, lse in zip(outs, lses):
            cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal)
        for out, lse in zip(outs, lses):
            differing += differing_elements((out, lse), first)
    assert differing.item() == 0, f"{differing.item()} elements differ from the first call over {ROUNDS * RING} calls"
    assert_counters_at_zero()


# (batch, seqlen, nheads, nheads_kv, head_dim, causal, dtype, deterministic): variants other tests compile too.
BACKWARD_SHAPES = [
    (2, 1000, 8, 2, 64, True, torch.bfloat16, True),
    (2, 1000, 4, 4, 128, False, torch.float16, False),
]


@pytest.mark.parametrize("batch, seqlen, nheads, nheads_kv, head_dim, causal, dtype, deterministic", BACKWARD_SHAPES, ids=str)
def test_backward_repeats_bit_for_bit(batch, seqlen, nheads, nheads_kv, head_dim, causal, dtype, deterministic):
    """dK and dV (one CTA per key block) are bit-identical in either mode, dQ in deterministic
    mode; by default dQ's fp32 partial sums arrive by atomics in any order, so an element may
    round to a neighbour: one unit in the last place of its own value or of 1/64 of dQ's largest
    (fp32 sums that cancel), never the size of a lost or doubled partial sum (~1/8 of dQ here)."""
    q = randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, seqlen, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    out, lse = cute_flash.forward(q, k, v, causal=causal)

    def backward_into(grads):
        cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=causal,
                            deterministic=deterministic)

    first = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    with served_by(expected_backward_family(head_dim)):
        backward_into(first)
    assert_backward_accurate(first, dout, q, k, v, causal)
    exact = first if deterministic else first[1:]
    # finfo.eps, the spacing of values in [1, 2), bounds the spacing at |x| by eps * |x|.
    dq_allowed = torch.finfo(dtype).eps * (first[0].float().abs() + first[0].float().abs().max() / 64)
    ring = [[torch.empty_like(t) for t in (q, k, v)] for _ in range(RING)]
    differing = torch.zeros((), dtype=torch.int64, device="cuda")
    dq_beyond_one_ulp = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(ROUNDS // 2):
        for grads in ring:
            for t in grads:
                t.fill_(float("nan"))
        for grads in ring:
            backward_into(grads)
        for dq, dk, dv in ring:
            differing += differing_elements((dq, dk, dv) if deterministic else (dk, dv), exact)
            dq_beyond_one_ulp += ((dq.float() - first[0].float()).abs() > dq_allowed).sum() + torch.isnan(dq).sum()
    assert differing.item() == 0, f"{differing.item()} elements differ from the first call"
    assert dq_beyond_one_ulp.item() == 0, f"{dq_beyond_one_ulp.item()} dq elements differ by more than one unit in the last place"


@pytest.mark.parametrize("seqlens, causal, window", [((33000, 33000), True, (-1, -1)),
                                                     ((20000, 33000), True, (-1, -1)),
                                                     ((33000, 33000), False, (1000, 1000))], ids=str)
@pytest.mark.parametrize("family", ["native", "sm80"])
def test_deterministic_order_with_more_key_blocks_than_resident_ctas(monkeypatch, family, seqlens, causal, window):
    """With causal or window masks the deterministic backward's key blocks add in descending order,
    each waiting for the next one's add: 258 key blocks of one KV head cannot all be resident at
    once, so this hangs unless the grid starts every wait's predecessor first. The gradients
    repeat bit for bit and equal the default mode's: on the Hopper kernel dK, dV bit for bit and dQ
    up to the order of its fp32 sums; on the sm80 kernel (as the A100 runs it) up to 1/64 of the
    largest value, since its deterministic variant forms dS from the 16-bit P where the default
    keeps the fp32 P (a key block's dQ share added twice or not at all is larger)."""
    force_kernel_family(monkeypatch, family == "sm80")
    sq, sk = seqlens
    q, dout = (randn(1, sq, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (randn(1, sk, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse = cute_flash.forward(q, k, v, causal=causal, window_size=window)

    def backward(deterministic):
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=causal,
                            window_size=window, deterministic=deterministic)
        return grads

    with served_by(expected_backward_family(64)):
        ordered = backward(True)
    default, again = backward(False), backward(True)
    assert all(torch.equal(a, b) for a, b in zip(ordered, again)), "deterministic runs differ"
    for name, grad, grad_default in zip(("dq", "dk", "dv"), ordered, default):
        if family == "native" and name != "dq":
            assert torch.equal(grad, grad_default), name
            continue
        grad, grad_default = grad.float(), grad_default.float()
        allowed = grad_default.abs().max() / 64
        if family == "native":  # one unit in the last place of the element or of 1/64 of the largest
            allowed = torch.finfo(torch.bfloat16).eps * (grad_default.abs() + allowed)
        assert not torch.isnan(grad).any() and ((grad - grad_default).abs() <= allowed).all(), name
