"""Every input rule, checked before anything is launched or written.

Functions here take torch tensors (the API converts DLPack inputs first, without copying) and
either return normally or raise a typed `CuteFlashError`.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .device import capability as device_capability
from .errors import (
    CudaError,
    CuteFlashError,
    DimensionMismatchError,
    InvalidDimensionError,
    MissingTensorError,
    UnsupportedArgumentError,
    UnsupportedDtypeError,
    UnsupportedHeadDimError,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
MIN_CAPABILITY = (8, 0)


class Problem(NamedTuple):
    """The sizes of one attention call, read off validated inputs."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def _require_tensor(name: str, t) -> None:
    if type(t) is torch.Tensor:
        return
    if t is None:
        raise MissingTensorError(f"{name} is required but was None")
    if not isinstance(t, torch.Tensor):
        raise MissingTensorError(f"{name} must be a tensor (torch or any DLPack tensor), got {type(t).__name__}")


def _require_rank4(name: str, t: torch.Tensor, axes: str) -> None:
    shape = t.shape
    if len(shape) != 4:
        raise InvalidDimensionError(f"{name} must have 4 dimensions {axes}, got shape {tuple(shape)}")
    if min(shape) <= 0:
        raise InvalidDimensionError(f"{name} has an empty dimension: shape {tuple(t.shape)} {axes}")


