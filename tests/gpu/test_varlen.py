"""Packed variable-length batches on the GPU (flash_attn_varlen_func, cute_flash.varlen): forward and
backward, sequence by sequence, against the float64 reference on each unpacked sequence within the
yardstick (tests/gpu/common.py). Both passes run the family's `call_varlen` entry points (the
Hopper kernels where they serve the dtype, head dim and modifications; the sm80 kernels too,
forced, on every GPU).

Batches hold sequences of length 0 and 1, ragged lengths up to 4k, seqlen_q != seqlen_k per
sequence, a sequence with queries and no keys, and rows before the first sequence (cu_seqlens[0] > 0)
whose outputs are unspecified and whose gradients stay untouched (given buffers) or zero (autograd).
`python -m tests.gpu.test_varlen --warm` compiles every kernel the tests run, several at once.
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import varlen

from .common import (
    assert_backward_accurate, assert_forward_accurate, expected_backward_family, expected_forward_family,
    force_kernel_family, randn, served_by,
)

pytestmark = pytest.mark.gpu

LENGTHS_Q = [0, 1, 17, 513, 4000, 129, 250]
LENGTHS_K = [5, 1, 33, 513, 3000, 0, 1200]
LEAD = 3  # rows of no sequence before the first
# (dtype, head dim, nheads, nheads_kv)
CONFIGS = [(torch.bfloat16, 128, 4, 2), (torch.float16, 64, 4, 4), (torch.bfloat16, 72, 2, 1)]


def cu(lengths, device="cuda"):
    return torch.tensor([LEAD] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def batch(config, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    dtype, head_dim, nheads, nheads_kv = config
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    q = randn(int(cu_q[-1]), nheads, head_dim, dtype=dtype)
    k, v = (randn(int(cu_k[-1]), nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(*q.shape, dtype=dtype)
    return q, k, v, dout, cu_q, cu_k, max(lengths_q), max(lengths_k)


def sequences(cu_q, cu_k):
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        yield b, slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


def check_sequences(out, lse, grads, q, k, v, dout, cu_q, cu_k, causal, **mods):
    """Each sequence's out, lse and gradients against the dense yardstick on that sequence alone."""
    dq, dk, dv = grads
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.start == rows_q.stop:  # keys no query sees: no gradient
            assert torch.all(dk[rows_k] == 0) and torch.all(dv[rows_k] == 0)
            continue
        if rows_k.start == rows_k.stop:  # queries without keys: out 0, lse -inf, no gradient
            assert torch.all(out[rows_q] == 0) and torch.all(torch.isneginf(lse[:, rows_q]))
            assert torch.all(dq[rows_q] == 0)
            continue
        seq_mods = dict(mods)
        slopes = mods.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            seq_mods["alibi_slopes"] = slopes[b]
        one = lambda t, rows: t[rows][None]  # noqa: E731
        assert_forward_accurate(one(out, rows_q), lse[:, rows_q][None], one(q, rows_q), one(k, rows_k),
                                one(v, rows_k), causal, **seq_mods)
        assert_backward_accurate([one(dq, rows_q), one(dk, rows_k), one(dv, rows_k)], one(dout, rows_q),
                                 one(q, rows_q), one(k, rows_k), one(v, rows_k), causal, **seq_mods)


def run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, deterministic=False, **mods):
    """forward_varlen, then backward_varlen into NaN-poisoned gradients (rows before the first
    sequence poisoned with 7: they must keep it), each on the family dispatch promises."""
    with served_by(expected_forward_family(q.shape[-1], q.dtype, plain=False)):
        out, lse = varlen.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, **mods)
    grads = []
    for t in (q, k, v):
        grad = torch.full_like(t, float("nan"))
        grad[:LEAD] = 7.0
        grads.append(grad)
    with served_by(expected_backward_family(q.shape[-1], q.dtype)):
        varlen.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq=grads[0], dk=grads[1],
                               dv=grads[2], causal=causal, deterministic=deterministic, **mods)
    for grad in grads:
        assert torch.all(grad[:LEAD] == 7.0), "rows of no sequence were written"
        assert torch.isfinite(grad[LEAD:]).all(), "a row of a sequence was not written"
    assert torch.isfinite(out[LEAD:]).all()
    return out, lse, grads


@pytest.fixture(params=["dispatch", "sm80"])
def forward_family(request, monkeypatch):
    """The family dispatch picks, and the sm80 kernels forced (on a Hopper GPU, their varlen
    forward would otherwise go untested)."""
    force_kernel_family(monkeypatch, request.param == "sm80")
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-h{c[2]}/{c[3]}")
def test_varlen(config, causal, forward_family):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(config)
    out, lse, grads = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal)
    check_sequences(out, lse, grads, q, k, v, dout, cu_q, cu_k, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [96, 192, 256])
