"""The GPU tests' yardstick (tests/gpu/common.py), checked on the CPU against a float32 flash loop
written the way the kernels work: K/V blocks visited last to first, a running max, P rounded to
the input dtype relative to it, float32 accumulators rescaled as the max moves. The correct loop
sits well inside the bounds; the same loop with one bug does not."""

import math

import pytest
import torch

from cute_flash.reference import causal_allowed
from tests.gpu import common

BLOCK = 64


def flash_forward(q, k, v, causal, dropped_key=None, rescale_new_block=False, dropout=None):
    """(out, lse). `dropped_key`: left out of P·V (not of the row sum) in every row.
    `rescale_new_block`: the accumulator's rescale is applied to the arriving block's P·V too.
    `dropout`: (p, keep mask (batch, nheads, seqlen_q, seqlen_k)), as the kernels apply it."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, group, scale = k.shape[1], nheads // k.shape[2], 1 / math.sqrt(head_dim)
    allowed = causal_allowed(seqlen_q, seqlen_k) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    out, lse = torch.empty_like(q), torch.empty(batch, nheads, seqlen_q)
    for h in range(nheads):
        qh, kh, vh = q[:, :, h].float(), k[:, :, h // group].float(), v[:, :, h // group].float()
        row_max = torch.full((batch, seqlen_q, 1), float("-inf"))
        row_sum, acc = torch.zeros(batch, seqlen_q, 1), torch.zeros(batch, seqlen_q, head_dim)
        for start in reversed(range(0, seqlen_k, BLOCK)):
            keys = slice(start, start + BLOCK)
            s = (qh @ kh[:, keys].transpose(-1, -2) * scale).masked_fill(~allowed[:, keys], float("-inf"))
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            safe_max = torch.where(torch.isfinite(new_max), new_max, 0.0)
            rescale = torch.exp(torch.where(torch.isfinite(row_max), row_max, safe_max) - safe_max)
            p = torch.exp(s - safe_max)
            p16 = p.to(q.dtype).float()
            if dropped_key is not None and start <= dropped_key < start + BLOCK:
                p16[:, :, dropped_key - start] = 0
            if dropout is not None:
                p16 = p16 * dropout[1][:, h, :, keys]
            block_out = p16 @ vh[:, keys]
            acc = acc * rescale + (block_out * rescale if rescale_new_block else block_out)
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            row_max = new_max
        seen = row_sum > 0
        rescale_out = 1.0 if dropout is None else 1.0 / (1.0 - dropout[0])
        out[:, :, h] = torch.where(seen, acc / torch.where(seen, row_sum, 1.0) * rescale_out, 0.0).to(q.dtype)
        lse[:, h] = torch.where(seen, row_max + torch.log(row_sum), float("-inf")).squeeze(-1)
    return out, lse


def flash_backward(dout, q, k, v, out, lse, causal, p_from_16_bits=False, lost_dq_block=None, dropout=None,
                   unscaled_dp=False):
    """(dq, dk, dv) one K/V block at a time, dQ summed over blocks in float32. `p_from_16_bits`:
    dS from P rounded to the input dtype (as kernels that keep only the 16-bit P do).
    `lost_dq_block`: the dQ contribution of that K/V block never arrives (a lost atomic add).
    `dropout` as flash_forward's: dS = P (dP Z - D), Z = keep / (1 - p) (`unscaled_dp`: without the
    1 / (1 - p)), dV from the kept P scaled by 1 / (1 - p)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, group, scale = k.shape[1], nheads // k.shape[2], 1 / math.sqrt(head_dim)
    allowed = causal_allowed(seqlen_q, seqlen_k) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    delta = (dout.float() * out.float()).sum(-1)
    for h in range(nheads):
        qh, kh, vh, doh = q[:, :, h].float(), k[:, :, h // group].float(), v[:, :, h // group].float(), dout[:, :, h].float()
        row_lse = torch.where(torch.isfinite(lse[:, h, :, None]), lse[:, h, :, None], 0.0)
        for start in range(0, seqlen_k, BLOCK):
            keys = slice(start, start + BLOCK)
            s = (qh @ kh[:, keys].transpose(-1, -2) * scale).masked_fill(~allowed[:, keys], float("-inf"))
            p = torch.exp(s - row_lse)
            dp = doh @ vh[:, keys].transpose(-1, -2)
            keep, rescale = 1.0, 1.0
            if dropout is not None:
                keep, rescale = dropout[1][:, h, :, keys].float(), 1.0 / (1.0 - dropout[0])
                dp = dp * keep * (1.0 if unscaled_dp else rescale)
            ds = (p.to(q.dtype).float() if p_from_16_bits else p) * (dp - delta[:, :, h, None])
            dv[:, keys, h // group] += (p.to(q.dtype).float() * keep).transpose(-1, -2) @ doh * rescale
            dk[:, keys, h // group] += ds.to(q.dtype).float().transpose(-1, -2) @ qh * scale
            if start // BLOCK != lost_dq_block:
                dq[:, :, h] += ds.to(q.dtype).float() @ kh[:, keys]
    return (dq * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, nheads, head_dim).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, head_dim).to(dtype) for _ in range(2))
    return q, k, v


def forward_verdict(q, k, v, causal, **bug):
    scale = 1 / math.sqrt(q.shape[-1])
    ref, ref_lse = common.reference_attention(q, k, v, softmax_scale=scale, causal=causal)
    emulated, _ = common.emulate_forward(q, k, v, scale, causal)
    out, lse = flash_forward(q, k, v, causal, **bug)
    return common.measure("out", out, emulated, ref, common.FORWARD_FLOOR), lse, ref_lse


DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(1, 300, 400, 2, 1, 64), (2, 77, 131, 2, 2, 40), (1, 7, 7, 2, 2, 128), (1, 1, 1, 2, 2, 256)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_correct_forward_sits_inside_the_yardstick(dtype, shape, causal):
    q, k, v = inputs(*shape, dtype)
    verdict, lse, ref_lse = forward_verdict(q, k, v, causal)
    # Both errors come from the same roundings: about 1/3 of the max bound, 1/2 of the RMS bound.
    assert verdict.worst <= 0.6 and verdict.rms_ratio <= 0.7, verdict
    finite = torch.isfinite(ref_lse)
    assert ((lse[finite].double() - ref_lse[finite]).abs() <= common.LSE_TOLERANCE * (1 + ref_lse[finite].abs())).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropped_key_fails_the_yardstick(dtype):
    q, k, v = inputs(1, 300, 400, 2, 1, 64, dtype)
    verdict, _, _ = forward_verdict(q, k, v, True, dropped_key=100)
    assert not verdict.passed, verdict


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rescaled_new_block_fails_the_yardstick(dtype):
    q, k, v = inputs(1, 300, 400, 2, 1, 64, dtype)
    verdict, _, _ = forward_verdict(q, k, v, False, rescale_new_block=True)
    assert not verdict.passed, verdict


@pytest.mark.parametrize("p_from_16_bits", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 150, 200, 2, 1, 64), (2, 64, 300, 2, 2, 32), (1, 1, 1, 2, 2, 256)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_correct_backward_sits_inside_the_yardstick(dtype, shape, causal, p_from_16_bits):
    q, k, v = inputs(*shape, dtype)
    dout = torch.randn(q.shape).to(dtype)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = flash_forward(q, k, v, causal)
    grads = flash_backward(dout, q, k, v, out, lse, causal, p_from_16_bits)
    exact = common.reference_grads(dout, q, k, v, scale, causal)
    emulated_out, emulated_lse = common.emulate_forward(q, k, v, scale, causal)
    emulated = common.emulate_backward(dout, q, k, v, emulated_out, emulated_lse, scale, causal)
    for name, got, emu, ref in zip(("dq", "dk", "dv"), grads, emulated, exact):
        verdict = common.measure(name, got, emu, ref, common.BACKWARD_FLOOR)
        assert verdict.worst <= 0.6 and verdict.rms_ratio <= 0.75, verdict


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_with_a_lost_dq_block_fails_the_yardstick(dtype):
    q, k, v = inputs(1, 150, 400, 2, 1, 64, dtype)
    dout = torch.randn(q.shape).to(dtype)
    scale = 1 / math.sqrt(64)
    out, lse = flash_forward(q, k, v, False)
    dq = flash_backward(dout, q, k, v, out, lse, False, lost_dq_block=2)[0]
    emulated_out, emulated_lse = common.emulate_forward(q, k, v, scale, False)
    emulated_dq = common.emulate_backward(dout, q, k, v, emulated_out, emulated_lse, scale, False)[0]
    exact_dq = common.reference_grads(dout, q, k, v, scale, False)[0]
    assert not common.measure("dq", dq, emulated_dq, exact_dq, common.BACKWARD_FLOOR).passed


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_sits_inside_the_yardstick_and_a_missing_rescale_does_not(dtype, causal):
    """The yardstick's dropout emulation (the reference and emulation given the same keep mask)
    against the flash loops with the kernels' dropout; dS from dP without 1 / (1 - p) fails."""
    from cute_flash.dropout import dropout_keep_mask

    q, k, v = inputs(2, 150, 200, 2, 1, 64, dtype)
    dout = torch.randn(q.shape).to(dtype)
    scale, p = 1 / math.sqrt(64), 0.2
    keep = dropout_keep_mask(2, 2, 150, 200, p, torch.tensor([3, 4]))
    mods = dict(dropout_p=p, dropout_keep=keep)
    out, lse = flash_forward(q, k, v, causal, dropout=(p, keep))
    ref, _ = common.reference_attention(q, k, v, softmax_scale=scale, causal=causal, **mods)
    emulated_out, emulated_lse = common.emulate_forward(q, k, v, scale, causal, **mods)
    verdict = common.measure("out", out, emulated_out, ref, common.FORWARD_FLOOR)
    assert verdict.worst <= 0.6 and verdict.rms_ratio <= 0.75, verdict
    exact = common.reference_grads(dout, q, k, v, scale, causal, **mods)
    emulated = common.emulate_backward(dout, q, k, v, emulated_out, emulated_lse, scale, causal, **mods)
    for unscaled_dp in (False, True):
        grads = flash_backward(dout, q, k, v, out, lse, causal, dropout=(p, keep), unscaled_dp=unscaled_dp)
        verdicts = [common.measure(name, got, emu, ref, common.BACKWARD_FLOOR)
                    for name, got, emu, ref in zip(("dq", "dk", "dv"), grads, emulated, exact)]
        if unscaled_dp:
            assert not all(v.passed for v in verdicts[:2]), verdicts
        else:
            assert all(v.worst <= 0.6 and v.rms_ratio <= 0.75 for v in verdicts), verdicts
