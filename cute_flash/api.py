"""Public entry points: `forward` and `backward` (framework-neutral, DLPack in, write out) and
`flash_attn_func` (PyTorch, differentiable). Validation always runs first; nothing is written
when it raises."""

from __future__ import annotations

import contextlib
import importlib

import torch

from . import device as devices
from . import dispatch
from .errors import MissingTensorError
from .dropout import kernel_dropout_args
from .launchers import backward_launcher, forward_launcher
from .tensors import VECTOR_BYTES
from .validate import (
    check_alibi_slopes, check_device, check_flag, check_like, check_qkv, check_softcap, check_softmax_scale,
    check_dropout_p, check_window, lse_shape, score_mods,
)


def as_torch(name: str, t):
    """A torch view of any DLPack tensor (zero copy); None stays None."""
    if t is None or type(t) is torch.Tensor or isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    raise MissingTensorError(f"{name} must be a torch tensor or support DLPack, got {type(t).__name__}")


def to_caller(like, given, result: torch.Tensor):
    """What a call returns for one output: `given` itself when the caller passed it (written in
    place), else `result` in the framework of `like` (the caller's input it corresponds to): a
    torch tensor for torch, the framework's own array otherwise, zero copy through DLPack (its
    array-API namespace's `from_dlpack`, or its package's)."""
    if given is not None:
        return given
    if isinstance(like, torch.Tensor):
        return result
    if hasattr(like, "__array_namespace__"):
        namespace = like.__array_namespace__()
    else:
        namespace = importlib.import_module(type(like).__module__.split(".")[0])
    from_dlpack = getattr(namespace, "from_dlpack", None)
    return result if from_dlpack is None else from_dlpack(result)


STAT_ALIGN = 4
"""Row statistics (LSE) are fp32 rows read and written one element at a time."""


def _normalized_strides(t: torch.Tensor, multiple: int) -> tuple[int, ...]:
    """Strides with size-1 modes given harmless values (their stride is never multiplied by a
    non-zero index, but the kernel's layout assumes the same divisibility for every stride)."""
    last = t.dim() - 1
    return tuple((1 if i == last else multiple) if size == 1 else stride
                 for i, (size, stride) in enumerate(zip(t.shape, t.stride())))


def _addressable(strides, multiple: int) -> bool:
    if strides[-1] != 1:
        return False
    for stride in strides[:-1]:  # a plain loop: this runs for every tensor of every call
        if stride % multiple:
            return False
    return True


def kernel_view(t: torch.Tensor, align: int = VECTOR_BYTES) -> torch.Tensor | None:
    """`t` itself (re-strided on size-1 modes) if kernels can address it directly, else None:
    last stride 1, other strides and the base address multiples of `align` bytes."""
    if t.data_ptr() % align:
        return None
    multiple = align // t.element_size() or 1
    if _addressable(t.stride(), multiple):
        return t
    strides = _normalized_strides(t, multiple)
    return t.as_strided(t.shape, strides) if _addressable(strides, multiple) else None


def kernel_input(t: torch.Tensor, align: int = VECTOR_BYTES) -> torch.Tensor:
    view = kernel_view(t, align)
    return view if view is not None else t.contiguous()


def output_buffer(given: torch.Tensor | None, fresh, align: int = VECTOR_BYTES) -> torch.Tensor:
    """What a kernel writes: `given` itself when it can, else `fresh()`, a new contiguous tensor
    (copied into `given` afterwards by `deliver`)."""
    if given is not None:
        view = kernel_view(given, align)
        if view is not None:
            return view
    return fresh()


def _like(t: torch.Tensor):
    return lambda: torch.empty_like(t, memory_format=torch.contiguous_format)


def deliver(given: torch.Tensor | None, written: torch.Tensor) -> torch.Tensor:
    """The result for the caller: `given` (filled from `written` if the kernel could not write it
    in place), or `written` when nothing was given."""
    if given is None:
        return written
    if written.data_ptr() != given.data_ptr():
        given.copy_(written)
    return given


