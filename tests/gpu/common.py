"""Shared pieces of the GPU tests: random inputs, the error yardstick, which kernel served a call,
and (in one place, to follow the package when it moves) the internal names some tests need.

The yardstick (docs/testing.md). A result is compared with the float64 reference
(`cute_flash.reference_attention`, plain torch, no kernel code) and so is an emulation of flash
numerics computed from the same low-precision inputs. The kernel may err by at most MAX_FACTOR
times the emulation's worst error, measured per row relative to that row's size, and by at most
RMS_FACTOR times its RMS error, each plus a tiny absolute floor.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass

import torch

import cute_flash
from cute_flash import reference_attention
from cute_flash.reference import alibi_bias, visible_keys

MAX_FACTOR = 3.0
"""Kernel vs emulation, worst row-relative error. A correct kernel differs from the emulation only
in summation order, running-max bookkeeping and approximate exp2/log2, all far below the 16-bit
roundings that set both errors, so its ratio sits near 1 (a float32 flash loop: about 1/3 of the
bound, tests/cpu/test_yardstick.py); 3 leaves room for the extreme value of a million draws and
still fails a dropped key or a stale rescale (scripts/yardstick-demo.py)."""

RMS_FACTOR = 2.0
"""Kernel vs emulation, RMS error over the whole tensor: an average, so it varies far less than
the worst element, and a uniform excess (a second rounding of P, fp16 accumulation) shows here first."""

ROW_FLOOR = 2.0 ** -10
"""Rows are measured against their own largest reference value, but never one below 2^-10 of the
tensor's largest: a row of (near) zeros, such as one that sees no key, is held to the tensor's scale."""

FORWARD_FLOOR = 1e-6
BACKWARD_FLOOR = 1e-5
"""Absolute slack for results the emulation reproduces exactly. The backward's is larger: with a
single key dS = P * (dP - D) is zero exactly, but dP and D are the same fp32 dot product summed in
two orders, and their difference (up to ~1e-6 at d256, times K and the scale) is what the kernel writes."""

FP32_OUT_TOLERANCE = 1e-3
FP32_GRAD_TOLERANCE = 2e-3
FP32_EMULATION_FACTOR = 10.0
"""fp32 inputs (split TF32) have no 16-bit rounding for an emulation to reproduce: they are held to
the design's fixed bar, in absolute terms on rows of size up to 1 (randn) and relative to larger
rows (inputs filled with 100), plus FP32_EMULATION_FACTOR times the worst row-relative error of
the fp32 emulation -- which matters only where fp32 itself cannot meet the bar (scores of 1e4,
whose fp32 rounding alone moves the softmax weights by ~1e-3)."""

FP32_DOT_TOLERANCE = 2.0 ** -20
"""fp32 scores are dot products on split TF32: each product errs by ~2^-22 of its size (the dropped
lo x lo term) and the MMA adds them with truncation, so a score's error is bounded by a small
multiple of 2^-22 times sum_k |q_k k_k|, not by the score itself. Where that sum is large and the
score small (entries of +-35 at d64: sum 8e4, scaled 1e4, scores near 60) the LSE moves by ~4e-3
(H100, 2026-11-27), more than LSE_TOLERANCE allows relative to the LSE; the fp32 LSE bound adds
this allowance (2^-20 times the scaled sum of |q_k k_k| of the row's largest such key)."""

LSE_TOLERANCE = 1e-5
"""LSE error relative to 1 + |lse|: ex2/lg2 approximations are not emulated, so LSE has a plain
relative bound, well above float32 rounding (~1e-7 relative per operation) and far below what a
wrong merge of split pieces or a wrong rescale does to it."""


def randn(*shape, dtype, device="cuda", transposed=False):
    """Fresh standard-normal data; `transposed` gives a (B, S, H, D) view of a (B, H, S, D) tensor."""
    if transposed:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(*shape, device=device, dtype=dtype)


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# --- Flash numerics, emulated -------------------------------------------------------------------
# Products are summed in float64 and rounded to float32 where a kernel holds float32 (its MMA
# accumulators): fp32 summation errs ~1e-7, three orders below the 16-bit roundings that matter,
# and this way no global TF32 setting can change the yardstick.


def _fp32_matmul(a, b):
    return torch.matmul(a.double(), b.double()).float()


def _scores(qh, kh, scale, causal, mods=None, h=0):
    """fp32 scaled scores (B, sq, sk) of query head h, masked with -inf, and d(score)/d(scaled
    q.k) (1 without softcap). `mods`: flash-attn 2's window_size, softcap, alibi_slopes (as the
    reference takes them), applied in fp32 as a kernel does."""
    mods = mods or {}
    s = _fp32_matmul(qh, kh.transpose(-1, -2)) * scale
    capped = None
    if mods.get("softcap"):
        cap = mods["softcap"]
        t = torch.tanh(s / cap)
        s, capped = cap * t, 1 - t * t
    slopes = mods.get("alibi_slopes")
    if slopes is not None:
        s = s + alibi_bias(slopes.reshape(-1, slopes.shape[-1])[:, h:h + 1], qh.shape[1], kh.shape[1])[:, 0].float()
    window = tuple(mods.get("window_size", (-1, -1)))
    if causal or window != (-1, -1):
        s = s.masked_fill(~visible_keys(qh.shape[1], kh.shape[1], causal, window, qh.device), float("-inf"))
    return s, capped


def _dropout(mods, h):
    """(keep mask of query head h, 1 / (1 - p)) of a dropout call (`mods`: dropout_p and the
    dropout_keep mask, as the reference takes them), (1, 1) without dropout."""
    keep = mods.get("dropout_keep")
    if keep is None:
        return 1.0, 1.0
    return keep[:, h].to(torch.float32), 1.0 / (1.0 - mods["dropout_p"])


def _heads(q, k):
    """(query head, its K/V head) pairs."""
    group = q.shape[2] // k.shape[2]
    return [(h, h // group) for h in range(q.shape[2])]


def emulate_forward(q, k, v, softmax_scale, causal, **mods):
    """(out, lse) as a flash forward computes them: fp32 scores from the 16-bit inputs, fp32
    softmax, P (relative to the row max) rounded to the input dtype for P·V, fp32 accumulation,
    O divided by the fp32 row sum and rounded once. One head at a time to bound memory. Dropout
    (mods dropout_p, dropout_keep): the rounded P zeroed where dropped, O scaled by 1 / (1 - p)."""
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, seqlen_q, device=q.device)
    for h, hk in _heads(q, k):
        s, _ = _scores(q[:, :, h], k[:, :, hk], softmax_scale, causal, mods, h)
        row_max = s.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(s - row_max)
        row_sum = p.sum(-1, keepdim=True)
        keep, rescale = _dropout(mods, h)
        acc = _fp32_matmul(p.to(q.dtype) * keep, v[:, :, hk])
        seen = row_sum > 0
        out[:, :, h] = torch.where(seen, acc / torch.where(seen, row_sum, 1.0) * rescale, 0.0).to(q.dtype)
        lse[:, h] = torch.where(seen, row_max + torch.log(row_sum), float("-inf")).squeeze(-1)
    return out, lse


def emulate_backward(dout, q, k, v, out, lse, softmax_scale, causal, **mods):
    """(dq, dk, dv) as a flash backward computes them: fp32 dP = dO V^T, P recomputed in fp32
    from the scores and LSE, D = rowsum(dO * O) and dS = P * (dP - D) in fp32; dV from P and
    dQ, dK from dS rounded to the input dtype, fp32 accumulation (grouped query heads summed in
    fp32), one rounding at the end. Dropout as the kernels: dS = P (dP Z - D) with Z = keep / (1 - p),
    dV from the kept rounded P, scaled by 1 / (1 - p)."""
    dq = torch.empty_like(q)
    dk32 = torch.zeros(k.shape, device=k.device)
    dv32 = torch.zeros(v.shape, device=v.device)
    delta = (dout.float() * out.float()).sum(-1)  # (B, sq, H)
    for h, hk in _heads(q, k):
        s, capped = _scores(q[:, :, h], k[:, :, hk], softmax_scale, causal, mods, h)
        row_lse = lse[:, h, :, None]
        p = torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, 0.0))
        dp = _fp32_matmul(dout[:, :, h], v[:, :, hk].transpose(-1, -2))
        keep, rescale = _dropout(mods, h)
        ds = p * (dp * keep * rescale - delta[:, :, h, None])
        if capped is not None:
            ds = ds * capped
        dv32[:, :, hk] += _fp32_matmul((p.to(q.dtype) * keep).transpose(-1, -2), dout[:, :, h]) * rescale
        dk32[:, :, hk] += _fp32_matmul(ds.to(q.dtype).transpose(-1, -2), q[:, :, h]) * softmax_scale
        dq[:, :, h] = (_fp32_matmul(ds.to(q.dtype), k[:, :, hk]) * softmax_scale).to(q.dtype)
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)


