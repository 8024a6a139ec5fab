"""flash-attn 2's dense interface: `flash_attn_func` and the packed variants, same names, argument
order and return conventions, so `from cute_flash.flash_attn_interface import flash_attn_func`
can stand in for `from flash_attn.flash_attn_interface import flash_attn_func`
(`flash_attn_with_kvcache` likewise: cute_flash/kvcache.py; `flash_attn_varlen_func`:
cute_flash/varlen.py, with its packed forms here).

The packed inputs are split into strided views (no copy: the kernels take any strides), and
autograd gathers the three (or two) gradients into one gradient of the packed tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import attention, flash_attn_func, results
from .kvcache import flash_attn_with_kvcache
from .validate import check_flash_attn_options, check_packed, require_torch_tensor
from .varlen import flash_attn_varlen_func, varlen_attention

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_with_kvcache",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """`flash_attn_func` on qkv: (batch, seqlen, 3, nheads, headdim), q, k and v stacked on dim 2.

    Same arguments, rules and returns as `flash_attn_func`; gradients flow to `qkv`.
    """
    check_packed("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, _ = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, False)
    q, k, v = qkv.unbind(dim=2)
    out, lse = attention(q, k, v, softmax_scale, causal, deterministic, window, softcap, alibi_slopes, dropout_p)
    return results(out, lse, return_attn_probs, False)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """`flash_attn_func` on q: (batch, seqlen_q, nheads, headdim) and kv: (batch, seqlen_k, 2,
    nheads_kv, headdim), k and v stacked on dim 2 (nheads a multiple of nheads_kv).

    Same arguments, rules and returns as `flash_attn_func`; gradients flow to `q` and `kv`.
    """
    require_torch_tensor("q", q)
    check_packed("kv", kv, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, _ = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, False)
    k, v = kv.unbind(dim=2)
    out, lse = attention(q, k, v, softmax_scale, causal, deterministic, window, softcap, alibi_slopes, dropout_p)
    return results(out, lse, return_attn_probs, False)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """`flash_attn_varlen_func` on qkv: (total, 3, nheads, headdim), q, k and v stacked on dim 1,
    one cu_seqlens and max_seqlen for queries and keys. Gradients flow to `qkv`."""
    check_packed("qkv", qkv, 3, "(total, 3, nheads, headdim)", axis=1)
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, _ = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, False, varlen=True)
    q, k, v = qkv.unbind(dim=1)
    out, lse = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal,
                                deterministic, window, softcap, alibi_slopes)
    return results(out, lse, return_attn_probs, False)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    """`flash_attn_varlen_func` on q: (total_q, nheads, headdim) and kv: (total_k, 2, nheads_kv,
    headdim), k and v stacked on dim 1. Gradients flow to `q` and `kv`."""
    require_torch_tensor("q", q)
    check_packed("kv", kv, 2, "(total_k, 2, nheads_kv, headdim)", axis=1)
    dropout_p, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, _ = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, False, varlen=True)
    k, v = kv.unbind(dim=1)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, deterministic, window, softcap, alibi_slopes)
    return results(out, lse, return_attn_probs, False)
