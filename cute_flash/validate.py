"""Every input rule, checked before anything is launched or written.

Functions here take torch tensors (the API converts DLPack inputs first, without copying) and
either return normally or raise a typed `CuteFlashError`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .device import capability as device_capability
from .errors import (
    CudaError,
    DimensionMismatchError,
    InvalidDimensionError,
    MissingTensorError,
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
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale < 0:
        raise InvalidDimensionError(f"softmax_scale must be a finite, non-negative number, got {softmax_scale}")
    return scale


def check_qkv(q, k, v) -> Problem:
    """Shapes, dtypes and head dim of q, k, v; not the device (see `check_device`)."""
    _require_tensor("q", q)
    _require_tensor("k", k)
    _require_tensor("v", v)
    _require_rank4("q", q, "(batch, seqlen_q, nheads, headdim)")
    _require_rank4("k", k, "(batch, seqlen_k, nheads_kv, headdim)")
    _require_rank4("v", v, "(batch, seqlen_k, nheads_kv, headdim)")
    _require_dtype(k, v, q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
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
    if head_dim % HEAD_DIM_MULTIPLE != 0 or head_dim > MAX_HEAD_DIM:
        raise UnsupportedHeadDimError(
            f"head dim {head_dim} is not supported; supported: every multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"
        )
    return Problem(batch, seqlen_q, k.shape[1], nheads, nheads_kv, head_dim, q.dtype, q.device)


def check_like(name: str, t, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """An output or gradient tensor that must match `shape` and `dtype` exactly."""
    _require_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise DimensionMismatchError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise UnsupportedDtypeError(f"{name} must be {dtype}, got {t.dtype}")


def lse_shape(p: Problem) -> tuple[int, int, int]:
    return (p.batch, p.nheads, p.seqlen_q)