def reference_grads(dout, q, k, v, softmax_scale, causal, **mods):
    """Gradients in float64, by autograd through the float64 reference."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = reference_attention(q64, k64, v64, softmax_scale=softmax_scale, causal=causal, **mods)
    return torch.autograd.grad(out64, (q64, k64, v64), dout.double())


# --- The yardstick --------------------------------------------------------------------------------


@dataclass
class Verdict:
    """One tensor measured against the yardstick. `worst` is the largest error / allowed error
    over the elements (> 1 fails); `rms_ratio` the RMS error / allowed RMS error (> 1 fails)."""

    name: str
    max_err: float
    emulated_max_err: float
    worst: float
    worst_index: tuple
    rms: float
    emulated_rms: float
    rms_ratio: float

    @property
    def passed(self) -> bool:
        return self.worst <= 1 and self.rms_ratio <= 1

    def __str__(self) -> str:
        return (f"{self.name}: max error {self.max_err:.3e} (emulation {self.emulated_max_err:.3e}), worst "
                f"element at {self.worst_index} {self.worst:.2f}x its bound; RMS error {self.rms:.3e} "
                f"(emulation {self.emulated_rms:.3e}) {self.rms_ratio:.2f}x its bound")


def measure(name, got, emulated, exact, floor) -> Verdict:
    """Errors of `got` and `emulated` against `exact` (float64); rows are the last dimension."""
    exact = exact.double()
    got_err = (got.double() - exact).abs()
    emulated_err = (emulated.double() - exact).abs()
    rows = exact.abs().amax(-1, keepdim=True)
    largest = rows.max().item()
    # A tensor that is zero throughout (a gradient no score reaches) is measured in absolute terms.
    scale = rows.clamp_min(ROW_FLOOR * largest) if largest > 0 else torch.ones_like(rows)
    allowed = MAX_FACTOR * (emulated_err / scale).max() * scale + floor
    ratio = got_err / allowed
    worst = int(ratio.argmax())
    worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    rms, emulated_rms = (e.square().mean().sqrt().item() for e in (got_err, emulated_err))
    return Verdict(
        name=name, max_err=got_err.max().item(), emulated_max_err=emulated_err.max().item(),
        worst=ratio.flatten()[worst].item(), worst_index=worst_index,
        rms=rms, emulated_rms=emulated_rms, rms_ratio=rms / (RMS_FACTOR * emulated_rms + floor),
    )


def assert_fp32_bar(name, got, emulated, exact, tolerance):
    """fp32 results against the bar of FP32_EMULATION_FACTOR's note (`tolerance` row-relative)."""
    assert torch.isfinite(got).all(), f"{name} has NaN or inf (unwritten poison or a real overflow)"
    exact = exact.double()
    err = (got.double() - exact).abs()
    rows = exact.abs().amax(-1, keepdim=True)
    scale = rows.clamp_min(1.0)
    emulated_err = ((emulated.double() - exact).abs() / scale).max()
    ratio = (err / ((tolerance + FP32_EMULATION_FACTOR * emulated_err) * scale)).max().item()
    assert ratio <= 1, f"{name}: max error {err.max().item():.3e}, {ratio:.2f}x the fp32 bar {tolerance:g}"
    return err.max().item()


