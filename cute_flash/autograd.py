"""`flash_attn_func`: the PyTorch-facing, differentiable entry point."""

from __future__ import annotations

import torch

from . import api


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        out, lse = api.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.backward(
            dout, q, k, v, out, lse, softmax_scale=ctx.softmax_scale, causal=ctx.causal,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return dq, dk, dv, None, None


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact attention, FlashAttention style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads a multiple of nheads_kv (MQA/GQA). fp16 or bf16 on an sm_80-or-newer GPU; headdim any
    multiple of 8 up to 256; any strides. Causal masking is bottom-right aligned. Returns `out`
    (like q), and also `lse` ((batch, nheads, seqlen_q) float32, natural log) if `return_lse`.
    Differentiable w.r.t. q, k and v.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal)
    else:  # inference: skip autograd's bookkeeping (about 20 µs a call)
        out, lse = api.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return (out, lse) if return_lse else out
