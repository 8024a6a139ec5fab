"""cute-flash as torch's flash-attention implementation behind
`torch.nn.functional.scaled_dot_product_attention`.

torch keeps a registry of flash-attention implementations (`torch.nn.attention.
register_flash_attention_impl` / `activate_flash_attention_impl`, the mechanism FA3 and FA4 use).
Importing this module registers cute-flash there under the name "cute-flash"; `activate()` (or
torch's own `activate_flash_attention_impl("cute-flash")`) then replaces the CUDA kernels of the two
aten ops that torch's flash backend runs, `_scaled_dot_product_flash_attention` and its backward.
From then on, every SDPA call that torch sends to its flash backend runs cute-flash's forward and
backward, with torch's semantics:

- layout (batch, nheads, seqlen, headdim), read through transposed views (no copy);
- `scale` as given (SDPA passes 1/sqrt(headdim) computed before its head-dim padding);
- `is_causal`: torch's flash backend only takes it with seqlen_q == seqlen_k, where top-left and
  bottom-right alignment agree; a direct call of the op with seqlen_q != seqlen_k goes to torch;
- `enable_gqa`: fewer key/value heads reach the op as they are, which the kernels take.

A call the kernels cannot serve (dropout, return_debug_mask, a dtype or head dim without a kernel,
a scale that is not positive, a GPU older than sm_80, nested tensors) runs torch's own kernel, the
one that was registered before activation. The backward makes the same choice from the same
arguments, so a forward and its backward always come from the same implementation (except after
a forward with return_debug_mask, whose backward is ours: it needs only out and lse, which torch's
kernel defines as cute-flash does). Calls torch does not send to its flash backend at all (an attn_mask,
fp32, CPU tensors) never reach this module.

On GPUs where torch prefers its cuDNN backend (sm_90 and sm_100 with a recent cuDNN), SDPA calls
reach the flash backend only when flash is preferred: `enabled()` does that for its block, and
`torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)` does it anywhere.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import fallback
from .errors import CudaError, MissingDependencyError
from .validate import kernel_support_issue

IMPL_NAME = "cute-flash"
"""The name in torch's flash-attention registry."""

FORWARD_OP = "_scaled_dot_product_flash_attention"
BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"

_REGISTRY_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl",
                       "current_flash_attention_impl", "restore_flash_attention_impl")


def _registry():
    """torch.nn.attention, checked for the registry and for `torch.library.get_kernel` (which
    reaches torch's own kernel for the calls cute-flash hands back)."""
    attention = torch.nn.attention
    missing = [name for name in _REGISTRY_FUNCTIONS if not hasattr(attention, name)]
    if not hasattr(torch.library, "get_kernel"):
        missing.append("torch.library.get_kernel")
    if missing:
        raise MissingDependencyError(
            f"torch {torch.__version__} lacks {', '.join(missing)}: routing scaled_dot_product_attention to "
            "cute-flash needs a torch with the flash-attention registry (torch.nn.attention."
            "register_flash_attention_impl, in the releases that ship FA4 registration)"
        )
    return attention


def _support_issue(query, key, value, dropout_p: float, is_causal: bool, scale: float | None) -> str | None:
    """Why cute-flash does not serve this call of the flash op (torch's kernel does), or None."""
    if dropout_p != 0.0:
        return "dropout"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not 4-D"
    if is_causal and query.shape[2] != key.shape[2]:
        return "is_causal with seqlen_q != seqlen_k"
    return kernel_support_issue(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale)


