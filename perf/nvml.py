"""The GPU's current SM clock, read through NVML (libnvidia-ml, which every NVIDIA driver ships).

Used by the bench to note the clock each burst of timed calls ran at: at long sequences the
methods run at the power cap, where the clock moves by 5-25% within a cell, and a ratio read
from rounds at different clocks mixes kernel speed with power state. Read through ctypes so
that the bench needs no extra package; any failure (no driver, a sandbox that refuses NVML)
makes the reader answer None, and the bench records no clock.
"""

from __future__ import annotations

import ctypes

_NVML_SUCCESS = 0
_NVML_CLOCK_SM = 1


class SmClock:
    """`mhz()`: the current SM clock of one CUDA device, or None where NVML cannot tell."""

    def __init__(self, device_uuid: str | None):
        self._lib, self._handle = None, ctypes.c_void_p()
        if not device_uuid:
            return
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != _NVML_SUCCESS:
                return
            # Found by UUID, not index: NVML numbers every GPU, CUDA only the visible ones.
            if lib.nvmlDeviceGetHandleByUUID(device_uuid.encode(), ctypes.byref(self._handle)) != _NVML_SUCCESS:
                return
        except (OSError, AttributeError):
            return
        self._lib = lib

    def mhz(self) -> int | None:
        if self._lib is None:
            return None
        value = ctypes.c_uint()
        if self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(value)) != _NVML_SUCCESS:
            return None
        return value.value


def cuda_device_uuid(device: int = 0) -> str | None:
    """NVML's name for a CUDA device ("GPU-" and its UUID), or None where torch does not say."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None
