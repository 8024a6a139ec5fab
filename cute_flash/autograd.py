"""`flash_attn_func`: the PyTorch-facing, differentiable entry point, with flash-attn 2's signature.

Forward and backward are `torch.library` custom ops, so autograd and `torch.compile` (which cannot
trace into CuTe DSL kernels) see two opaque operators with known output shapes: compiled graphs
keep them without a graph break. Eager inference skips the op layer and calls `api.forward`
directly, which saves the op dispatch on every call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import api, fallback
from .dropout import draw_rng_state
from .errors import UnsupportedArgumentError
from .validate import (
    check_alibi_slopes, check_dropout_p, check_flash_attn_options, check_qkv, check_softcap, check_softmax_scale,
    check_window, require_torch_tensor,
)

# The score modifications travel through the ops as flash-attn 2 spells them: window sides
# (-1 unbounded), softcap (0 off) and the float32 ALiBi slopes (no gradient, as in flash-attn).


@torch.library.custom_op("cute_flash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      causal: bool, deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # `deterministic` only travels to the backward (through the autograd context). The dropout
    # stream is drawn here, at run time (a compiled graph must not freeze it), and returned for the
    # backward: int64 [seed, offset] on the CPU, zeros without dropout.
    rng_state = (draw_rng_state(q.device, q.shape[0], q.shape[2]) if dropout_p != 0.0
                 else torch.zeros(2, dtype=torch.int64))
    out, lse = api.forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                           softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state)
    return out, lse, rng_state


def _check_mods_while_tracing(q, window_left, window_right, softcap, alibi_slopes):
    check_window((window_left, window_right))
    check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)


@attention_forward.register_fake
def _attention_forward_shapes(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0):
    problem = check_qkv(q, k, v)  # shape errors surface while tracing, not at run time
    _check_mods_while_tracing(q, window_left, window_right, softcap, alibi_slopes)
    check_dropout_p(dropout_p)
    lse = q.new_empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse, torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("cute_flash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, causal: bool,
                       deterministic: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                       alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                       rng_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        deterministic=deterministic, window_size=(window_left, window_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state)


@attention_backward.register_fake
def _attention_backward_shapes(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1,
                               window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _save_for_backward(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, alibi_slopes, dropout_p = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap, ctx.dropout_p = window_left, window_right, softcap, dropout_p
    ctx.mark_non_differentiable(lse, rng_state)  # returned for inspection; no gradient flows through them
    ctx.set_materialize_grads(False)  # lse's gradient would otherwise be a zero-filled tensor


_NO_INPUT_GRADS = (None,) * 8  # softmax_scale, causal, deterministic, window sides, softcap, alibi_slopes, dropout_p


def _backward(ctx, dout, _dlse, _drng_state):
    if dout is None:  # only lse reached the loss, and lse has no gradient
        return (None, None, None) + _NO_INPUT_GRADS
    q, k, v, out, lse, alibi_slopes, rng_state = ctx.saved_tensors
    deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, deterministic,
                                    ctx.window_left, ctx.window_right, ctx.softcap, alibi_slopes, ctx.dropout_p,
                                    rng_state)
    return (dq, dk, dv) + _NO_INPUT_GRADS


attention_forward.register_autograd(_backward, setup_context=_save_for_backward)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
              deterministic: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for torch tensors, through autograd when a gradient is needed; (out, None) on a
    GPU older than sm_80 (fallback.py). window, softcap and dropout_p checked (check_flash_attn_options)."""
    # The default scale needs the head dim; a q of the wrong rank gets its typed error here.
    head_dim = q.shape[3] if q.dim() == 4 else check_qkv(q, k, v).head_dim
    scale = check_softmax_scale(softmax_scale, head_dim)
    plain = window == (-1, -1) and softcap == 0.0 and alibi_slopes is None and dropout_p == 0.0
    if alibi_slopes is not None:  # its typed error before anything runs
        problem = check_qkv(q, k, v)
        check_alibi_slopes(alibi_slopes, problem.batch, problem.nheads, q.device)
    older_gpu = fallback.older_gpu(q.device)
    if older_gpu is not None:
        if not plain:
            raise UnsupportedArgumentError(
                "window_size, softcap, alibi_slopes and dropout_p need cute-flash's kernels (sm_80 or newer); the "
                "fallback to torch's scaled_dot_product_attention on this GPU has none of them")
        return fallback.attention(q, k, v, scale, causal, deterministic, older_gpu), None
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad or torch.compiler.is_compiling() or dropout_p != 0.0:
        out, lse, _ = attention_forward(q, k, v, scale, causal, deterministic, *window, softcap, alibi_slopes,
                                        dropout_p)
        return out, lse
    if plain:
        return api.forward(q, k, v, softmax_scale=scale, causal=causal)
    return api.forward(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                       alibi_slopes=alibi_slopes)


