"""cute-flash as an attention implementation of Hugging Face transformers.

    import cute_flash.hf
    cute_flash.hf.register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="cute_attention")

The name holds no "flash": transformers treats any implementation name containing "flash" as a
flash-attention kernel to load from its hub.

The implementation is transformers' "sdpa" one with cute-flash in place of torch's kernel where
the kernels compute the same function:

- masks are built exactly as for "sdpa" (the "sdpa" mask function is registered under the same
  name), so a call arrives without a mask only where SDPA itself would need none: no padding, and
  a plain causal or bidirectional pattern (sliding windows and chunks included, which the mask
  builder drops only where they exclude no key). Those calls run cute-flash, grouped-query heads
  included (no repeat of k and v);
- `is_causal` keeps SDPA's meaning, causal over the first keys (top-left): a causal call with more
  keys than queries, which transformers makes only for a prefill into an empty static cache, runs
  on the first seqlen_q keys, where both alignments agree;
- every other call is handed to transformers' "sdpa" function, with a one-time warning per
  reason: any attention mask (padding, packed sequences, custom patterns), attention dropout
  (training with attention_dropout > 0), a position bias, a causal call with fewer keys than
  queries, and inputs the kernels do not take (CPU, head dims not a multiple of 8 up to
  256, query and value head dims that differ, GPUs older than sm_80);
- softcapping (`softcap`, Gemma 2) runs in the kernels; a call that would go to "sdpa", which has
  none, raises `UnsupportedArgumentError` instead; so do attention sinks (`s_aux`).

Attention weights are never returned (None), as with "sdpa".
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import MissingDependencyError, UnsupportedArgumentError
from .validate import check_softcap, kernel_support_issue

NAME = "cute_attention"
"""The default `attn_implementation` name."""

_warned: set[str] = set()


def _interfaces():
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as error:
        raise MissingDependencyError(
            "cute_flash.hf needs Hugging Face transformers with AttentionInterface and "
            f"masking_utils.AttentionMaskInterface (pip install transformers): {error}"
        ) from error
    return AttentionInterface, AttentionMaskInterface


def _sdpa_attention():
    return _interfaces()[0]._global_mapping["sdpa"]


def _warn_once(category: str, message: str) -> None:
    if category not in _warned:
        _warned.add(category)
        warnings.warn(message, stacklevel=3)


def _fallback_reason(query, key, value, attention_mask, dropout, scaling, causal, kwargs) -> tuple[str, str] | None:
    """(message, category) of why torch's SDPA serves this call, or None when cute-flash does."""
    if attention_mask is not None:
        return "an attention mask (padding, packed sequences or a custom pattern) is not supported", "mask"
    if dropout:
        return f"attention dropout ({dropout}) is not supported", "dropout"
    if kwargs.get("position_bias") is not None:
        return "a position bias is not supported", "position_bias"
    if causal and query.shape[2] > key.shape[2]:
        return "causal attention with more queries than keys (top-left aligned) is not supported", "alignment"
    issue = kernel_support_issue(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling)
    if issue is not None:
        return issue, "inputs"
    return None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (batch, nheads, seqlen_q, headdim), key and
    value (batch, nheads_kv, seqlen_k, headdim); returns ((batch, seqlen_q, nheads, headdim), None)."""
    if kwargs.get("s_aux") is not None:
        raise UnsupportedArgumentError("s_aux is not supported: cute-flash has no attention sinks")
    softcap = check_softcap(kwargs.get("softcap") or 0.0)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(causal) and q_len > 1  # one query sees every cached key, as in "sdpa"
    reason = _fallback_reason(query, key, value, attention_mask, dropout, scaling, causal, kwargs)
    if reason is not None:
        message, category = reason
        if softcap:
            raise UnsupportedArgumentError(
                f"softcap with {message}: such calls run transformers' sdpa attention, which has no softcapping")
        _warn_once(category, f"cute-flash attention: {message}; such calls run transformers' sdpa attention")
        return _sdpa_attention()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    if kwargs.get("output_attentions"):
        _warn_once("output_attentions", "cute-flash attention returns no attention weights (output_attentions)")
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    from .autograd import attention

    out, _ = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling, causal, False,
                       softcap=softcap)
    return out, None


def register(name: str = NAME) -> str:
    """Make `attn_implementation=name` select cute-flash in transformers; returns the name."""
    attention_interface, mask_interface = _interfaces()
    if "flash" in name:
        raise UnsupportedArgumentError(
            f"attention implementation name {name!r} contains 'flash', which transformers reserves for "
            f"flash-attention kernels loaded from its hub; use a name without it, such as {NAME!r}"
        )
    existing = attention_interface._global_mapping.get(name)
    if existing is not None and existing is not attention_forward:
        raise UnsupportedArgumentError(f"attention implementation {name!r} is already registered in transformers")
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, mask_interface._global_mapping["sdpa"])
    return name
