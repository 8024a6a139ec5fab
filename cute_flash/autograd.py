"""`flash_attn_func`: the PyTorch-facing, differentiable entry point.

Forward and backward are `torch.library` custom ops, so autograd and `torch.compile` (which cannot
trace into CuTe DSL kernels) see two opaque operators with known output shapes: compiled graphs
keep them without a graph break. Eager inference skips the op layer and calls `api.forward`
directly, which saves the op dispatch on every call.
"""

from __future__ import annotations

import torch

from . import api
from .validate import check_qkv, check_softmax_scale


@torch.library.custom_op("cute_flash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return api.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)


@attention_forward.register_fake
def _attention_forward_shapes(q, k, v, softmax_scale, causal):
    problem = check_qkv(q, k, v)  # shape errors surface while tracing, not at run time
    lse = q.new_empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("cute_flash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, causal: bool,
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        deterministic=deterministic)


@attention_backward.register_fake
def _attention_backward_shapes(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _save_for_backward(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal = softmax_scale, causal
    ctx.mark_non_differentiable(lse)  # returned for inspection; no gradient flows through it
    ctx.set_materialize_grads(False)  # lse's gradient would otherwise be a zero-filled tensor


def _backward(ctx, dout, _dlse):
    if dout is None:  # only lse reached the loss, and lse has no gradient
        return None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                    torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None


attention_forward.register_autograd(_backward, setup_context=_save_for_backward)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact attention, FlashAttention style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads a multiple of nheads_kv (MQA/GQA). fp16 or bf16 on an sm_80-or-newer GPU; headdim any
    multiple of 8 up to 256; any strides. Causal masking is bottom-right aligned. Returns `out`
    (like q), and also `lse` ((batch, nheads, seqlen_q) float32, natural log) if `return_lse`.
    Differentiable w.r.t. q, k and v; works inside `torch.compile`. The backward is deterministic
    when `torch.use_deterministic_algorithms(True)` is on.
    """
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad or torch.compiler.is_compiling():
        scale = check_softmax_scale(softmax_scale, q.shape[-1])
        out, lse = attention_forward(q, k, v, scale, bool(causal))
    else:
        out, lse = api.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return (out, lse) if return_lse else out
