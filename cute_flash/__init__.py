"""cute-flash: FlashAttention forward and backward written with NVIDIA's CuTe DSL."""

from .errors import (
    CudaError,
    CuteFlashError,
    DimensionMismatchError,
    ErrorCode,
    InvalidDimensionError,
    MissingDependencyError,
    MissingTensorError,
    OutOfMemoryError,
    UnsupportedArgumentError,
    UnsupportedDtypeError,
    UnsupportedHeadDimError,
)
from .reference import reference_attention

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_with_kvcache",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
    "forward", "backward",
    "ring_flash_attn_func", "reference_attention", "CuteFlashError", "ErrorCode", "CudaError", "DimensionMismatchError",
    "InvalidDimensionError", "MissingDependencyError", "MissingTensorError", "OutOfMemoryError",
    "UnsupportedArgumentError", "UnsupportedDtypeError", "UnsupportedHeadDimError",
]


def __getattr__(name):
    # The kernel-facing modules import the CuTe DSL, which takes a second; load them on first use.
    if name in ("forward", "backward"):
        from . import api

        return getattr(api, name)
    if name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
                "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        from . import flash_attn_interface

        return getattr(flash_attn_interface, name)
    if name == "flash_attn_with_kvcache":
        from . import kvcache

        return kvcache.flash_attn_with_kvcache
    if name == "ring_flash_attn_func":
        from . import distributed

        return distributed.ring_flash_attn_func
    raise AttributeError(f"module 'cute_flash' has no attribute {name!r}")
