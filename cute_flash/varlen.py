"""`flash_attn_varlen_func`: attention on packed variable-length batches, with flash-attn 2's
signature and positional order (its qkvpacked / kvpacked forms in flash_attn_interface.py).

q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim) hold the sequences one after
the other; sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (cu_seqlens_k
likewise for k, v). The call travels the package's path (docs/architecture.md): `validate.check_varlen`
(every rule that needs no tensor values), `validate.varlen_value_flags` (the rules on the
cu_seqlens values, read back in one host synchronization, as the KV-cache API does: skipped while
a CUDA graph is captured and when CUTE_FLASH_VARLEN_VALUE_CHECKS=0), then the kernels'
`call_varlen` entry points (dispatch: `varlen`; the Hopper kernels on sm_90 where they serve the
problem, the sm80 kernels otherwise), which read the offsets on the device. max_seqlen_q / max_seqlen_k are host ints that size the grids, so nothing else waits for
the device and torch.compile(fullgraph=True) keeps the call as two opaque custom ops.

    forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, ...)            -> (out, lse (nheads, total_q))
    backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, ...) -> (dq, dk, dv)
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import dispatch, fallback
from .api import _launcher, _on, _score_mods, _uniform_scores, kernel_input
from .autograd import results
from .errors import UnsupportedArgumentError
from .launchers import backward_varlen_launcher, forward_launcher
from .validate import (
    Problem, check_alibi_slopes, check_device, check_flag, check_flash_attn_options, check_like, check_softmax_scale,
    check_varlen, raise_for_values, reads_values, require_torch_tensor, varlen_value_flags, varlen_value_messages,
)

__all__ = ["flash_attn_varlen_func", "forward_varlen", "backward_varlen"]

VALUE_CHECKS = os.environ.get("CUTE_FLASH_VARLEN_VALUE_CHECKS", "1") != "0"
"""Whether calls read back the value checks of cu_seqlens and max_seqlen (one host
synchronization per checked call). Off, inconsistent values are undefined behaviour, as in flash-attn."""

_forward_kernels: dict[tuple, object] = {}
_backward_kernels: dict[tuple, object] = {}


def _plan_forward(capability, dtype, head_dim, causal, mods, tf32_products):
    return forward_launcher(dispatch.plan_forward(capability, dtype, head_dim, causal, mods=mods, varlen=True,
                                                  tf32_products=tf32_products))


def _plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods, tf32_products):
    return backward_varlen_launcher(dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa,
                                                           mods=mods, varlen=True, tf32_products=tf32_products))


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size, softcap,
             alibi_slopes, check_values: bool, extra: dict):
    """The checks shared by both passes; returns (problem, mods, the kernels' mod arguments, device)."""
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal = check_flag("causal", causal)
    # The window rules with the longest lengths: a side no row of the longest sequences reaches
    # reaches no row of any sequence.
    dense = Problem(problem.batch, problem.max_seqlen_q, problem.max_seqlen_k, problem.nheads, problem.nheads_kv,
                    problem.head_dim, problem.dtype, q.device)
    mods, mod_args = _score_mods(dense, causal, window_size, softcap, alibi_slopes)
    if not mod_args:  # call_varlen takes every modification's value, None where off
        mod_args = (None, None, None, None)
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **extra}
    if mods.alibi_slopes is not None:
        tensors["alibi_slopes"] = mods.alibi_slopes
    device = check_device(tensors)
    if check_values and reads_values(VALUE_CHECKS):
        with _on(device):
            raise_for_values(varlen_value_flags(problem, cu_seqlens_q, cu_seqlens_k), varlen_value_messages(problem))
    return problem, mods, mod_args, device


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                   causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, check_values=True):
    """Attention forward of a packed batch (torch tensors); returns (out, lse): out like q, lse
    (nheads, total_q) float32 (flash-attn 2's varlen layout). `check_values` False skips the value
    checks (the caller has made them)."""
    problem, mods, mod_args, device = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, window_size, softcap, alibi_slopes, check_values, {})
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    with _on(device):
        launch = _launcher(_forward_kernels, _plan_forward, device, q.dtype, problem.head_dim, mods.causal,
                           mods.flags, dispatch.tf32_products_for(q.dtype))
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(problem.nheads, problem.total_q, dtype=torch.float32, device=device)
        q_k, scale_k = _uniform_scores(q, scale)
        # A grid needs one block column: an all-empty batch launches CTAs that exit at once.
        launch(q_k[None], kernel_input(k)[None], kernel_input(v)[None], out[None], lse[None], cu_seqlens_q.contiguous(),
               cu_seqlens_k.contiguous(), max(problem.max_seqlen_q, 1), scale_k, *mod_args)
    return out, lse


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dq=None,
                    dk=None, dv=None, softmax_scale=None, causal=False, deterministic=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, check_values=True):
    """Gradients of a packed batch w.r.t. q, k, v (torch tensors). `lse` is forward_varlen's.
    dq, dk, dv are written when given (rows of no sequence left untouched) and returned; else
    they are new tensors, zero on rows of no sequence."""
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_like("dout", dout, q.shape, q.dtype)
    check_like("out", out, q.shape, q.dtype)
    check_like("lse", lse, (problem.nheads, problem.total_q), torch.float32)
    extra = {"dout": dout, "out": out, "lse": lse}
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            check_like(name, grad, like.shape, like.dtype)
            extra[name] = grad
    problem, mods, mod_args, device = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, window_size, softcap, alibi_slopes, check_values, extra)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    deterministic = check_flag("deterministic", deterministic)
    with _on(device):
        # zeros on rows of no sequence; a given gradient the kernels cannot address is filled from a copy
        grads = [torch.zeros_like(like, memory_format=torch.contiguous_format) if grad is None else kernel_input(grad)
                 for grad, like in ((dq, q), (dk, k), (dv, v))]
        gqa = problem.nheads != problem.nheads_kv
        launch = _launcher(_backward_kernels, _plan_backward, device, q.dtype, problem.head_dim, mods.causal,
                           deterministic, gqa, mods.flags, dispatch.tf32_products_for(q.dtype))
        q_k, scale_k = _uniform_scores(q, scale)
        launch(kernel_input(dout), q_k, kernel_input(k), kernel_input(v), kernel_input(out), kernel_input(lse, 4),
               *grads, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max(problem.max_seqlen_q, 1),
               max(problem.max_seqlen_k, 1), scale_k, *mod_args)
        if scale == 0.0:  # as api.backward, on the sequences' rows only
            inside = torch.arange(problem.total_q, device=device) >= cu_seqlens_q[0]
            grads[0].masked_fill_(inside[:, None, None], 0.0)
        for given, written in zip((dq, dk, dv), grads):
            if given is not None and written.data_ptr() != given.data_ptr():
                given.copy_(written)
    return tuple(written if given is None else given for given, written in zip((dq, dk, dv), grads))