def test_varlen_forward_head_dims(head_dim, causal):
    """The forward alone at the head dims CONFIGS leave out (each its own Hopper configuration)."""
    q, k, v, _, cu_q, cu_k, max_q, max_k = batch((torch.bfloat16, head_dim, 2, 1))
    with served_by(expected_forward_family(head_dim, q.dtype, plain=False)):
        out, lse = varlen.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    check_forward_sequences(out, lse, q, k, v, cu_q, cu_k, causal)


def check_forward_sequences(out, lse, q, k, v, cu_q, cu_k, causal):
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.start == rows_q.stop:
            continue
        if rows_k.start == rows_k.stop:
            assert torch.all(out[rows_q] == 0) and torch.all(torch.isneginf(lse[:, rows_q]))
            continue
        assert_forward_accurate(out[rows_q][None], lse[:, rows_q][None], q[rows_q][None], k[rows_k][None],
                                v[rows_k][None], causal)


# The Hopper kernels walk up to 256 sequences longest first (ranked by key length, ties by index:
# kernels/common/layouts.py, key_length_rank; the forward's TileScheduler.order_sequences, the
# backward's rank_sequence) and more in their given order: equal lengths, and 300 short
# sequences, each computed once and in full, forward and backward.
WALK_ORDER_LENGTHS = {
    "ties": ([64, 200, 64, 1, 200, 0, 64, 300, 300, 1, 17, 64], [64, 200, 64, 1, 200, 5, 64, 300, 300, 1, 17, 64]),
    "over-256": ([(7 * i) % 41 for i in range(300)], [(11 * i) % 37 + (i % 3 == 0) for i in range(300)]),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", WALK_ORDER_LENGTHS.values(), ids=WALK_ORDER_LENGTHS.keys())
def test_varlen_walk_order(lengths, causal):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch((torch.bfloat16, 64, 2, 1), *lengths)
    out, lse, grads = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal)
    check_sequences(out, lse, grads, q, k, v, dout, cu_q, cu_k, causal)


def test_varlen_fp32():
    config = (torch.float32, 64, 2, 1)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(config, [1, 300, 77], [9, 250, 640])
    out, lse, grads = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, True)
    check_sequences(out, lse, grads, q, k, v, dout, cu_q, cu_k, True)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_window_softcap_alibi(causal):
    config = CONFIGS[0]
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(config)
    slopes = torch.rand(len(LENGTHS_Q), config[2], device="cuda") * 0.1
    mods = dict(window_size=(96, 33), softcap=20.0, alibi_slopes=slopes)
    out, lse, grads = run(q * 3, k, v, dout, cu_q, cu_k, max_q, max_k, causal, **mods)
    check_sequences(out, lse, grads, q * 3, k, v, dout, cu_q, cu_k, causal, **mods)


