"""Shared pieces of the GPU tests: random inputs, the same-dtype torch attention, error bars."""

import math

import torch

from cute_flash import reference_attention
from cute_flash.reference import causal_allowed


def randn(*shape, dtype, device="cuda", transposed=False):
    """Fresh standard-normal data; `transposed` gives a (B, S, H, D) view of a (B, H, S, D) tensor."""
    if transposed:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(*shape, device=device, dtype=dtype)


def same_dtype_attention(q, k, v, softmax_scale, causal):
    """Attention as torch computes it in the inputs' dtype (fp32 softmax): the error budget's yardstick."""
    h, hkv = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)).float() * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_allowed(q.shape[1], k.shape[1], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, vh).transpose(1, 2)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_forward_close(out, lse, q, k, v, causal, softmax_scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=scale, causal=causal)
    torch_err = max_err(same_dtype_attention(q, k, v, scale, causal), ref_out)
    assert not torch.isnan(out).any(), "output has NaN (unwritten poison or a real NaN)"
    err = max_err(out, ref_out)
    assert err <= 2 * torch_err + 1e-5, f"out error {err:.3e} > 2 x torch's {torch_err:.3e} + 1e-5"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly where a row sees no key"
    assert torch.all(torch.isneginf(lse[~finite]))
    lse_err = max_err(lse[finite], ref_lse[finite]) if finite.any() else 0.0
    assert lse_err <= 1e-3, f"lse error {lse_err:.3e}"
    return err, torch_err


def assert_counters_at_zero():
    """Every counter of the sm90 forward (kept per device, stream and tail plan, in front of the
    plan's words) is back at zero after the calls (kernels/sm90/fwd.py: TailPlan)."""
    from cute_flash import dispatch, forward_sm90
    from cute_flash.kernels.sm90.fwd import TailPlan

    for _, counters in forward_sm90._counters.values():
        assert int(counters[:TailPlan.plan_offset(dispatch.sm_count())].abs().sum()) == 0