# ---- autograd: two custom ops, as the dense path (autograd.py) ---------------------------------------
@torch.library.custom_op("cute_flash::varlen_forward", mutates_args=())
def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                   causal: bool, deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                          softcap=softcap, alibi_slopes=alibi_slopes)


@varlen_forward.register_fake
def _varlen_forward_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                           deterministic=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    # shape errors surface while tracing; max_seqlen may be symbolic there (its rules run in the op)
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((problem.nheads, problem.total_q), dtype=torch.float32))


@torch.library.custom_op("cute_flash::varlen_backward", mutates_args=())
def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool,
                    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the forward checked cu_seqlens' values: the backward does not read them back again
    return backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                           window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                           check_values=False)


@varlen_backward.register_fake
def _varlen_backward_shapes(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0,
                            alibi_slopes=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _save_for_backward(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
     window_left, window_right, softcap, alibi_slopes) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


# cu_seqlens (2), max_seqlen (2), softmax_scale, causal, deterministic, window sides (2), softcap, slopes
_NO_INPUT_GRADS = (None,) * 11


def _backward(ctx, dout, _dlse):
    if dout is None:
        return (None, None, None) + _NO_INPUT_GRADS
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen,
                                 ctx.softmax_scale, ctx.causal, deterministic, *ctx.window, ctx.softcap, alibi_slopes)
    return (dq, dk, dv) + _NO_INPUT_GRADS


varlen_forward.register_autograd(_backward, setup_context=_save_for_backward)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic, window, softcap, alibi_slopes) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a packed batch, through autograd when a gradient is needed (options checked
    by check_flash_attn_options)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require_torch_tensor(name, t)
    # every rule without tensor values before anything runs (the ops check them again: they are public)
    problem = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_alibi_slopes(alibi_slopes, problem.batch, problem.nheads, q.device)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    if q.is_cuda and fallback.older_gpu(q.device) is not None:
        raise UnsupportedArgumentError(
            "flash_attn_varlen_func needs cute-flash's kernels (sm_80 or newer); pad the batch and call "
            "flash_attn_func, which falls back to torch's scaled_dot_product_attention on this GPU")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad or torch.compiler.is_compiling():
        return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                              deterministic, *window, softcap, alibi_slopes)
    return forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale,
                          causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Exact attention on a packed variable-length batch, flash-attn 2's signature (argument order
    included; docs/api.md).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim), nheads a multiple of
    nheads_kv; cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, non-decreasing, last
    entry the number of packed tokens; max_seqlen_q, max_seqlen_k: Python ints, at least every
    sequence's length. fp16, bf16 or fp32, headdim any multiple of 8 up to 256, on an sm_80-or-newer
    GPU. causal (bottom-right aligned per sequence), window_size, softcap, alibi_slopes ((nheads,) or
    (batch, nheads) float32) and deterministic as flash_attn_func, each applied per sequence.
    dropout_p != 0 is rejected with UnsupportedArgumentError (dropout has dense kernels only).

    Returns out (total_q, nheads, headdim), or (out, softmax_lse, None) with return_attn_probs
    (softmax_lse (nheads, total_q) float32). Differentiable w.r.t. q, k and v; works inside
    torch.compile. The cu_seqlens values are checked in one host synchronization per call (not
    during CUDA-graph capture, nor with CUTE_FLASH_VARLEN_VALUE_CHECKS=0).
    """
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, _ = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, False, varlen=True)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, deterministic, window, softcap, alibi_slopes)
    return results(out, lse, return_attn_probs, False)