@pytest.mark.parametrize("case", ["d64-causal-window-alibi", "d96-softcap", "d128-deterministic"])
def test_varlen_backward_variants(case):
    """Packed backwards the Hopper kernel serves beyond CONFIGS (sm80 elsewhere): a window with
    ALiBi, softcap at hd 96, and deterministic mode (bit-identical repeats)."""
    head_dim = int(case[1:].split("-")[0])
    config = (torch.bfloat16, head_dim, 4, 2)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(config)
    causal, mods = False, {}
    if "window" in case:
        causal = True
        mods = dict(window_size=(200, 0), alibi_slopes=torch.rand(config[2], device="cuda") * 0.1)
    if "softcap" in case:
        mods = dict(softcap=15.0)
    deterministic = "deterministic" in case
    out, lse, grads = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, deterministic=deterministic, **mods)
    check_sequences(out, lse, grads, q, k, v, dout, cu_q, cu_k, causal, **mods)
    if deterministic:
        _, _, again = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_varlen_deterministic_is_bit_identical():
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(CONFIGS[0])
    _, _, first = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, True, deterministic=True)
    _, _, again = run(q, k, v, dout, cu_q, cu_k, max_q, max_k, True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_flash_attn_varlen_func_autograd_and_compile():
    """The custom ops through autograd (gradients of rows of no sequence are zero) and inside
    torch.compile(fullgraph=True)."""
    q, k, v, dout, cu_q, cu_k, max_q, max_k = batch(CONFIGS[0])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def step(q, k, v):
        # deterministic=True: the eager and compiled gradients must then agree bit for bit
        return cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, None, True, (-1, -1), 0.0,
                                                 None, True, True)

    with served_by(expected_forward_family(q.shape[-1], q.dtype, plain=False)):
        out, lse, probs = step(*leaves)
    with served_by(expected_backward_family(q.shape[-1], q.dtype)):
        out.backward(dout)
    assert probs is None
    grads = [t.grad for t in leaves]
    for grad in grads:
        assert torch.all(grad[:LEAD] == 0)
    check_sequences(out.detach(), lse, grads, q, k, v, dout, cu_q, cu_k, True)
    compiled = torch.compile(step, fullgraph=True)
    leaves2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out2, _, _ = compiled(*leaves2)
    out2.backward(dout)
    # output rows of no sequence are left unwritten (as flash-attn leaves them)
    torch.testing.assert_close(out2[LEAD:], out.detach()[LEAD:], rtol=0, atol=0)
    for a, b in zip(grads, (t.grad for t in leaves2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_forms():
    config = (torch.float16, 64, 2, 2)
    q, k, v, dout, cu_q, _, max_q, _ = batch(config, [5, 700, 64], [5, 700, 64])
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    out = cute_flash.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, causal=True)
    out.backward(dout)
    ref, _ = varlen.forward_varlen(q, k, v, cu_q, cu_q, max_q, max_q, causal=True)
    torch.testing.assert_close(out[LEAD:], ref[LEAD:], rtol=0, atol=0)
    assert torch.all(qkv.grad[:LEAD] == 0) and torch.isfinite(qkv.grad).all()


def test_bad_cu_seqlens_values_raise_before_anything_runs():
    q, k, v, _, cu_q, cu_k, max_q, max_k = batch(CONFIGS[1], [3, 5], [4, 4])
    bad = cu_q.clone()
    bad[1] = bad[2] + 1
    with pytest.raises(cute_flash.InvalidDimensionError, match="non-decreasing"):
        cute_flash.flash_attn_varlen_func(q, k, v, bad, cu_k, max_q, max_k)
    with pytest.raises(cute_flash.InvalidDimensionError, match="max_seqlen_q=4 is smaller"):
        cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, max_k)
    with pytest.raises(cute_flash.CudaError, match="different devices"):
        cute_flash.flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k, max_q, max_k)


def _jobs():
    """(dtype, head dim, causal, mods flags, deterministic, gqa) of every kernel set the tests run."""
    from cute_flash.validate import score_mods

    jobs = set()
    cases = [(config, causal, {}, False) for config in CONFIGS for causal in (False, True)]
    cases += [((torch.float32, 64, 2, 1), True, {}, False), ((torch.float16, 64, 2, 2), True, {}, False),
              (CONFIGS[0], True, {}, True)]
    cases += [((torch.bfloat16, head_dim, 2, 1), causal, {}, False) for head_dim in (96, 192, 256)
              for causal in (False, True)]
    cases += [((torch.bfloat16, 64, 4, 2), True, dict(window_size=(200, 0), alibi_slopes=True), False),
              ((torch.bfloat16, 96, 4, 2), False, dict(softcap=15.0), False), ((torch.bfloat16, 128, 4, 2), False, {}, True)]
    every = dict(window_size=(96, 33), softcap=20.0, alibi_slopes=True)
    cases += [(CONFIGS[0], causal, every, False) for causal in (False, True)]
    for (dtype, head_dim, nheads, nheads_kv), causal, mods, det in cases:
        kernel = score_mods(causal, mods.get("window_size", (-1, -1)), mods.get("softcap", 0.0),
                            mods.get("alibi_slopes"), max(LENGTHS_Q), max(LENGTHS_K))
        jobs.add((str(dtype), head_dim, kernel.causal, kernel.flags, det, nheads != nheads_kv))
    return sorted(jobs, key=str)


def _compile(job):
    from cute_flash import dispatch

    dtype, head_dim, causal, flags, det, gqa = job
    dtype = getattr(torch, dtype.split(".")[-1])
    capability = torch.cuda.get_device_capability()
    plans = [dispatch.plan_forward(capability, dtype, head_dim, causal, mods=flags, varlen=True, family=family)
             for family in (None, "sm80")]
    for family in (None, "sm80"):
        backward = dispatch.plan_backward(capability, dtype, head_dim, causal, det, gqa, mods=flags, varlen=True,
                                          family=family)
        plans += [backward.pre, backward.main, backward.post]
    for plan in plans:
        plan.compiled()
    return job


if __name__ == "__main__":  # python -m tests.gpu.test_varlen --warm: compile the tests' kernels in parallel
    import sys

    from .common import warm_in_parallel

    if "--warm" in sys.argv:
        warm_in_parallel(_compile, _jobs())