def results(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool, return_lse: bool) -> Any:
    """flash-attn 2's return convention: `(out, softmax_lse, S_dmask)` with `return_attn_probs`,
    where S_dmask (the probabilities with the dropout pattern) exists only for dropout_p > 0, where
    cute-flash rejects return_attn_probs (check_flash_attn_options); so it is None here, as in
    flash-attn 2 with dropout_p = 0."""
    if lse is None and (return_attn_probs or return_lse):
        raise UnsupportedArgumentError(
            "return_lse and return_attn_probs need cute-flash's kernels (sm_80 or newer); on this GPU "
            "torch's scaled_dot_product_attention computes the output and gives no lse")
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
) -> Any:
    """Exact attention, FlashAttention style, with flash-attn 2's signature (argument order included).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads a multiple of nheads_kv (MQA/GQA). fp16 or bf16 on an sm_80-or-newer GPU; headdim any
    multiple of 8 up to 256; any strides. Causal masking is bottom-right aligned, as in flash-attn 2.
    On an older GPU (V100, T4) torch's scaled_dot_product_attention computes the output instead,
    with a warning the first time (no lse there).

    Implemented: softmax_scale (default 1/sqrt(headdim)), causal, deterministic (the backward is
    deterministic when True or when `torch.use_deterministic_algorithms(True)` is on), and
    flash-attn 2's score modifications: window_size=(left, right) (query i sees keys
    i + seqlen_k - seqlen_q - left ... i + seqlen_k - seqlen_q + right, -1 unbounded; causal sets
    right = 0), softcap (scores s -> softcap * tanh(s / softcap)), alibi_slopes (float32,
    (nheads,) or (batch, nheads): bias -slope * |i + seqlen_k - seqlen_q - j|; no gradient).
    dropout_p in [0, 1): dropout of the probabilities after the softmax (kept ones scaled by
    1 / (1 - dropout_p), lse unchanged) with an in-kernel Philox stream drawn from torch's CUDA
    generator, so `torch.manual_seed` reproduces a call; the backward regenerates the mask.
    `cute_flash.dropout.dropout_keep_mask` regenerates it for tests; return_attn_probs=True with
    dropout_p > 0 is rejected with `UnsupportedArgumentError`.

    Returns `out` (like q); `(out, lse)` with `return_lse=True`; `(out, lse, None)` with
    `return_attn_probs=True` (lse: (batch, nheads, seqlen_q) float32, natural log of the softmax
    normalizer; no probabilities, as flash-attn 2 gives none without dropout). Differentiable w.r.t.
    q, k and v; works inside `torch.compile`.
    """
    require_torch_tensor("q", q)
    require_torch_tensor("k", k)
    require_torch_tensor("v", v)
    options = check_flash_attn_options(dropout_p, causal, window_size, softcap, alibi_slopes, deterministic,
                                       return_attn_probs, return_lse)
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse = options
    out, lse = attention(q, k, v, softmax_scale, causal, deterministic, window, softcap, alibi_slopes, dropout_p)
    return results(out, lse, return_attn_probs, return_lse)
