"""Every attention implementation the benchmark runs, behind one signature.

A method is `fn(q, k, v, causal, softmax_scale, **mods) -> out` with q (batch, seqlen_q, nheads,
headdim) and k, v (batch, seqlen_k, nheads_kv, headdim), like cute-flash; `mods` are a cell's
score modifications (suites.Cell.mods: window=(left, right), softcap, alibi_slopes, dropout_p),
which a method without them refuses with NotImplementedError (recorded as "unsupported"). Methods that are not importable on
this machine are still listed, with the reason, so a result file says what was skipped and why.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

OURS = "ours"
FORCE_ARCH = "CUTE_FLASH_KERNEL_ARCH"


@dataclass
class Method:
    name: str
    kind: str  # "ours", "reference" (plain torch) or "peer" (another fast kernel)
    description: str
    fn: Callable | None = None
    note: str = ""  # why it is unavailable, or a caveat
    # held around every call and gradient the benchmark runs with fn: the backward is dispatched
    # when autograd runs it, after fn has returned
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def available(self) -> bool:
        return self.fn is not None

    def info(self) -> dict:
        return {"kind": self.kind, "description": self.description, "available": self.available, "note": self.note}


def plain_only(fn):
    """A method without score modifications: a cell with some is unsupported."""
    def method(q, k, v, causal, softmax_scale, **mods):
        if mods:
            raise NotImplementedError(f"no {', '.join(mods)}")
        return fn(q, k, v, causal, softmax_scale)

    return method


def standard_attention(q, k, v, causal: bool, softmax_scale: float):
    """Attention as a textbook writes it: S = QK^T in the input dtype, softmax in fp32,
    O = PV in the input dtype. Materialises the (seqlen_q, seqlen_k) score matrix per head."""
    nheads, nheads_kv = q.shape[2], k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, dim) views
    if nheads != nheads_kv:
        k = k.repeat_interleave(nheads // nheads_kv, dim=1)
        v = v.repeat_interleave(nheads // nheads_kv, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * softmax_scale
    if causal:
        sq, sk = scores.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def _ours() -> Method:
    desc = "cute_flash.flash_attn_func"
    try:
        import cute_flash

        return Method(OURS, "ours", desc, _call_ours(cute_flash.flash_attn_func))
    except Exception as exc:  # noqa: BLE001 - record why, never crash the run
        return Method(OURS, "ours", desc, note=f"unavailable: {type(exc).__name__}: {exc}")


def _call_ours(flash_attn_func):
    def fn(q, k, v, causal, softmax_scale, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0):
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p)

    return fn


def _ours_sm80(ours: Method) -> Method:
    """Our sm80 kernel family on a Hopper GPU (CUTE_FLASH_KERNEL_ARCH=sm80 around the forward and
    the backward), to show what the sm90 kernels add over it."""
    desc = "cute_flash.flash_attn_func with CUTE_FLASH_KERNEL_ARCH=sm80"
    if not ours.available:
        return Method("ours_sm80", "ours", desc, note=ours.note)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return Method("ours_sm80", "ours", desc, note="unavailable: only measured on sm90, where it differs from ours")
    return Method("ours_sm80", "ours", desc, ours.fn, scope=_forced_sm80)


@contextlib.contextmanager
def _forced_sm80():
    saved = os.environ.get(FORCE_ARCH)
    os.environ[FORCE_ARCH] = "sm80"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[FORCE_ARCH]
        else:
            os.environ[FORCE_ARCH] = saved


def _sdpa(name: str, backend_name: str, description: str) -> Method:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, backend_name)
    except (ImportError, AttributeError) as exc:
        return Method(name, "peer", description, note=f"unavailable: {exc}")

    @plain_only
    def fn(q, k, v, causal, softmax_scale):
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        with sdpa_kernel(backend):
            out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       is_causal=causal, scale=softmax_scale, **gqa)
        return out.transpose(1, 2)

    kind = "reference" if backend_name == "MATH" else "peer"
    return Method(name, kind, description, fn, note="SDPA causal is top-left aligned; all suite cells have seqlen_q == seqlen_k")


def _fa4() -> Method:
    desc = "FlashAttention-4, flash_attn.cute.flash_attn_func"
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001
        return Method("fa4", "peer", desc, note=f"unavailable: {type(exc).__name__}: {exc}")

    def fn(q, k, v, causal, softmax_scale, window=None, softcap=0.0, **others):
        if others:  # flash_attn.cute has no ALiBi and no dropout
            raise NotImplementedError(f"no {', '.join(others)}")
        window_size = (None, None) if window is None else tuple(None if side < 0 else side for side in window)
        out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap)
        return out[0] if isinstance(out, tuple) else out  # some versions return (out, lse)

    return Method("fa4", "peer", desc, fn, note="window sides: None unbounded (FA4's spelling of flash-attn 2's -1)")


def _flex() -> Method:
    """torch's flex_attention (compiled), with the window as a block mask, softcap and ALiBi as score mods."""
    desc = "torch.nn.attention.flex_attention, torch.compile'd, block mask per window"
    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError as exc:
        return Method("flex", "peer", desc, note=f"unavailable: {exc}")
    import torch._dynamo
    # Every (shape, mask, score mod) is one compiled graph; past dynamo's default limit of 8 flex
    # falls back to its unfused path (scores materialized, 10-30x slower), which would be reported
    # as the peer's speed. A suite has tens of cells: allow them all.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 512))
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    masks = {}

    def block_mask(causal, window, sq, sk, device):
        key = (causal, window, sq, sk)
        if key not in masks:
            left, right = window
            right = 0 if causal else right

            def visible(b, h, i, j):
                diag = i + (sk - sq)
                ok = (j <= diag + right) if right >= 0 else (j >= 0)
                return ok & (j >= diag - left) if left >= 0 else ok

            masks[key] = flex.create_block_mask(visible, None, None, sq, sk, device=device)
        return masks[key]

    def fn(q, k, v, causal, softmax_scale, window=(-1, -1), softcap=0.0, alibi_slopes=None, **others):
        if others:  # flex_attention has no dropout
            raise NotImplementedError(f"no {', '.join(others)}")
        mask = None if window == (-1, -1) and not causal else block_mask(causal, window, q.shape[1], k.shape[1],
                                                                         q.device)
        score_mod = None
        if softcap and alibi_slopes is not None:
            raise NotImplementedError("softcap with alibi_slopes")  # no suite cell has both
        if softcap:
            def score_mod(score, b, h, i, j):
                return softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            shift = k.shape[1] - q.shape[1]  # flash-attn's alignment: bias -slope |i + sk - sq - j|

            def score_mod(score, b, h, i, j):
                return score - alibi_slopes[h] * (i + shift - j).abs()
        with warnings.catch_warnings():
            # The unfused fallback is not the peer we compare against: fail the cell instead.
            warnings.filterwarnings("error", message=".*without torch.compile.*")
            out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                           block_mask=mask, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return Method("flex", "peer", desc, fn)


def discover_methods(only: list[str] | None = None) -> list[Method]:
    ours = _ours()
    methods = [
        ours,
        _ours_sm80(ours),
        Method("standard", "reference", "plain torch: matmul -> fp32 softmax -> matmul", plain_only(standard_attention)),
        _sdpa("sdpa_math", "MATH", "torch SDPA, MATH backend"),
        _sdpa("sdpa_efficient", "EFFICIENT_ATTENTION", "torch SDPA, memory-efficient (xFormers) backend"),
        _sdpa("sdpa_flash", "FLASH_ATTENTION", "torch SDPA, FlashAttention-2 backend"),
        _sdpa("sdpa_cudnn", "CUDNN_ATTENTION", "torch SDPA, cuDNN backend"),
        _fa4(),
        _flex(),
    ]
    if only:
        unknown = set(only) - {m.name for m in methods}
        if unknown:
            raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in only]
    return methods


METHOD_NAMES = ("ours", "ours_sm80", "standard", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4",
                "flex")