def _require_dtype(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise UnsupportedDtypeError(f"mixed dtypes: {name} is {t.dtype} but q is {dtype}")


def check_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one CUDA device of compute capability 8.0 or newer."""
    first, *rest = tensors.values()
    device = first.device
    if any(t.device != device for t in rest):
        listing = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise CudaError(f"tensors are on different devices: {listing}")
    if device.type != "cuda":
        raise CudaError(f"tensors must be on a CUDA GPU, got device '{device}'")
    capability = device_capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise CudaError(
            f"{name} has compute capability {capability[0]}.{capability[1]}; cute-flash needs sm_80 "
            "(Ampere) or newer, the oldest architecture the CuTe DSL targets"
        )
    return device


def check_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The scale to use: the given one, or 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    # A bool is an int to Python: `flash_attn_func(q, k, v, None, True)` written for the old argument
    # order would otherwise run with scale 1.
    if isinstance(softmax_scale, (bool, str, bytes)):
        raise InvalidDimensionError(
            f"softmax_scale must be a number or None, got {type(softmax_scale).__name__} {softmax_scale!r}"
        )
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise InvalidDimensionError(
            f"softmax_scale must be a number or None, got {type(softmax_scale).__name__}"
        ) from None
    if not math.isfinite(scale) or scale < 0:
        raise InvalidDimensionError(f"softmax_scale must be a finite, non-negative number, got {softmax_scale}")
    return scale


def _require_qkv_rank4(q, k, v) -> None:
    _require_rank4("q", q, "(batch, seqlen_q, nheads, headdim)")
    _require_rank4("k", k, "(batch, seqlen_k, nheads_kv, headdim)")
    _require_rank4("v", v, "(batch, seqlen_k, nheads_kv, headdim)")


def _check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """How the shapes of rank-4 q, k, v must agree (batch, head dim, heads for MQA/GQA)."""
    batch, _, nheads, head_dim = q.shape
    if k.shape != v.shape:
        raise DimensionMismatchError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise DimensionMismatchError(f"batch mismatch: q has {batch}, k and v have {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise DimensionMismatchError(f"head dim mismatch: q has {head_dim}, k and v have {k.shape[3]}")
    nheads_kv = k.shape[2]
    if nheads % nheads_kv != 0:
        raise DimensionMismatchError(
            f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) for multi-/grouped-query attention"
        )


def check_qkv(q, k, v) -> Problem:
    """Shapes, dtypes and head dim of q, k, v; not the device (see `check_device`)."""
    _require_tensor("q", q)
    _require_tensor("k", k)
    _require_tensor("v", v)
    _require_qkv_rank4(q, k, v)
    _require_dtype(k, v, q.dtype)
    _check_qkv_shapes(q, k, v)
    batch, seqlen_q, nheads, head_dim = q.shape
    if head_dim % HEAD_DIM_MULTIPLE != 0 or head_dim > MAX_HEAD_DIM:
        raise UnsupportedHeadDimError(
            f"head dim {head_dim} is not supported; supported: every multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"
        )
    return Problem(batch, seqlen_q, k.shape[1], nheads, k.shape[2], head_dim, q.dtype, q.device)


def check_like(name: str, t, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """An output or gradient tensor that must match `shape` and `dtype` exactly."""
    _require_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise DimensionMismatchError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise UnsupportedDtypeError(f"{name} must be {dtype}, got {t.dtype}")


def lse_shape(p: Problem) -> tuple[int, int, int]:
    return (p.batch, p.nheads, p.seqlen_q)


def require_torch_tensor(name: str, t) -> None:
    """`t` is a torch.Tensor: the entry points built on autograd take nothing else."""
    if isinstance(t, torch.Tensor):
        return
    if t is None:
        raise MissingTensorError(f"{name} is required but was None")
    hint = " (cute_flash.forward and cute_flash.backward take other DLPack tensors)" if hasattr(t, "__dlpack__") else ""
    raise MissingTensorError(f"{name} must be a torch.Tensor, got {type(t).__name__}{hint}")


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, numbers.Real)):
        raise InvalidDimensionError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """A boolean option: True, False (or 1, 0)."""
    if value is True or value is False:
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidDimensionError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


class ScoreMods(NamedTuple):
    """Sliding window, softcap and ALiBi as the kernels take them (see `score_mods`).

    window: (left, right) with -1 for an unbounded side, or None for no window beyond `causal`;
    softcap: 0.0 (off) or the cap; alibi_slopes: None or fp32 (1 or batch, nheads), last stride 1."""

    causal: bool
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    @property
    def flags(self) -> tuple[bool, bool, bool]:
        """(has window, has softcap, has ALiBi): what changes a kernel's code."""
        return self.window is not None, self.softcap != 0.0, self.alibi_slopes is not None


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's window_size: a pair of integers, each -1 (unbounded) or >= 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise InvalidDimensionError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise InvalidDimensionError(f"window_size {name} must be an integer, got {type(side).__name__} {side!r}")
        if side < -1:
            raise InvalidDimensionError(
                f"window_size {name} must be -1 (unbounded) or >= 0, got {side} in window_size={window_size!r}")
    return int(left), int(right)


def check_softcap(softcap) -> float:
    """flash-attn's softcap: 0 (off) or a positive, finite cap."""
    cap = _real("softcap", softcap)
    if not math.isfinite(cap) or cap < 0:
        raise InvalidDimensionError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    return cap


def check_alibi_slopes(alibi_slopes, batch: int, nheads: int, device: torch.device | None = None):
    """flash-attn's alibi_slopes: None or a float32 tensor of shape (nheads,) or (batch, nheads) on
    q's device. Returns None or a (1 or batch, nheads) view with last stride 1 (no gradient flows
    to the slopes, as in flash-attn)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise MissingTensorError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise UnsupportedDtypeError(f"alibi_slopes must be torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise DimensionMismatchError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}) (nheads,) or (batch, nheads), "
            f"got {tuple(alibi_slopes.shape)}")
    if device is not None and alibi_slopes.device != device:
        raise CudaError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    slopes = alibi_slopes.detach().reshape(-1, nheads)
    return slopes if slopes.stride(-1) == 1 else slopes.contiguous()


def score_mods(causal: bool, window: tuple[int, int], softcap: float, alibi_slopes, seqlen_q: int,
               seqlen_k: int) -> ScoreMods:
    """The window in its simplest exact form, flash-attn 2's rules: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (a side of -1 is unbounded);
    causal sets right = 0. A side that bounds no row (left >= seqlen_k - 1, right >= seqlen_q - 1)
    becomes unbounded, and a window left with only right = 0 is plain causal attention."""
    left, right = window
    if causal:
        right = 0
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if left == -1 and right in (-1, 0):
        return ScoreMods(right == 0, None, softcap, alibi_slopes)
    return ScoreMods(False, (left, right), softcap, alibi_slopes)


def check_flash_attn_options(dropout_p, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, return_lse, varlen: bool = False):
    """The non-tensor arguments of flash-attn's interface: each is honoured or rejected with a typed
    error, never ignored. Returns (dropout_p, causal, window, softcap, alibi_slopes, deterministic,
    return_attn_probs, return_lse), dropout_p, window and softcap checked (check_dropout_p,
    check_window, check_softcap); alibi_slopes is checked against q's shape later
    (check_alibi_slopes). Rejected with UnsupportedArgumentError: dropout on a packed
    variable-length batch (`varlen`), and return_attn_probs with dropout (the probabilities are not
    returned: cute_flash.dropout.dropout_keep_mask regenerates the mask)."""
    # Every call pays for this check: the usual values take one comparison chain.
    p = 0.0 if type(dropout_p) is float and dropout_p == 0.0 else check_dropout_p(dropout_p)
    window = (-1, -1) if type(window_size) is tuple and window_size == (-1, -1) else check_window(window_size)
    cap = 0.0 if type(softcap) is float and softcap == 0.0 else check_softcap(softcap)
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    if p != 0.0 and varlen:
        raise UnsupportedArgumentError(
            f"dropout_p={dropout_p} on a packed variable-length batch is not supported: cute-flash's dropout "
            "kernels take dense batches (flash_attn_func); pass dropout_p=0.0")
    if p != 0.0 and return_attn_probs:
        raise UnsupportedArgumentError(
            "return_attn_probs=True with dropout_p > 0 is not supported: cute-flash does not return the "
            "probabilities; cute_flash.dropout.dropout_keep_mask regenerates the dropout mask of a call")
    return (p, check_flag("causal", causal), window, cap, alibi_slopes, check_flag("deterministic", deterministic),
            return_attn_probs, check_flag("return_lse", return_lse))


def check_dropout_p(dropout_p) -> float:
    """flash-attn's dropout_p: a probability in [0, 1)."""
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise InvalidDimensionError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return p


def check_packed(name: str, t, count: int, axes: str, axis: int = 2) -> None:
    """A packed input such as qkv (batch, seqlen, 3, nheads, headdim): `count` tensors along dim
    `axis`, followed by (heads, headdim); the packed varlen forms (total, 3, nheads, headdim) take axis 1."""
    require_torch_tensor(name, t)
    if t.dim() != axis + 3:
        raise InvalidDimensionError(f"{name} must have {axis + 3} dimensions {axes}, got shape {tuple(t.shape)}")
    if t.shape[axis] != count:
        raise DimensionMismatchError(
            f"{name} must hold {count} tensors along dimension {axis} {axes}, got shape {tuple(t.shape)}"
        )


def check_reference_inputs(q, k, v) -> None:
    """The reference's inputs: the kernels' shape rules, on any device and any floating dtype and
    head dim (it computes in float64)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_torch_tensor(name, t)
    _require_qkv_rank4(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise UnsupportedDtypeError(f"{name} is {t.dtype}; the reference takes floating-point tensors")
    _check_qkv_shapes(q, k, v)
    if not q.device == k.device == v.device:
        raise CudaError(f"tensors are on different devices: q on {q.device}, k on {k.device}, v on {v.device}")


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes some kernel computes (float32 by split TF32 on the sm80 kernels)."""


def check_kernel_dtype(dtype: torch.dtype) -> None:
    if dtype not in KERNEL_DTYPES:
        raise UnsupportedDtypeError(
            f"no kernel computes {dtype} inputs; use torch.float16, torch.bfloat16 or torch.float32"
        )


def kernel_support_issue(q, k, v, softmax_scale: float | None = None) -> str | None:
    """Why no cute-flash kernel can compute attention on these (batch, seqlen, nheads, headdim)
    tensors with this scale, or None when one can. For integrations that hand such calls back to
    torch instead of raising."""
    if any(getattr(t, "is_nested", False) for t in (q, k, v)):
        return "nested (ragged) tensors are not supported"
    try:
        problem = check_qkv(q, k, v)
        check_kernel_dtype(problem.dtype)
        check_device({"q": q, "k": k, "v": v})
    except CuteFlashError as error:
        return str(error)
    if softmax_scale is not None:
        scale = float(softmax_scale)
        # Zero is left to torch too: the kernels' zero-scale (uniform attention) path is not verified.
        if not (math.isfinite(scale) and scale > 0):
            return f"softmax_scale must be finite and positive, got {softmax_scale}"
    return None


# ---- flash_attn_with_kvcache -------------------------------------------------------------------

MAX_SPLITS = 256
"""The most splits along the keys a decode call may ask for (num_splits): two per SM of an H100's
132 fill it from one (batch, KV head) row block."""

PAGE_MULTIPLE = 16
"""Paged caches: the page (block) size must be a positive multiple of this."""

MAX_GRID_Z = 65535
"""The decode kernel's grid holds batch * nheads_kv in its z dimension."""


class KVCacheProblem(NamedTuple):
    """The sizes of one flash_attn_with_kvcache call, read off validated inputs."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    seqlen_new: int  # keys appended by this call (0 without k, v)
    page_size: int  # 0: contiguous cache
    capacity: int  # keys a sequence's cache can hold (max_len, or max_pages * page_size)
    cache_entries: int  # contiguous: cache batch; paged: number of pages
    dtype: torch.dtype


def _require_int32_tensor(name: str, t, shape: tuple[int, ...], axes: str) -> None:
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise UnsupportedDtypeError(f"{name} must be torch.int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise DimensionMismatchError(f"{name} must have shape {shape} {axes}, got {tuple(t.shape)}")


def _check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise InvalidDimensionError(f"num_splits must be an int, got {type(num_splits).__name__} {num_splits!r}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise InvalidDimensionError(
            f"num_splits must be 0 (chosen per call) or 1 to {MAX_SPLITS}, got {num_splits}")
    return int(num_splits)


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                  window_size, softcap, rotary_interleaved, alibi_slopes, num_splits) -> tuple[KVCacheProblem, int]:
    """Every rule of flash_attn_with_kvcache that needs no tensor's values (those are
    `check_kvcache_values`) but the rotary tensors' (rotary.check_rotary, which needs `causal`) and the
    score modifications' (api._score_mods, which needs the problem); window_size and softcap are checked
    here; returns the problem and num_splits."""
    check_window(window_size)
    check_softcap(softcap)
    check_flag("rotary_interleaved", rotary_interleaved)
    splits = _check_num_splits(num_splits)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_torch_tensor(name, t)
    paged = block_table is not None
    cache_axes = "(num_blocks, block_size, nheads_kv, headdim)" if paged else "(batch_cache, max_seqlen, nheads_kv, headdim)"
    _require_rank4("q", q, "(batch, seqlen_q, nheads, headdim)")
    _require_rank4("k_cache", k_cache, cache_axes)
    _require_rank4("v_cache", v_cache, cache_axes)
    _require_dtype(k_cache, v_cache, q.dtype)
    check_kernel_dtype(q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise DimensionMismatchError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    entries, rows, nheads_kv, cache_hd = k_cache.shape
    if cache_hd != head_dim:
        raise DimensionMismatchError(f"head dim mismatch: q has {head_dim}, k_cache and v_cache have {cache_hd}")
    if nheads % nheads_kv:
        raise DimensionMismatchError(
            f"nheads ({nheads}) must be a multiple of the cache's nheads_kv ({nheads_kv})")
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise UnsupportedHeadDimError(
            f"head dim {head_dim} is not supported; supported: every multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}")
    if (k is None) != (v is None):
        raise MissingTensorError("k and v are appended together: pass both or neither")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            require_torch_tensor(name, t)
            if t.dtype != q.dtype:
                raise UnsupportedDtypeError(f"mixed dtypes: {name} is {t.dtype} but q is {q.dtype}")
            if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (nheads_kv, head_dim):
                raise DimensionMismatchError(
                    f"{name} must have shape (batch={batch}, seqlen_new, nheads_kv={nheads_kv}, headdim={head_dim}), "
                    f"got {tuple(t.shape)}")
        if k.shape != v.shape:
            raise DimensionMismatchError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    page_size = 0
    if paged:
        if cache_batch_idx is not None:
            raise UnsupportedArgumentError(
                "cache_batch_idx addresses a contiguous cache; with a block_table the table picks each "
                "sequence's pages: pass cache_batch_idx=None")
        _require_tensor("block_table", block_table)
        if block_table.dtype != torch.int32:
            raise UnsupportedDtypeError(f"block_table must be torch.int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise DimensionMismatchError(
                f"block_table must have shape (batch={batch}, max_blocks >= 1), got {tuple(block_table.shape)}")
        if rows % PAGE_MULTIPLE:
            raise UnsupportedArgumentError(
                f"block size {rows} is not supported: paged caches need a block size that is a multiple of "
                f"{PAGE_MULTIPLE}")
        page_size = rows
        capacity = block_table.shape[1] * rows
    else:
        if cache_batch_idx is not None:
            _require_int32_tensor("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)")
        elif entries < batch:
            raise DimensionMismatchError(
                f"k_cache holds {entries} sequences but q has batch {batch}; pass cache_batch_idx to pick them")
        capacity = rows
    if cache_seqlens is None:
        if seqlen_new:
            raise MissingTensorError("appending k and v needs cache_seqlens: where each sequence's new keys go")
    elif isinstance(cache_seqlens, torch.Tensor):
        _require_int32_tensor("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
        raise UnsupportedDtypeError(
            f"cache_seqlens must be an int or a (batch,) torch.int32 tensor, got {type(cache_seqlens).__name__}")
    elif not 0 <= cache_seqlens <= capacity - seqlen_new:
        raise InvalidDimensionError(
            f"cache_seqlens={cache_seqlens} with {seqlen_new} appended keys does not fit a cache of "
            f"{capacity} keys per sequence")
    if cache_leftpad is not None:
        _require_int32_tensor("cache_leftpad", cache_leftpad, (batch,), "(batch,)")
    if batch * nheads_kv > MAX_GRID_Z:
        raise InvalidDimensionError(
            f"batch * nheads_kv = {batch * nheads_kv} exceeds {MAX_GRID_Z}, the decode kernel's grid limit; "
            "split the batch")
    problem = KVCacheProblem(batch, seqlen_q, nheads, nheads_kv, head_dim, seqlen_new, page_size, capacity,
                             entries, q.dtype)
    return problem, splits


def kvcache_value_flags(problem: KVCacheProblem, cache_seqlens, cache_batch_idx, block_table,
                       device: torch.device, cache_leftpad=None) -> torch.Tensor | None:
    """The rules on the values of cache_seqlens, cache_batch_idx, block_table and cache_leftpad,
    evaluated on the device into one bool tensor, one flag per rule of `raise_for_kvcache_values`
    (None when no tensor holds values to check). Reading it is the one host synchronization of a
    checked call."""
    if not any(isinstance(t, torch.Tensor) for t in (cache_seqlens, cache_batch_idx, block_table, cache_leftpad)):
        return None
    false = torch.zeros((), dtype=torch.bool, device=device)
    negative = overflow = batch_out = page_out = leftpad_out = false
    if isinstance(cache_seqlens, torch.Tensor):
        negative = (cache_seqlens < 0).any()
        overflow = (cache_seqlens > problem.capacity - problem.seqlen_new).any()
        keys = cache_seqlens[:, None] + problem.seqlen_new
    else:
        keys = problem.capacity if cache_seqlens is None else cache_seqlens + problem.seqlen_new
    if cache_batch_idx is not None:
        batch_out = ((cache_batch_idx < 0) | (cache_batch_idx >= problem.cache_entries)).any()
    if block_table is not None:
        pages = (keys + problem.page_size - 1) // problem.page_size
        used = torch.arange(block_table.shape[1], device=device)[None, :] < pages
        page_out = (used & ((block_table < 0) | (block_table >= problem.cache_entries))).any()
    if cache_leftpad is not None:  # a sequence starts at or before its old keys' end
        leftpad_out = ((cache_leftpad < 0) | (cache_leftpad.reshape(-1, 1) > keys - problem.seqlen_new)).any()
    return torch.stack([negative, overflow, batch_out, page_out, leftpad_out])


def raise_for_kvcache_values(flags: list[bool], problem: KVCacheProblem) -> None:
    """The typed error for the first rule `kvcache_value_flags` found broken."""
    messages = (
        "cache_seqlens has a negative entry",
        f"cache_seqlens + {problem.seqlen_new} appended keys exceeds the cache's {problem.capacity} keys per "
        "sequence for some sequence",
        f"cache_batch_idx has an entry outside [0, {problem.cache_entries})",
        f"block_table has a negative entry, or one >= num_blocks ({problem.cache_entries}), among the blocks "
        "the sequences use",
        "cache_leftpad has an entry below 0 or above its sequence's cache_seqlens",
    )
    raise_for_values(flags, messages)


# ---- values read back from the device: one synchronization per call --------------------------------
def reads_values(switch: bool) -> bool:
    """Whether a call reads back the checks of its tensors' values now: when its API's `switch` is
    on and no CUDA graph is being captured (a capture cannot synchronize)."""
    return switch and not torch.cuda.is_current_stream_capturing()


def raise_for_values(flags, messages) -> None:
    """The typed error for the first broken rule: `flags` (a bool tensor or list, one per rule,
    evaluated on the device) read back in one synchronization, `messages` the rules' errors."""
    for broken, message in zip(flags.tolist() if isinstance(flags, torch.Tensor) else flags, messages):
        if broken:
            raise InvalidDimensionError(message)