def _on(device: torch.device):
    """Make `device` current for the launch (a no-op, and cheap, when it already is)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


# Launchers per (device, problem class, kernel family): a plan builds fake tensors and hashes its
# key, which the per-call path should not pay for.
_forward_kernels: dict[tuple, object] = {}
_backward_kernels: dict[tuple, object] = {}


def _launcher(memo: dict, plan_of, device: torch.device, *problem):
    """The launcher for `problem` on `device`: plan_of(capability, *problem) -> plan, planned,
    compiled (or loaded) and wrapped once per process."""
    capability = devices.capability(device.index)
    key = (device.index, *problem, devices.kernel_family(capability))
    launch = memo.get(key)
    if launch is None:
        launch = memo[key] = plan_of(capability, *problem)
    return launch


def _plan_forward(capability, dtype, head_dim, causal, length, mods, dropout, tf32_products):
    plan = dispatch.plan_forward(capability, dtype, head_dim, causal, length, devices.sm_count(torch.cuda.current_device()),
                                 mods=mods, dropout=dropout, tf32_products=tf32_products)
    return forward_launcher(plan)


def _plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods, dropout, tf32_products):
    return backward_launcher(dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods=mods,
                                                    dropout=dropout, tf32_products=tf32_products))


def _dropout(dropout_p, rng_state, mod_args):
    """The checked dropout_p and the kernels' mod arguments with dropout's appended (`call_with_mods`
    takes them after the score modifications': None for those left out)."""
    p = 0.0 if type(dropout_p) is float and dropout_p == 0.0 else check_dropout_p(dropout_p)
    if p == 0.0:
        return p, mod_args + (None,) * 4 if mod_args else mod_args
    if not isinstance(rng_state, torch.Tensor) or rng_state.shape != (2,) or rng_state.dtype != torch.int64 \
            or rng_state.device.type != "cpu":
        raise MissingTensorError(
            "dropout_p > 0 needs rng_state: the int64 (2,) CPU tensor [seed, offset] of "
            f"cute_flash.dropout.draw_rng_state (the backward takes the forward's), got {rng_state!r}")
    if not mod_args:
        mod_args = (None,) * 4
    return p, mod_args + kernel_dropout_args(p, rng_state)


def _score_mods(problem, causal, window_size, softcap, alibi_slopes):
    """The checked score modifications (validate.score_mods) and the kernels' runtime arguments for
    them: () for a plain call, else (window left, window right, softcap, slopes) with None for each
    one left out and an unbounded window side as a bound no row reaches."""
    window = (-1, -1) if type(window_size) is tuple and window_size == (-1, -1) else check_window(window_size)
    cap = 0.0 if type(softcap) is float and softcap == 0.0 else check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, problem.batch, problem.nheads)
    mods = score_mods(causal, window, cap, slopes, problem.seqlen_q, problem.seqlen_k)
    if mods.flags == dispatch.NO_MODS:
        return mods, ()
    sides = (None, None)
    if mods.window is not None:
        unbounded = problem.seqlen_q + problem.seqlen_k
        sides = tuple(unbounded if side < 0 else side for side in mods.window)
    return mods, sides + (mods.softcap or None, mods.alibi_slopes)


def forward(q, k, v, *, out=None, lse=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, rng_state=None):
    """Attention forward on any DLPack-capable GPU tensors; returns (out, lse) in q's framework
    (torch tensors for torch, CuPy arrays for CuPy, JAX arrays for JAX: zero copy).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim).
    `out` (like q) and `lse` ((batch, nheads, seqlen_q), float32) are written when given, and returned.
    window_size, softcap and alibi_slopes (a torch float32 tensor) as in flash-attn 2 (docs/api.md).
    dropout_p in [0, 1) drops probabilities with the Philox stream of `rng_state` (int64 (2,) CPU
    tensor [seed, offset]: cute_flash.dropout.draw_rng_state) and scales the kept ones by
    1 / (1 - dropout_p); lse stays that of the full softmax.
    """
    caller_q, caller_out, caller_lse = q, out, lse
    q, k, v, out, lse = as_torch("q", q), as_torch("k", k), as_torch("v", v), as_torch("out", out), as_torch("lse", lse)
    problem = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    mods, mod_args = _score_mods(problem, causal, window_size, softcap, alibi_slopes)
    dropout_p, mod_args = _dropout(dropout_p, rng_state, mod_args)
    tensors = {"q": q, "k": k, "v": v}
    if mods.alibi_slopes is not None:
        tensors["alibi_slopes"] = mods.alibi_slopes
    if out is not None:
        check_like("out", out, q.shape, q.dtype)
        tensors["out"] = out
    if lse is not None:
        check_like("lse", lse, lse_shape(problem), torch.float32)
        tensors["lse"] = lse
    device = check_device(tensors)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    with _on(device):
        length = dispatch.length_class(problem.seqlen_k, mods.causal)
        launch = _launcher(_forward_kernels, _plan_forward, device, q.dtype, problem.head_dim, mods.causal, length,
                           mods.flags, dropout_p != 0.0, dispatch.tf32_products_for(q.dtype))
        out_k = output_buffer(out, _like(q))
        lse_k = output_buffer(lse, lambda: torch.empty(lse_shape(problem), dtype=torch.float32, device=device), STAT_ALIGN)
        q_k, scale_k = _uniform_scores(q, scale)
        launch(q_k, kernel_input(k), kernel_input(v), out_k, lse_k, scale_k, *mod_args)
        return (to_caller(caller_q, caller_out, deliver(out, out_k)),
                to_caller(caller_q, caller_lse, deliver(lse, lse_k)))


