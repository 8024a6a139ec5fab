"""Exact attention in float64: the yardstick for tests and for users who want to check us."""

from __future__ import annotations

import torch

from .validate import check_flag, check_reference_inputs, check_softmax_scale


def causal_allowed(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                        causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in float64, differentiable.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), torch
    tensors of any floating dtype and head dim on any one device, checked by the kernels' shape
    rules (typed errors). Returns (out, lse): out (batch, seqlen_q, nheads, headdim) float64 and lse
    (batch, nheads, seqlen_q) float64, the natural-log logsumexp of the scaled scores. Rows that see
    no key give out = 0 and lse = -inf. softmax_scale = 0 gives uniform attention over the keys a
    row sees.
    """
    check_reference_inputs(q, k, v)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    causal = check_flag("causal", causal)
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)  # (b, h, sq, d)
    kh = k.transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        allowed = causal_allowed(q.shape[1], k.shape[1], device=scores.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    # A softmax that stays finite (and differentiable) on rows where every key is masked.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / denom.clamp_min(torch.finfo(torch.float64).tiny)
    out = torch.matmul(probs, vh).transpose(1, 2)
    lse = (torch.log(denom) + row_max).squeeze(-1)
    return out, lse
