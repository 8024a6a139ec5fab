"""Public entry points: `forward` and `backward` (framework-neutral, DLPack in, write out) and
`flash_attn_func` (PyTorch, differentiable). Validation always runs first; nothing is written
when it raises."""

from __future__ import annotations

import contextlib

import torch

from . import dispatch
from .backward_sm80 import backward_sm80
from .errors import MissingTensorError
from .tensors import VECTOR_BYTES
from .validate import check_device, check_like, check_qkv, check_softmax_scale, lse_shape


def as_torch(name: str, t):
    """A torch view of any DLPack tensor (zero copy); None stays None."""
    if t is None or type(t) is torch.Tensor or isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    raise MissingTensorError(f"{name} must be a torch tensor or support DLPack, got {type(t).__name__}")


def _normalized_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with size-1 modes given harmless values (their stride is never multiplied by a
    non-zero index, but the kernel's layout assumes the same divisibility for every stride)."""
    last = t.dim() - 1
    return tuple((1 if i == last else VECTOR_BYTES) if size == 1 else stride
                 for i, (size, stride) in enumerate(zip(t.shape, t.stride())))


def _addressable(strides, vector: int) -> bool:
    return strides[-1] == 1 and all(s % vector == 0 for s in strides[:-1])


def kernel_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t` itself (re-strided on size-1 modes) if kernels can address it directly, else None:
    last stride 1, other strides multiples of 16 bytes, base 16-byte aligned."""
    if t.data_ptr() % VECTOR_BYTES:
        return None
    if t.is_contiguous():  # validated head dims are multiples of 8: every stride is too
        return t
    vector = VECTOR_BYTES // t.element_size()
    strides = t.stride()
    if _addressable(strides, vector):
        return t
    strides = _normalized_strides(t)
    return t.as_strided(t.shape, strides) if _addressable(strides, vector) else None


def kernel_input(t: torch.Tensor) -> torch.Tensor:
    view = kernel_view(t)
    return view if view is not None else t.contiguous()


def stat_view(t: torch.Tensor) -> torch.Tensor | None:
    """A (batch, nheads, seqlen) fp32 statistic kernels can write directly, else None."""
    if t.stride()[-1] == 1:
        return t if t.data_ptr() % 4 == 0 else None
    strides = _normalized_strides(t)
    return t.as_strided(t.shape, strides) if strides[-1] == 1 and t.data_ptr() % 4 == 0 else None


def _on(device: torch.device):
    """Make `device` current for the launch (a no-op, and cheap, when it already is)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


_forward_kernels: dict[tuple, object] = {}


def _forward_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool):
    capability = dispatch.capability(device.index)
    key = (device.index, dtype, head_dim, causal, dispatch.kernel_family(capability))
    compiled = _forward_kernels.get(key)
    if compiled is None:
        compiled = dispatch.plan_forward(capability, dtype, head_dim, causal).compiled()
        _forward_kernels[key] = compiled
    return compiled


def forward(q, k, v, *, out=None, lse=None, softmax_scale=None, causal=False):
    """Attention forward on any DLPack-capable GPU tensors; returns (out, lse) as torch tensors.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim).
    `out` (like q) and `lse` ((batch, nheads, seqlen_q), float32) are written when given.
    """
    q, k, v, out, lse = as_torch("q", q), as_torch("k", k), as_torch("v", v), as_torch("out", out), as_torch("lse", lse)
    problem = check_qkv(q, k, v)
    tensors = {"q": q, "k": k, "v": v}
    if out is not None:
        check_like("out", out, q.shape, q.dtype)
        tensors["out"] = out
    if lse is not None:
        check_like("lse", lse, lse_shape(problem), torch.float32)
        tensors["lse"] = lse
    device = check_device(tensors)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    with _on(device):
        compiled = _forward_kernel(device, q.dtype, problem.head_dim, bool(causal))
        out_k = kernel_view(out) if out is not None else None
        out_k = out_k if out_k is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
        lse_k = stat_view(lse) if lse is not None else None
        lse_k = lse_k if lse_k is not None else torch.empty(lse_shape(problem), dtype=torch.float32, device=device)
        compiled(kernel_input(q), kernel_input(k), kernel_input(v), out_k, lse_k, scale)
    if out is not None and out_k is not out and out_k.data_ptr() != out.data_ptr():
        out.copy_(out_k)
    if lse is not None and lse_k.data_ptr() != lse.data_ptr():
        lse.copy_(lse_k)
    return (out if out is not None else out_k), (lse if lse is not None else lse_k)


def backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, softmax_scale=None, causal=False,
             deterministic=False):
    """Gradients of attention w.r.t. q, k, v on any DLPack GPU tensors; returns (dq, dk, dv).

    `lse` is the one `forward` returned. `dq`, `dk`, `dv` are written when given.
    """
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    dout, q, k, v, out, lse, dq, dk, dv = (as_torch(n, t) for n, t in zip(names, (dout, q, k, v, out, lse, dq, dk, dv)))
    problem = check_qkv(q, k, v)
    check_like("dout", dout, q.shape, q.dtype)
    check_like("out", out, q.shape, q.dtype)
    check_like("lse", lse, lse_shape(problem), torch.float32)
    tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            check_like(name, grad, like.shape, like.dtype)
            tensors[name] = grad
    device = check_device(tensors)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    dispatch.cutlass_dtype(q.dtype)
    results = []
    with _on(device):
        lse_k = stat_view(lse)
        lse_k = lse_k if lse_k is not None else lse.contiguous()
        grads = []
        for grad, like in ((dq, q), (dk, k), (dv, v)):
            view = kernel_view(grad) if grad is not None else None
            grads.append(view if view is not None else torch.empty_like(like, memory_format=torch.contiguous_format))
        backward_sm80(
            kernel_input(dout), kernel_input(q), kernel_input(k), kernel_input(v), kernel_input(out),
            lse_k, *grads,
            softmax_scale=scale, causal=bool(causal), deterministic=bool(deterministic),
        )
    for given, computed in zip((dq, dk, dv), grads):
        if given is not None and given.data_ptr() != computed.data_ptr():
            given.copy_(computed)
        results.append(given if given is not None else computed)
    return tuple(results)