def assert_within_yardstick(name, got, emulated, exact, floor, fp32_score_error=0.0):
    """`fp32_score_error`: the row-relative error fp32's split-TF32 scores add (see
    assert_backward_accurate); the 16-bit yardstick has it in its emulation."""
    if got.dtype == torch.float32:
        tolerance = FP32_OUT_TOLERANCE if name == "out" else FP32_GRAD_TOLERANCE
        return assert_fp32_bar(name, got, emulated, exact, tolerance + fp32_score_error)
    assert torch.isfinite(got).all(), f"{name} has NaN or inf (unwritten poison or a real overflow)"
    verdict = measure(name, got, emulated, exact, floor)
    assert verdict.passed, str(verdict)
    return verdict


def _abs_score_bound(q, k):
    """(batch, nheads, seqlen_q): max over keys of sum_k |q_k k_k|, in float64."""
    return torch.stack([torch.matmul(q[:, :, h].double().abs(), k[:, :, hk].double().abs().transpose(-1, -2)).amax(-1)
                        for h, hk in _heads(q, k)], dim=1)


def assert_forward_accurate(out, lse, q, k, v, causal, softmax_scale=None, **mods):
    """`out` and `lse` of a forward on q, k, v against the float64 reference, within the yardstick.
    `mods`: window_size, softcap, alibi_slopes, as the reference takes them."""
    scale = default_scale(q.shape[-1], softmax_scale)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=scale, causal=causal, **mods)
    emulated_out, _ = emulate_forward(q, k, v, scale, causal, **mods)
    verdict = assert_within_yardstick("out", out, emulated_out, ref_out, FORWARD_FLOOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly where a row sees no key"
    assert torch.all(torch.isneginf(lse[~finite]))
    if finite.any():
        lse_err = (lse[finite].double() - ref_lse[finite]).abs()
        bound = LSE_TOLERANCE * (1 + ref_lse[finite].abs())
        if q.dtype == torch.float32:
            bound = bound + FP32_DOT_TOLERANCE * scale * _abs_score_bound(q, k)[finite]
        assert (lse_err <= bound).all(), f"lse error {lse_err.max().item():.3e}, up to {(lse_err / bound).max().item():.2f}x its bound"
    return verdict


def assert_backward_accurate(grads, dout, q, k, v, causal, softmax_scale=None, **mods):
    """(dq, dk, dv) for dout against float64 autograd through the reference, within the yardstick
    (the emulation takes its own forward's rounded O and fp32 LSE, as a flash backward takes its forward's)."""
    scale = default_scale(q.shape[-1], softmax_scale)
    exact = reference_grads(dout, q, k, v, scale, causal, **mods)
    out, lse = emulate_forward(q, k, v, scale, causal, **mods)
    emulated = emulate_backward(dout, q, k, v, out, lse, scale, causal, **mods)
    # fp32: the backward's P = exp(S - LSE) moves by the forward's LSE error plus its own score's
    # error, each up to FP32_DOT_TOLERANCE's bound, and every gradient is linear in P (dV) or in
    # dS = P (dP - D). Negligible on randn inputs (~1e-5); at scores of +-1e4 (sum |q_k k_k| = 8e4
    # at d64) it is what split TF32 leaves: dv 1.1-2.1e-3 of its size from the exact (out, lse),
    # whichever family computes the backward (H200, 2026-11-29, perf/results/h200-20261129-run6.md).
    score_error = (2 * FP32_DOT_TOLERANCE * scale * _abs_score_bound(q, k).max().item()
                   if q.dtype == torch.float32 else 0.0)
    return [assert_within_yardstick(name, got, emu, ref, BACKWARD_FLOOR, fp32_score_error=score_error)
            for name, got, emu, ref in zip(("dq", "dk", "dv"), grads, emulated, exact)]


# --- Which kernel family served a call ------------------------------------------------------------

SM90_FORWARD_HEAD_DIMS = (64, 96, 128, 192, 256)
"""Head dims whose fp16/bf16 forward the sm90 kernels serve on an sm_90 GPU (README, dispatch)."""

SM90_BACKWARD_HEAD_DIMS = (64, 96, 128, 192, 256)
"""Head dims whose fp16/bf16 backward the sm90 kernels serve on an sm_90 GPU (dispatch)."""

SM90_FP32_FORWARD_HEAD_DIMS = (64, 128)
"""Head dims of the Hopper fp32 forward (kernels/sm90/fwd_tf32.py); fp32 elsewhere and the fp32
backward run the sm80 kernels."""

SHARED_KERNELS = ("FlashAttnBwdPreprocessSm80",)
"""Kernels both families use (the backward's preprocess): no family's mark."""


def _expected_family(head_dim: int, hopper_head_dims, fp32_hopper_head_dims, dtype=None) -> str:
    if dtype == torch.float32:
        # split TF32 lives in the sm80 kernels, but for the Hopper fp32 forward's head dims with
        # three TF32 products (torch's "highest" fp32 matmul precision)
        if torch.get_float32_matmul_precision() != "highest" or head_dim not in fp32_hopper_head_dims:
            return "sm80"
    forced = os.environ.get("CUTE_FLASH_KERNEL_ARCH")
    if forced:
        return forced
    hopper = torch.cuda.get_device_capability()[0] == 9
    return "sm90" if hopper and head_dim in hopper_head_dims else "sm80"


def expected_backward_family(head_dim: int, dtype=None) -> str:
    return _expected_family(head_dim, SM90_BACKWARD_HEAD_DIMS, (), dtype)


def expected_forward_family(head_dim: int, dtype=None, plain: bool = True) -> str:
    """`plain`: a dense call without score modifications or dropout, the only fp32 calls that the
    Hopper fp32 forward serves."""
    return _expected_family(head_dim, SM90_FORWARD_HEAD_DIMS, SM90_FP32_FORWARD_HEAD_DIMS if plain else (), dtype)


def family_of(key) -> str | None:
    """'sm90' or 'sm80' from a compile key (the kernel's module path or the backward's tag); None
    for a kernel both families share (SHARED_KERNELS)."""
    if any(name in repr(key) for name in SHARED_KERNELS):
        return None
    text = repr(key).lower()
    families = [name for name in ("sm90", "sm80") if name in text]
    return families[0] if len(families) == 1 else f"unknown ({key!r})"


@contextlib.contextmanager
def kernels_used():
    """Collects the compile keys of every kernel looked up inside the block. The API keeps forward
    and backward launchers per problem class, which skip the lookup; they are dropped first so that every call
    inside looks its kernel up (from the memory cache: nothing is compiled twice)."""
    from cute_flash import cache

    real = cache.get_or_compile
    keys = []

    def recording(key, build, arch=None):
        keys.append(key)
        return real(key, build, arch)

    clear_launchers()  # (this imports the API, and with it every module that looks kernels up)
    # Modules that imported the function by name hold their own reference to it.
    holders = [module for name, module in list(sys.modules.items())
               if name.split(".")[0] == "cute_flash" and getattr(module, "get_or_compile", None) is real]
    for module in holders:
        module.get_or_compile = recording
    try:
        yield keys
    finally:
        for module in holders:
            module.get_or_compile = real


def families_of(keys) -> set:
    return {family_of(key) for key in keys} - {None}


def assert_served_by(keys, family: str):
    assert keys, "no kernel lookup recorded: clear_launchers() in tests/gpu/common.py misses a memo"
    families = families_of(keys)
    assert families == {family}, f"expected the {family} kernels, the call used {sorted(families)}: {keys}"


def force_kernel_family(monkeypatch, sm80: bool) -> None:
    """The sm80 kernels forced for the test (CUTE_FLASH_KERNEL_ARCH=sm80), or the GPU's own family."""
    if sm80:
        monkeypatch.setenv("CUTE_FLASH_KERNEL_ARCH", "sm80")
    else:
        monkeypatch.delenv("CUTE_FLASH_KERNEL_ARCH", raising=False)


@contextlib.contextmanager
def served_by(family: str):
    """Asserts that the calls inside the block ran kernels of `family` ('sm90' or 'sm80') only."""
    with kernels_used() as keys:
        yield
    assert_served_by(keys, family)


def run_forward(q, k, v, causal, **kwargs):
    """One forward into NaN-poisoned outputs, on the kernel family dispatch promises."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    with served_by(expected_forward_family(q.shape[-1], q.dtype)):
        ret_out, ret_lse = cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal, **kwargs)
    assert ret_out is out and ret_lse is lse
    return out, lse


def run_backward(q, k, v, dout, causal, deterministic=False, softmax_scale=None):
    """Forward, then backward into NaN-poisoned gradients, each on the family dispatch promises."""
    with served_by(expected_forward_family(q.shape[-1], q.dtype)):
        out, lse = cute_flash.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    with served_by(expected_backward_family(q.shape[-1], q.dtype)):
        dq, dk, dv = cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                         softmax_scale=softmax_scale, causal=causal, deterministic=deterministic)
    assert dq is grads[0] and dk is grads[1] and dv is grads[2]
    return dq, dk, dv


# --- Internal names (kept here so that a change of module layout touches one file) ----------------


def clear_launchers():
    """Forget the API's per-process forward and backward launchers (cute_flash/api.py, varlen.py)."""
    from cute_flash import api, varlen

    for memo in (api._forward_kernels, api._backward_kernels, varlen._forward_kernels, varlen._backward_kernels):
        memo.clear()


@contextlib.contextmanager
def backward_determinism_flags():
    """The `deterministic` argument of every backward that autograd runs inside the block
    (cute_flash/autograd.py reaches the kernels through api.backward)."""
    from cute_flash import api

    real = api.backward
    flags = []

    def recording(*args, **kwargs):
        flags.append(kwargs.get("deterministic", False))
        return real(*args, **kwargs)

    api.backward = recording
    try:
        yield flags
    finally:
        api.backward = real


def sm90_forward_config(dtype, head_dim: int, causal: bool, length: str):
    """The Hopper forward's configuration that dispatch picks on this GPU (kernels/sm90/config.py)."""
    from cute_flash import dispatch

    return dispatch.plan_forward(torch.cuda.get_device_capability(), dtype, head_dim, causal, length).config


def sm90_walk_plan(seqlen_q: int, seqlen_k: int, num_heads_batch: int, config) -> list[int]:
    from cute_flash.kernels.sm90.tile_scheduler import plan_walk

    return plan_walk(seqlen_q, seqlen_k, num_heads_batch, config.tile_m, config.tile_n, config.num_sms)


def sm90_walk_plan_is_empty(plan) -> bool:
    """Whether a planned short causal walk (tile_scheduler.plan_walk) leaves the end unplanned."""
    from cute_flash.kernels.sm90.tile_scheduler import NO_UNIT

    return plan[0] == NO_UNIT


def record_sm90_tail_plans(monkeypatch) -> list:
    """(tail tiles, pieces) of each tail plan the sm90 launcher makes from now on (None: no split)."""
    from cute_flash import launchers

    plans, planner = [], launchers.tail_plan

    def recorded_plan(*args):
        plan = planner(*args)
        plans.append(None if plan is None else (plan.tiles, len(plan.units)))
        return plan

    monkeypatch.setattr(launchers, "tail_plan", recorded_plan)
    return plans


def clear_sm90_tail_plans():
    from cute_flash import launchers

    launchers._tail_plan.cache_clear()


def assert_counters_at_zero():
    """Every counter of the sm90 forward (kept per device, stream and tail plan, in front of the
    plan's words) is back at zero after the calls (kernels/sm90/tile_scheduler.py: TailPlan)."""
    from cute_flash import device, launchers
    from cute_flash.kernels.sm90.tile_scheduler import TailPlan

    for _, counters in launchers._counters.values():
        assert int(counters[:TailPlan.plan_offset(device.sm_count())].abs().sum()) == 0


# --- The head-dim sweep ---------------------------------------------------------------------------

SWEEP_HEAD_DIMS = tuple(range(8, 257, 8))


def sweep_causal(head_dim: int) -> bool:
    """One masking per head dim of the sweep, alternating (odd multiples of 8 causal), so that the
    sweep compiles one forward and one backward variant per (dtype, head dim)."""
    return head_dim % 16 == 8


def warm_in_parallel(compile_job, jobs) -> None:
    """`python -m tests.gpu.<module> --warm`: compile_job(job) for every job (a module-level function,
    pickled to spawned processes), one process per CPU, then the count and the time taken."""
    import multiprocessing
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    with ProcessPoolExecutor(os.cpu_count() or 2, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(compile_job, jobs))
    print(f"warm: {len(done)} jobs in {time.time() - start:.0f} s")
