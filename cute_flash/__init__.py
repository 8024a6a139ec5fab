"""cute-flash: FlashAttention forward and backward written with NVIDIA's CuTe DSL."""

from .errors import (
    CudaError,
    CuteFlashError,
    DimensionMismatchError,
    ErrorCode,
    InvalidDimensionError,
    MissingTensorError,
    OutOfMemoryError,
    UnsupportedDtypeError,
    UnsupportedHeadDimError,
)
from .reference import reference_attention

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func", "forward", "backward", "reference_attention", "CuteFlashError", "ErrorCode",
    "CudaError", "DimensionMismatchError", "InvalidDimensionError", "MissingTensorError",
    "OutOfMemoryError", "UnsupportedDtypeError", "UnsupportedHeadDimError",
]


def __getattr__(name):
    # The kernel-facing modules import the CuTe DSL, which takes a second; load them on first use.
    if name in ("forward", "backward"):
        from . import api

        return getattr(api, name)
    if name == "flash_attn_func":
        from .autograd import flash_attn_func

        return flash_attn_func
    raise AttributeError(f"module 'cute_flash' has no attribute {name!r}")