# ---- packed variable-length batches (flash_attn_varlen_func) ----------------------------------------
class VarlenProblem(NamedTuple):
    """The sizes of one flash_attn_varlen_func call, read off validated inputs (no tensor values)."""

    batch: int
    total_q: int
    total_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: torch.dtype


def _check_max_seqlen(name: str, value) -> int:
    # (torch.compile may trace it as a SymInt)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise InvalidDimensionError(
            f"{name} must be a Python int (it sizes the launch grid without a host synchronization), "
            f"got {type(value).__name__} {value!r}")
    if value < 0:
        raise InvalidDimensionError(f"{name} must be >= 0, got {value}")
    return value if isinstance(value, torch.SymInt) else int(value)


def _check_cu_seqlens(name: str, t, batch: int | None) -> int:
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise UnsupportedDtypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise InvalidDimensionError(f"{name} must be 1-D (batch + 1,), got shape {tuple(t.shape)}")
    if t.shape[0] < 2:
        raise DimensionMismatchError(f"{name} must have batch + 1 >= 2 entries, got {t.shape[0]}")
    if batch is not None and t.shape[0] != batch + 1:
        raise DimensionMismatchError(
            f"{name} must have batch + 1 = {batch + 1} entries (as cu_seqlens_q), got {t.shape[0]}")
    return t.shape[0] - 1


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> VarlenProblem:
    """Every rule of flash_attn_varlen_func that needs no tensor's values (those are
    `varlen_value_flags`): q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim),
    cu_seqlens int32 (batch + 1,), max_seqlen_* ints. Not the device (see `check_device`)."""
    for name, t, axes in (("q", q, "(total_q, nheads, headdim)"), ("k", k, "(total_k, nheads_kv, headdim)"),
                          ("v", v, "(total_k, nheads_kv, headdim)")):
        _require_tensor(name, t)
        if t.dim() != 3:
            raise InvalidDimensionError(f"{name} must have 3 dimensions {axes} (packed sequences), "
                                        f"got shape {tuple(t.shape)}")
        if min(t.shape) <= 0:
            raise InvalidDimensionError(f"{name} must have no empty dimension {axes}, got shape {tuple(t.shape)}")
    _require_dtype(k, v, q.dtype)
    # the dense rules on (1, total, heads, head_dim) views: heads, head dims, k == v
    _check_qkv_shapes(q[None], k[None], v[None])
    total_q, nheads, head_dim = q.shape
    if head_dim % HEAD_DIM_MULTIPLE != 0 or head_dim > MAX_HEAD_DIM:
        raise UnsupportedHeadDimError(
            f"head dim {head_dim} is not supported; supported: every multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}")
    batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if batch > MAX_GRID_Z:
        raise InvalidDimensionError(f"batch {batch} exceeds {MAX_GRID_Z}, the kernels' grid limit; split the batch")
    return VarlenProblem(batch, total_q, k.shape[0], nheads, k.shape[1], head_dim, max_q, max_k, q.dtype)


def varlen_value_flags(problem: VarlenProblem, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """The rules on cu_seqlens' values, evaluated on the device into one bool tensor, one flag per
    message of `varlen_value_messages`. Reading it is the one host synchronization of a checked call."""
    flags = []
    for cu, total, longest in ((cu_seqlens_q, problem.total_q, problem.max_seqlen_q),
                               (cu_seqlens_k, problem.total_k, problem.max_seqlen_k)):
        lengths = cu[1:] - cu[:-1]
        flags += [cu[0] < 0, (lengths < 0).any(), cu[-1] != total, (lengths > longest).any()]
    return torch.stack(flags)


def varlen_value_messages(problem: VarlenProblem) -> tuple[str, ...]:
    return tuple(
        message
        for side, total, longest in (("q", problem.total_q, problem.max_seqlen_q),
                                     ("k", problem.total_k, problem.max_seqlen_k))
        for message in (
            f"cu_seqlens_{side} must start at an offset >= 0",
            f"cu_seqlens_{side} must be non-decreasing",
            f"the last entry of cu_seqlens_{side} must equal the number of packed {side} tokens ({total})",
            f"max_seqlen_{side}={longest} is smaller than a sequence of cu_seqlens_{side}",
        )
    )