def _uniform_scores(q, scale: float):
    """The kernels' q and scale. softmax_scale = 0 weighs every visible key alike, but the kernels
    mask scores with -inf before they scale them (and start a row's maximum at -inf), and
    -inf * 0 is NaN; so they get zero scores at scale 1 instead: the same probabilities exactly
    and the same LSE (the log of the number of visible keys)."""
    if scale == 0.0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), 1.0
    return kernel_input(q), scale


def backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, softmax_scale=None, causal=False,
             deterministic=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    """Gradients of attention w.r.t. q, k, v on any DLPack GPU tensors; returns (dq, dk, dv) in the
    framework of q, k and v (as `forward`).

    `lse` is the one `forward` returned (with the same causal, window_size, softcap, alibi_slopes,
    dropout_p and rng_state: the backward regenerates the forward's dropout mask).
    `dq`, `dk`, `dv` are written when given, and returned.
    """
    callers = (q, k, v), (dq, dk, dv)
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    dout, q, k, v, out, lse, dq, dk, dv = (as_torch(n, t) for n, t in zip(names, (dout, q, k, v, out, lse, dq, dk, dv)))
    problem = check_qkv(q, k, v)
    check_like("dout", dout, q.shape, q.dtype)
    check_like("out", out, q.shape, q.dtype)
    check_like("lse", lse, lse_shape(problem), torch.float32)
    causal = check_flag("causal", causal)
    mods, mod_args = _score_mods(problem, causal, window_size, softcap, alibi_slopes)
    dropout_p, mod_args = _dropout(dropout_p, rng_state, mod_args)
    tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    if mods.alibi_slopes is not None:
        tensors["alibi_slopes"] = mods.alibi_slopes
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            check_like(name, grad, like.shape, like.dtype)
            tensors[name] = grad
    device = check_device(tensors)
    scale = check_softmax_scale(softmax_scale, problem.head_dim)
    deterministic = check_flag("deterministic", deterministic)
    dispatch.cutlass_dtype(q.dtype)  # a typed error for dtypes no kernel computes, before any allocation
    with _on(device):
        grads = [output_buffer(grad, _like(like)) for grad, like in ((dq, q), (dk, k), (dv, v))]
        gqa = problem.nheads != problem.nheads_kv
        launch = _launcher(_backward_kernels, _plan_backward, device, q.dtype, problem.head_dim, mods.causal,
                           deterministic, gqa, mods.flags, dropout_p != 0.0, dispatch.tf32_products_for(q.dtype))
        q_k, scale_k = _uniform_scores(q, scale)
        launch(kernel_input(dout), q_k, kernel_input(k), kernel_input(v), kernel_input(out),
               kernel_input(lse, STAT_ALIGN), *grads, scale_k, *mod_args)
        if scale == 0.0:
            grads[0].zero_()  # dQ = scale * dS K, and so is dK (zero through the zero q above)
        return tuple(to_caller(like, caller_grad, deliver(given, written))
                     for like, caller_grad, given, written in zip(*callers, (dq, dk, dv), grads))
