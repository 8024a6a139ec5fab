"""`flash_attn_with_kvcache`: attention on a KV cache for inference, with flash-attn 2's signature
and positional order, so serving code switches by changing the import.

The call travels the package's path (docs/architecture.md): `validate.check_kvcache` (every rule
that needs no tensor values), `validate.kvcache_value_flags` (the rules on cache_seqlens,
cache_batch_idx and block_table values, read back in one host synchronization; skipped while a
CUDA graph is captured and when CUTE_FLASH_KVCACHE_VALUE_CHECKS=0), then the append of k / v
into the cache (torch index writes on the device, no synchronization), `dispatch.plan_decode` and
`launchers.decode_launcher` (the decode kernel, and the split merge when the keys are split).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import device as devices
from . import dispatch
from .api import _on, _score_mods, _uniform_scores, kernel_input, kernel_view
from .errors import InvalidDimensionError
from .launchers import decode_launcher
from .rotary import check_rotary, rotate_new_tokens
from .validate import (
    Problem, check_device, check_flag, check_kvcache, check_softmax_scale, check_window, kvcache_value_flags,
    raise_for_kvcache_values, reads_values,
)

__all__ = ["flash_attn_with_kvcache"]

VALUE_CHECKS = os.environ.get("CUTE_FLASH_KVCACHE_VALUE_CHECKS", "1") != "0"
"""Whether calls read back the value checks of cache_seqlens, cache_batch_idx and block_table
(one host synchronization per call). Off, out-of-range values are undefined behaviour, as in
flash-attn."""

_launchers: dict[tuple, object] = {}
_arange: dict[tuple[int, int], torch.Tensor] = {}


def _decode(device: torch.device, dtype, head_dim: int, causal: bool, page_size: int, mods: tuple[bool, bool, bool],
            leftpad: bool, deep: bool, narrow: bool, warps_along_keys: bool):
    capability = devices.capability(device.index)
    tf32_products = dispatch.tf32_products_for(dtype)
    key = (device.index, dtype, head_dim, causal, page_size, mods, leftpad, deep, narrow, warps_along_keys,
           tf32_products)
    kept = _launchers.get(key)
    if kept is None:
        plan = dispatch.plan_decode(capability, dtype, head_dim, causal, page_size, mods, leftpad, deep, narrow,
                                    warps_along_keys, tf32_products)
        kept = _launchers[key] = (decode_launcher(plan), plan.tile_m, plan.tile_n, plan.ctas_per_sm)
    return kept


def _identity(device: torch.device, batch: int) -> torch.Tensor:
    """Sequence b reads cache entry b (no cache_batch_idx)."""
    index = _arange.get((device.index, batch))
    if index is None:
        index = _arange[(device.index, batch)] = torch.arange(batch, dtype=torch.int32, device=device)
    return index


def _cache_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """The cache itself: it is written in place, so it cannot be copied into a layout the kernel takes."""
    view = kernel_view(t)
    if view is None:
        raise InvalidDimensionError(
            f"{name} must have a last stride of 1, other strides multiples of 8 elements and a 16-byte aligned "
            f"base; got strides {tuple(t.stride())}")
    return view


def _append(k_cache, v_cache, k, v, cache_seqlens, batch_idx, block_table, page_size: int) -> None:
    """k, v into the cache at positions cache_seqlens[b] + i of sequence b (index writes on the device)."""
    seqlen_new = k.shape[1]
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)
    if block_table is None:
        rows, slots = batch_idx.long()[:, None].expand_as(positions), positions
    else:
        rows = block_table.long().gather(1, positions // page_size)
        slots = positions % page_size
    k_cache[rows, slots] = k
    v_cache[rows, slots] = v


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q on a KV cache, after appending k, v to it in place (docs/api.md).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, max_seqlen, nheads_kv,
    headdim), or paged (num_blocks, block_size, nheads_kv, headdim) with block_table (batch,
    max_blocks) int32, block_size a multiple of 16. k, v: (batch, seqlen_new, nheads_kv, headdim),
    written at cache_seqlens (int or (batch,) int32; None: every sequence fills the cache).
    cache_batch_idx: (batch,) int32 cache entry of each sequence (contiguous cache). causal is
    bottom-right aligned. num_splits: splits along the keys (0: chosen per call). Returns out, or
    (out, softmax_lse) with softmax_lse (batch, nheads, seqlen_q) float32.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) rotate the new k (and q) before the
    append (cute_flash/rotary.py). window_size, softcap and alibi_slopes as in flash_attn_func,
    bottom-right aligned on each sequence's keys. cache_leftpad: (batch,) int32, where each
    sequence's keys start in its cache (positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1;
    the append and rotary positions stay absolute, as in flash-attn 2).
    """
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits)
    if torch.compiler.is_compiling() and _op_takes(cache_seqlens, softmax_scale, causal, window_size, softcap,
                                                   rotary_interleaved, num_splits):
        out, lse = kvcache_attention(*_op_args(*args))
    else:
        out, lse = _attend(*args)
    return (out, lse) if return_softmax_lse else out


