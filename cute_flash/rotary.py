"""Rotary position embedding of the new tokens of a `flash_attn_with_kvcache` call (flash-attn 2's
`rotary_cos`, `rotary_sin`, `rotary_interleaved`).

The appended keys k are rotated at their own positions, cache_seqlens[b] + i, before they are
written into the cache; the queries at the same positions when the call is causal or has a
sliding window, else all at position cache_seqlens[b] (flash-attn 2's rule: a call without either
treats its queries as one position). The first `rotary_dim = 2 * rotary_cos.shape[1]` channels
of each head rotate in pairs, the rest pass unchanged: pairs (0, 1), (2, 3), ... when
`rotary_interleaved` (GPT-J), else (c, c + rotary_dim / 2) (GPT-NeoX). The rotation is computed in fp32 and rounded once to the inputs'
dtype. It runs as torch operations on the call's stream, before the append and the decode kernel,
with no host synchronization (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from .errors import DimensionMismatchError, InvalidDimensionError, MissingTensorError, UnsupportedDtypeError
from .validate import KVCacheProblem, require_torch_tensor

ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rotary(rotary_cos, rotary_sin, problem: KVCacheProblem, by_position: bool) -> int:
    """The rotary dimension of a call (0 without rotary tensors), after every rule on them."""
    if rotary_cos is None and rotary_sin is None:
        return 0
    if rotary_cos is None or rotary_sin is None:
        raise MissingTensorError("rotary_cos and rotary_sin go together: pass both or neither")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        require_torch_tensor(name, t)
        if t.dtype not in ROTARY_DTYPES:
            raise UnsupportedDtypeError(f"{name} must be torch.float16, torch.bfloat16 or torch.float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] == 0:
            raise DimensionMismatchError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}")
    if rotary_cos.shape != rotary_sin.shape:
        raise DimensionMismatchError(
            f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
            f"{tuple(rotary_sin.shape)}")
    if problem.seqlen_new == 0:
        raise MissingTensorError("rotary_cos / rotary_sin rotate the appended keys: pass k and v with them")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim > problem.head_dim:
        raise DimensionMismatchError(
            f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} exceeds the head dim {problem.head_dim}")
    # the last position rotated: a key at capacity - 1, a query by position up to seqlen_q - seqlen_new beyond
    positions = problem.capacity + (max(problem.seqlen_q - problem.seqlen_new, 0) if by_position else 0)
    if rotary_cos.shape[0] < positions:
        raise InvalidDimensionError(
            f"rotary_cos / rotary_sin hold {rotary_cos.shape[0]} positions; this call can rotate positions up "
            f"to {positions - 1} (a cache of {problem.capacity} keys per sequence)")
    return rotary_dim


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, headdim) rotated at positions (batch, seqlen), a new tensor."""
    half = cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin[positions].float().unsqueeze(2)
    rotated = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def rotate_new_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache_lengths: torch.Tensor, by_position: bool, interleaved: bool):
    """(q, k) rotated: k at cache_lengths[b] + i, q likewise when by_position (causal or windowed),
    else at cache_lengths[b]."""
    start = cache_lengths.long()[:, None]
    key_positions = start + torch.arange(k.shape[1], device=k.device)
    if by_position:
        query_positions = start + torch.arange(q.shape[1], device=q.device)
    else:
        query_positions = start.expand(-1, q.shape[1])
    return (apply_rotary(q, cos, sin, query_positions, interleaved),
            apply_rotary(k, cos, sin, key_positions, interleaved))
