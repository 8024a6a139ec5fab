"""Which kernel serves a call: architecture → kernel class → tiles → compile key.

The sm80 kernels serve sm_80/86/89 and every newer GPU without a specialized kernel; on sm_90 the
Hopper kernel takes the cases it can implement. `CUTE_FLASH_KERNEL_ARCH=sm80` forces the sm80
family on any GPU (to test or benchmark that path on a Hopper card).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import cutlass
import torch

from . import cache
from .errors import UnsupportedDtypeError
from .tensors import fake_bshd, fake_rowstat, fake_stream, fake_tail_split_workspace

CUTLASS_DTYPES = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
_TARGETS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a", (12, 1): "sm_121a"}


def target_arch_for(capability: tuple[int, int]) -> str:
    """The DSL compile target for a compute capability ('a' variants where the DSL needs them)."""
    return _TARGETS.get(tuple(capability), f"sm_{capability[0]}{capability[1]}")


@lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def target_arch(device_index: int | None = None) -> str:
    """The compile target of a GPU (default: the current one)."""
    return target_arch_for(capability(torch.cuda.current_device() if device_index is None else device_index))


# Without a GPU (compile checks, CI) persistent kernels are sized for an H100 SXM.
DEFAULT_SM_COUNT = 132


@lru_cache(maxsize=None)
def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of a GPU (default: the current one), or DEFAULT_SM_COUNT
    where there is no GPU."""
    if not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def kernel_family(capability: tuple[int, int]) -> str:
    forced = os.environ.get("CUTE_FLASH_KERNEL_ARCH")
    if forced:
        return forced
    return "sm90" if capability[0] == 9 else "sm80"


def cutlass_dtype(dtype: torch.dtype):
    try:
        return CUTLASS_DTYPES[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"{dtype} inputs are accepted by the API but no kernel computes them yet; "
            "cast q, k, v to torch.bfloat16 or torch.float16"
        ) from None


@dataclass(frozen=True)
class Plan:
    """A compiled-kernel recipe: the class, its compile-time configuration and the fake arguments."""

    kernel_cls: type
    init_kwargs: tuple[tuple[str, Any], ...]
    fake_args: tuple
    arch: str

    @property
    def key(self) -> tuple:
        return (self.kernel_cls.__module__, self.kernel_cls.__qualname__) + self.init_kwargs

    def build(self):
        return self.kernel_cls(**dict(self.init_kwargs)), self.fake_args

    def compiled(self):
        return cache.get_or_compile(self.key, self.build, self.arch)


def _forward_classes(family: str):
    if family == "sm90":
        from .kernels.sm90.fwd import FlashAttnFwdSm90
        from .kernels.sm80.fwd import FlashAttnFwdSm80

        return (FlashAttnFwdSm90, FlashAttnFwdSm80)
    from .kernels.sm80.fwd import FlashAttnFwdSm80

    return (FlashAttnFwdSm80,)


# Length classes, the only way lengths reach a compile key: kernels may pick other launch settings
# per class (FlashAttnFwdSm90.length_config). Problems with at most SHORT_512_SEQLEN_K keys are
# "short_512", which keep the short settings but for d256's non-causal blocks (a class where most
# head dims compile the same kernel as "short", so LENGTH_CLASSES lists it after "short", the first
# class that names a kernel); problems with at most SHORT_SEQLEN_K keys are "short";
# "short_2k" are those up to SHORT_2K_SEQLEN_K keys, which keep the short settings but for a few a
# kernel changes there (d96's tiles, d128's non-causal O rescale, d256's causal blocks: perf/NOTES.md);
# "mid" are causal ones up to MID_SEQLEN_K_CAUSAL keys, where the persistent causal kernel still gains
# 2-9% but wants other tiles and its dynamic schedule; the rest are "long".
SHORT_512_SEQLEN_K = 512
SHORT_SEQLEN_K = 1024
SHORT_2K_SEQLEN_K = 2048
MID_SEQLEN_K_CAUSAL = 4096


def length_class(seqlen_k: int, causal: bool) -> str:
    if seqlen_k <= SHORT_512_SEQLEN_K:
        return "short_512"
    if seqlen_k <= SHORT_SEQLEN_K:
        return "short"
    if seqlen_k <= SHORT_2K_SEQLEN_K:
        return "short_2k"
    return "mid" if causal and seqlen_k <= MID_SEQLEN_K_CAUSAL else "long"


LENGTH_CLASSES = ("short", "short_512", "short_2k", "mid", "long")


def length_classes(causal: bool) -> tuple[str, ...]:
    """The classes length_class returns for causal (or non-causal) problems."""
    return LENGTH_CLASSES if causal else tuple(name for name in LENGTH_CLASSES if name != "mid")


def fake_forward_args(cls, cdtype, head_dim: int) -> tuple:
    """The compile-time arguments of forward kernel class `cls` (its `__call__` signature)."""
    qkvo_lse = tuple(fake_bshd(cdtype, head_dim) for _ in range(4)) + (fake_rowstat(),)
    if getattr(cls, "takes_split_workspace", False):  # + the tail split's workspace and plan
        return qkvo_lse + fake_tail_split_workspace(head_dim) + (
            cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(1), fake_stream())
    return qkvo_lse + (cutlass.Float32(1.0), fake_stream())


def forward_launcher(plan: Plan):
    """`launch(q, k, v, out, lse, softmax_scale)` for a forward plan: compiles (or loads) its kernel
    and adds the per-call arguments that kernel takes beyond these."""
    compiled = plan.compiled()
    if getattr(plan.kernel_cls, "takes_split_workspace", False):
        from .forward_sm90 import launcher

        return launcher(compiled, dict(plan.init_kwargs))
    return compiled


def plan_forward(capability: tuple[int, int], dtype: torch.dtype, head_dim: int, causal: bool,
                 length: str = "long", num_sms: int | None = None) -> Plan:
    """The forward kernel for this GPU and problem class. Lengths matter only through `length`
    (length_class); persistent kernels are sized to `num_sms` (default: the current GPU's, see
    sm_count)."""
    cdtype = cutlass_dtype(dtype)
    for cls in _forward_classes(kernel_family(capability)):
        tiles = cls.default_tiles(cdtype, head_dim, causal)
        if hasattr(cls, "length_config"):
            tiles.update(cls.length_config(cdtype, head_dim, causal, length, sm_count() if num_sms is None else num_sms))
        if cls.can_implement(cdtype, head_dim, causal, **tiles):
            kwargs = dict(dtype=cdtype, head_dim=head_dim, causal=causal, **tiles)
            return Plan(cls, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])), fake_forward_args(cls, cdtype, head_dim),
                        target_arch_for(capability))
    raise UnsupportedDtypeError(f"no forward kernel implements dtype={dtype}, head_dim={head_dim}, causal={causal}")