def _attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits):
    """flash_attn_with_kvcache's work: every rule, the append, the decode kernels; (out, lse)."""
    problem, num_splits = check_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, window_size, softcap,
        rotary_interleaved, alibi_slopes, num_splits)
    causal = check_flag("causal", causal)
    # The window rules at the cache's capacity: a side that bounds no row of the longest sequence
    # the cache can hold bounds none of any shorter one.
    longest = Problem(problem.batch, problem.seqlen_q, problem.capacity, problem.nheads, problem.nheads_kv,
                      problem.head_dim, problem.dtype, q.device)
    mods, mod_args = _score_mods(longest, causal, window_size, softcap, alibi_slopes)
    # flash-attn 2 rotates queries at their own positions when the call is causal or local: a window
    # side below the cache's capacity (its rule, not score_mods', which drops sides no row reaches)
    by_position = causal or any(0 <= side < problem.capacity for side in check_window(window_size))
    rotary_dim = check_rotary(rotary_cos, rotary_sin, problem, by_position)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, t in (("k", k), ("v", v), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad), ("block_table", block_table), ("rotary_cos", rotary_cos),
                    ("rotary_sin", rotary_sin), ("alibi_slopes", mods.alibi_slopes)):
        if isinstance(t, torch.Tensor):
            tensors[name] = t
    device = check_device(tensors)
    k_cache_k, v_cache_k = _cache_view("k_cache", k_cache), _cache_view("v_cache", v_cache)
    with _on(device):
        if reads_values(VALUE_CHECKS):
            flags = kvcache_value_flags(problem, cache_seqlens, cache_batch_idx, block_table, device, cache_leftpad)
            if flags is not None:
                raise_for_kvcache_values(flags.tolist(), problem)
        batch = problem.batch
        if isinstance(cache_seqlens, torch.Tensor):
            lengths = cache_seqlens.contiguous()
        else:
            full = problem.capacity - problem.seqlen_new if cache_seqlens is None else cache_seqlens
            lengths = torch.full((batch,), full, dtype=torch.int32, device=device)
        batch_idx = None
        if problem.page_size == 0:
            batch_idx = _identity(device, batch) if cache_batch_idx is None else cache_batch_idx.contiguous()
        if rotary_dim:
            q, k = rotate_new_tokens(q, k, rotary_cos, rotary_sin, lengths, by_position, rotary_interleaved)
        if problem.seqlen_new:
            _append(k_cache_k, v_cache_k, k, v, lengths, batch_idx, block_table, problem.page_size)
        sms = devices.sm_count(device.index)
        cta_shape = dispatch.decode_cta_shape(batch, problem.nheads, problem.nheads_kv, problem.seqlen_q,
                                              problem.head_dim, sms)
        launch, tile_m, tile_n, ctas_per_sm = _decode(device, q.dtype, problem.head_dim, mods.causal, problem.page_size,
                                                      mods.flags, cache_leftpad is not None, *cta_shape)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(batch, problem.nheads, problem.seqlen_q, dtype=torch.float32, device=device)
        if num_splits == 0:
            group = problem.nheads // problem.nheads_kv
            m_blocks = -(-problem.seqlen_q * group // tile_m)
            max_keys = problem.capacity if not isinstance(cache_seqlens, int) else cache_seqlens + problem.seqlen_new
            if mods.window is not None and mods.window[0] >= 0:  # a tile's rows see at most this many keys
                max_keys = min(max_keys, mods.window[0] + problem.seqlen_q + max(mods.window[1], 0))
            num_splits = dispatch.decode_splits(batch, problem.nheads_kv, m_blocks, max_keys, tile_n, sms, ctas_per_sm)
        q_k, scale_k = _uniform_scores(q, scale)
        launch(q_k, k_cache_k, v_cache_k, out, lse, lengths, problem.seqlen_new, batch_idx,
               None if block_table is None else kernel_input(block_table, 4),
               None if cache_leftpad is None else cache_leftpad.contiguous(), scale_k, num_splits, *mod_args)
    return out, lse


# Under torch.compile the call is one opaque operator that writes the caches (mutates_args), so a
# compiled decode step keeps it without a graph break; eager calls skip the op layer (its dispatch
# would add to every step). The op takes cache_seqlens as a tensor or as an int, and the window's
# sides apart, since an operator's schema has no union or tuple arguments.


def _op_takes(cache_seqlens, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits) -> bool:
    """Whether the arguments fit the operator's schema; others go the eager way, whose rules reject
    them with a typed error."""
    def integer(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def number(x):
        return integer(x) or isinstance(x, float)

    return ((cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor) or integer(cache_seqlens))
            and (softmax_scale is None or number(softmax_scale)) and number(softcap) and integer(num_splits)
            and isinstance(causal, bool) and isinstance(rotary_interleaved, bool)
            and isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(map(integer, window_size)))


def _op_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits):
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    seqlens_int = None if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
    return (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor, seqlens_int, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_size[0], window_size[1], softcap,
            rotary_interleaved, alibi_slopes, num_splits)


@torch.library.custom_op("cute_flash::kvcache_attention", mutates_args=("k_cache", "v_cache"))
def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                      v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor],
                      rotary_sin: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor],
                      cache_seqlens_int: Optional[int], cache_batch_idx: Optional[torch.Tensor],
                      cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                      softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                      softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[torch.Tensor],
                      num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _attend(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                   cache_seqlens if cache_seqlens is not None else cache_seqlens_int, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
                   alibi_slopes, num_splits)


@kvcache_attention.register_fake
def _kvcache_attention_shapes(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                              cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
                              window_right, softcap, rotary_interleaved, alibi_slopes, num_splits):
    # the rules that need no tensor values surface while tracing, not at run time
    check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens if cache_seqlens is not None else cache_seqlens_int,
                  cache_batch_idx, cache_leftpad, block_table, (window_left, window_right), softcap,
                  rotary_interleaved, alibi_slopes, num_splits)
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))
