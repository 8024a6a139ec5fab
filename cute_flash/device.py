"""Facts about the GPU a call runs on: compute capability, compile target, SM count, kernel family.

Every other module asks here; nothing here imports the kernels or the compiler.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

_TARGETS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a", (12, 1): "sm_121a"}

# Without a GPU (compile checks, CI) persistent kernels are sized for an H100 SXM.
DEFAULT_SM_COUNT = 132


def target_arch_for(capability: tuple[int, int]) -> str:
    """The DSL compile target for a compute capability ('a' variants where the DSL needs them)."""
    return _TARGETS.get(tuple(capability), f"sm_{capability[0]}{capability[1]}")


def capability_of(arch: str) -> tuple[int, int]:
    """The compute capability of a compile target: 'sm_90a' -> (9, 0)."""
    digits = arch.removeprefix("sm_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])


@lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def target_arch(device_index: int | None = None) -> str:
    """The compile target of a GPU (default: the current one)."""
    return target_arch_for(capability(torch.cuda.current_device() if device_index is None else device_index))


@lru_cache(maxsize=None)
def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of a GPU (default: the current one), or DEFAULT_SM_COUNT
    where there is no GPU."""
    if not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def kernel_family(capability: tuple[int, int]) -> str:
    """"sm90" on Hopper, "sm80" elsewhere (the sm80 kernels serve every GPU from Ampere on);
    `CUTE_FLASH_KERNEL_ARCH=sm80` forces the sm80 family on any GPU."""
    forced = os.environ.get("CUTE_FLASH_KERNEL_ARCH")
    if forced:
        return forced
    return "sm90" if capability[0] == 9 else "sm80"