def _empty_rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's (rng_state, unused) outputs, shaped as torch's meta function declares them. Left
    unwritten, as torch's kernel leaves them without dropout: only a dropout backward reads them."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _forward(original, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
             scale=None):
    if return_debug_mask or _support_issue(query, key, value, dropout_p, is_causal, scale) is not None:
        return original.call_boxed(keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    from . import api

    # The outputs have the strides torch's meta function gives them (like the query's), so compiled
    # graphs see what they traced; the kernel writes them through (batch, seqlen, nheads, headdim) views.
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    api.forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), out=out.transpose(1, 2), lse=lse,
                softmax_scale=scale, causal=is_causal)
    rng_state, unused = _empty_rng_state(query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask


def _backward(original, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
              dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if _support_issue(query, key, value, dropout_p, is_causal, scale) is not None:
        return original.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                   max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    from . import api

    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    api.backward(*(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp,
                 dq=grads[0].transpose(1, 2), dk=grads[1].transpose(1, 2), dv=grads[2].transpose(1, 2),
                 softmax_scale=scale, causal=is_causal, deterministic=torch.are_deterministic_algorithms_enabled())
    return grads


@dataclass
class _Handle:
    """What activation registered; torch's registry calls `remove` to restore torch's kernels."""

    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _original_kernel(op: str):
    try:
        return torch.library.get_kernel(f"aten::{op}", "CUDA")
    except RuntimeError as error:
        raise CudaError(
            f"this torch ({torch.__version__}) has no CUDA kernel for aten::{op} to route; "
            "scaled_dot_product_attention routing needs a CUDA build of torch"
        ) from error


def _install() -> _Handle:
    """torch's register_fn for "cute-flash": replace the CUDA kernels of the two flash ops, keeping
    the ones they replace for the calls cute-flash hands back."""
    forward, backward = _original_kernel(FORWARD_OP), _original_kernel(BACKWARD_OP)
    library = torch.library.Library("aten", "IMPL", "CUDA")
    try:
        library.impl(FORWARD_OP, functools.partial(_forward, forward), "CUDA", with_keyset=True)
        library.impl(BACKWARD_OP, functools.partial(_backward, backward), "CUDA", with_keyset=True)
    except BaseException:
        library._destroy()
        raise
    return _Handle(library)


def _register() -> None:
    attention = _registry()
    attention.register_flash_attention_impl(IMPL_NAME, register_fn=_install)


def activate() -> None:
    """Route SDPA's flash backend to cute-flash for the rest of the process (until `deactivate`).
    Replaces whichever flash implementation was active (torch's own, FA3, FA4). On a GPU older than
    sm_80 torch never calls its flash backend, so SDPA keeps its memory-efficient one: a warning says
    so once."""
    _register()
    torch.nn.attention.activate_flash_attention_impl(IMPL_NAME)
    fallback.warn_if_current_gpu_is_older(fallback.SDPA_FALLBACK)


def deactivate() -> None:
    """Give SDPA's flash backend back to torch's own kernels, if cute-flash is the active one."""
    if is_active():
        torch.nn.attention.restore_flash_attention_impl()


def is_active() -> bool:
    attention = _registry()
    return attention.current_flash_attention_impl() == IMPL_NAME


def _flash_first() -> list:
    """The enabled SDPA backends, flash first, then the others in torch's default order."""
    backend = torch.nn.attention.SDPBackend
    cuda = torch.backends.cuda
    enabled = [(backend.FLASH_ATTENTION, cuda.flash_sdp_enabled()), (backend.CUDNN_ATTENTION, cuda.cudnn_sdp_enabled()),
               (backend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()), (backend.MATH, cuda.math_sdp_enabled())]
    return [b for b, on in enabled if on]


@contextlib.contextmanager
def enabled(prefer_flash: bool = True) -> Iterator[None]:
    """Within the block, SDPA's flash backend is cute-flash; with `prefer_flash`, the flash backend
    also comes first in torch's backend priority (ahead of cuDNN, which torch prefers on some GPUs).
    On exit the previously active implementation and priority come back."""
    attention = _registry()
    previous = attention.current_flash_attention_impl()
    activate()
    try:
        with attention.sdpa_kernel(_flash_first(), set_priority=True) if prefer_flash else contextlib.nullcontext():
            yield
    finally:
        if previous is None:
            deactivate()
        else:
            attention.activate_flash_attention_impl(previous)


with contextlib.suppress(MissingDependencyError):
    _register()
