"""GPUs older than sm_80 (V100, T4, ...): the CuTe DSL cannot target them, so the PyTorch entry points
run torch's `scaled_dot_product_attention` there instead, memory-efficient backend first, and say
so once per GPU. `forward` and `backward` (the kernels) raise `CudaError` there.
"""

from __future__ import annotations

import warnings

import torch

from . import device as devices
from .validate import MIN_CAPABILITY, check_kernel_dtype, check_qkv

FLASH_ATTN_FUNC_FALLBACK = (
    "flash_attn_func runs torch's scaled_dot_product_attention instead (memory-efficient backend; math where "
    "that cannot run, e.g. bf16, or for a deterministic backward), without lse (return_lse, return_attn_probs) "
    "and at torch's speed and memory")
SDPA_FALLBACK = ("scaled_dot_product_attention keeps torch's own backends there (memory-efficient first): "
                 "cute-flash's kernels do not run")

_warned: set[tuple[str, str]] = set()


# torch.compile calls it while tracing and keeps the answer: a device's capability never changes.
@torch.compiler.assume_constant_result
def older_gpu(device: torch.device) -> str | None:
    """'<name> (sm_XY)' when `device` is a GPU older than sm_80, else None."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    capability = devices.capability(index)
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    return f"{torch.cuda.get_device_name(index)} (sm_{capability[0]}{capability[1]})"


def warn_once(gpu: str, consequence: str) -> None:
    if (gpu, consequence) in _warned:
        return
    _warned.add((gpu, consequence))
    warnings.warn(f"cute-flash: {gpu} is older than sm_80, which the CuTe DSL cannot target; {consequence}",
                  RuntimeWarning, stacklevel=3)


def warn_if_current_gpu_is_older(consequence: str) -> None:
    if torch.cuda.is_available():
        gpu = older_gpu(torch.device("cuda", torch.cuda.current_device()))
        if gpu is not None:
            warn_once(gpu, consequence)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
              deterministic: bool, gpu: str) -> torch.Tensor:
    """`out` of attention on (batch, seqlen, nheads, headdim) tensors, with cute-flash's input rules
    and semantics (grouped-query heads, bottom-right causal alignment, zero rows that see no key),
    computed by torch's SDPA; differentiable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    problem = check_qkv(q, k, v)
    check_kernel_dtype(problem.dtype)
    warn_once(gpu, FLASH_ATTN_FUNC_FALLBACK)
    group = problem.nheads // problem.nheads_kv
    query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    # With more queries than keys, the first seqlen_q - seqlen_k rows see no key under causal
    # masking: they are zeros here, as the kernels give, and never reach SDPA (whose kernels may
    # give NaN there, forward and backward).
    unseen = max(problem.seqlen_q - problem.seqlen_k, 0) if causal else 0
    query = query[:, :, unseen:]
    seen = problem.seqlen_q - unseen
    mask = causal_lower_right(seen, problem.seqlen_k) if causal and seen != problem.seqlen_k else None
    # torch's efficient backward adds with atomics: only the math backend's is deterministic.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    backends = [SDPBackend.MATH] if deterministic else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal and mask is None, scale=softmax_scale)
    if unseen:
        out = torch.cat([out.new_zeros(problem.batch, problem.nheads, unseen, problem.head_dim), out], dim=2)
    return out.transpose(1, 2)
