"""Typed errors. Each carries the integer code of the C ABI (kept from the CuFlash-Attn design),
so a C caller and a Python caller see the same failure for the same bad input."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    SUCCESS = 0
    INVALID_DIMENSION = 1
    DIMENSION_MISMATCH = 2
    NULL_POINTER = 3
    CUDA_ERROR = 4
    OUT_OF_MEMORY = 5
    UNSUPPORTED_HEAD_DIM = 6
    UNSUPPORTED_DTYPE = 7


class CuteFlashError(Exception):
    """Base of every error cute-flash raises on purpose; `.code` is an `ErrorCode`."""

    code: ErrorCode = ErrorCode.CUDA_ERROR

    def __init__(self, message: str):
        super().__init__(message)


class InvalidDimensionError(CuteFlashError, ValueError):
    code = ErrorCode.INVALID_DIMENSION


class DimensionMismatchError(CuteFlashError, ValueError):
    code = ErrorCode.DIMENSION_MISMATCH


class MissingTensorError(CuteFlashError, TypeError):
    code = ErrorCode.NULL_POINTER


class CudaError(CuteFlashError, RuntimeError):
    """Wrong device (CPU tensors, tensors on different GPUs, a GPU older than sm_80) or a failed launch."""

    code = ErrorCode.CUDA_ERROR


class OutOfMemoryError(CuteFlashError, MemoryError):
    code = ErrorCode.OUT_OF_MEMORY


class UnsupportedHeadDimError(CuteFlashError, ValueError):
    code = ErrorCode.UNSUPPORTED_HEAD_DIM


class UnsupportedDtypeError(CuteFlashError, TypeError):
    code = ErrorCode.UNSUPPORTED_DTYPE


class UnsupportedArgumentError(CuteFlashError, ValueError):
    """An argument of the flash-attn interface that cute-flash does not implement (dropout, sliding
    windows, softcapping, ALiBi): rejected rather than ignored. The message names what is supported."""

    code = ErrorCode.INVALID_DIMENSION


class MissingDependencyError(CuteFlashError, ImportError):
    """An integration (torch's SDPA registry, Hugging Face transformers) needs a library, or a newer
    version of one, than the one installed."""

    code = ErrorCode.CUDA_ERROR
