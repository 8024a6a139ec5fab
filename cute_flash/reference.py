"""Exact attention in float64: the yardstick for tests and for users who want to check us."""

from __future__ import annotations

import torch

from .validate import (
    check_alibi_slopes, check_flag, check_reference_inputs, check_softcap, check_softmax_scale, check_window,
)


def causal_allowed(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), device=None) -> torch.Tensor:
    """flash-attn 2's mask, bottom-right aligned: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, where (left, right) is
    the window and -1 an unbounded side; causal sets right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= diagonal + right
    if left >= 0:
        allowed &= j >= diagonal - left
    return allowed


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """ALiBi as flash-attn 2 documents it: -slope * |i + seqlen_k - seqlen_q - j| for query i and
    key j, causal or not. slopes: (1 or batch, nheads); returns (1 or batch, nheads, seqlen_q,
    seqlen_k) in slopes' precision raised to float64."""
    i = torch.arange(seqlen_q, device=slopes.device)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (i + (seqlen_k - seqlen_q) - j).abs().to(torch.float64)
    return -slopes.to(torch.float64)[:, :, None, None] * distance


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                        causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0,
                        dropout_keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in float64, differentiable.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), torch
    tensors of any floating dtype and head dim on any one device, checked by the kernels' shape
    rules (typed errors). Returns (out, lse): out (batch, seqlen_q, nheads, headdim) float64 and lse
    (batch, nheads, seqlen_q) float64, the natural-log logsumexp of the scaled scores. Rows that see
    no key give out = 0 and lse = -inf. softmax_scale = 0 gives uniform attention over the keys a
    row sees.

    flash-attn 2's score modifications, in its order: the scaled score s becomes
    softcap * tanh(s / softcap) when softcap > 0, then the ALiBi bias
    -slope * |i + seqlen_k - seqlen_q - j| is added (alibi_slopes: float32, (nheads,) or
    (batch, nheads)), then keys outside the window (`visible_keys`) are masked.

    Dropout: with dropout_keep (bool, broadcastable to (batch, nheads, seqlen_q, seqlen_k), e.g.
    cute_flash.dropout.dropout_keep_mask of a call), the probabilities it drops become 0 and the
    kept ones are scaled by 1 / (1 - dropout_p) before P V; lse is that of the full softmax.
    """
    check_reference_inputs(q, k, v)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    causal = check_flag("causal", causal)
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)  # (b, h, sq, d)
    kh = k.transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        scores = scores + alibi_bias(slopes, q.shape[1], k.shape[1])
    if causal or window != (-1, -1):
        allowed = visible_keys(q.shape[1], k.shape[1], causal, window, device=scores.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    # A softmax that stays finite (and differentiable) on rows where every key is masked.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / denom.clamp_min(torch.finfo(torch.float64).tiny)
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(probs.device) / (1.0 - dropout_p)
    out = torch.matmul(probs, vh).transpose(1, 2)
    lse = (torch.log(denom) + row_max).squeeze(-1)
    return out, lse


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                               window_size=(-1, -1), softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_attention` of a packed variable-length batch, sequence by sequence, differentiable.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); sequence b holds rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and likewise of k and v (cu_seqlens read on the
    host: this is a test oracle). Masks, cap and bias apply per sequence with its own lengths;
    alibi_slopes (nheads,) or (batch, nheads). Returns out (total_q, nheads, headdim) float64 and
    lse (nheads, total_q) float64; rows of no sequence, and rows of a sequence without keys, give
    out = 0 and lse = -inf.
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    nheads, head_dim = q.shape[1], q.shape[2]
    outs = [q.new_zeros((starts_q[0], nheads, head_dim), dtype=torch.float64)]
    lses = [q.new_full((nheads, starts_q[0]), float("-inf"), dtype=torch.float64)]
    for b in range(len(starts_q) - 1):
        q_b = q[starts_q[b]:starts_q[b + 1]]
        k_b, v_b = k[starts_k[b]:starts_k[b + 1]], v[starts_k[b]:starts_k[b + 1]]
        if q_b.shape[0] == 0:
            continue
        if k_b.shape[0] == 0:  # no key: every row sees none
            outs.append(q_b.new_zeros(q_b.shape, dtype=torch.float64))
            lses.append(q_b.new_full((nheads, q_b.shape[0]), float("-inf"), dtype=torch.float64))
            continue
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        out_b, lse_b = reference_attention(q_b[None], k_b[None], v_b[None], softmax_scale, causal, window_size,
                                           softcap, slopes)
        outs.append(out_b[0])
        lses.append(lse_b[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
