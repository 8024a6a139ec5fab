"""Which kernels serve a call: device → kernel family → kernel class and configuration → plan.

Every pass is planned here the same way: `plan_forward` and `plan_backward` are pure functions of
(compute capability, dtype, head dim, causal, length class or backward flags) that return plans;
a plan's `key` is the compile cache's key (the kernel class and its configuration, never sizes
or the scale), `build()` makes the kernel object and its compile-time arguments, and
`cute_flash/launchers.py` turns compiled plans into per-call launches. The sm80 kernels serve
sm_80/86/89 and every newer GPU without a specialized kernel; on sm_90 the Hopper forward takes the
problems its configuration covers. `CUTE_FLASH_KERNEL_ARCH=sm80` forces the sm80 family
(device.kernel_family).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import cutlass
import torch

from . import cache
from .device import capability_of, kernel_family, sm_count, target_arch_for
from .errors import UnsupportedDtypeError, UnsupportedHeadDimError
from .validate import MAX_SPLITS, check_kernel_dtype
from .tensors import (
    fake_block_table, fake_bshd, fake_dq_accum, fake_dropout_args, fake_int32_vector, fake_keys_major, fake_rowstat,
    fake_score_mods, fake_semaphore, fake_stream, fake_tail_split_workspace,
)

CUTLASS_DTYPES = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}


def cutlass_dtype(dtype: torch.dtype):
    check_kernel_dtype(dtype)
    return CUTLASS_DTYPES[dtype]


@dataclass(frozen=True)
class Plan:
    """One kernel to compile: its class, its compile-time configuration (a frozen dataclass:
    kernels/sm90/config.py, kernels/sm80/config.py) and its fake arguments."""

    kernel_cls: type
    config: Any
    fake_args: tuple
    arch: str
    # What else the compiled code depends on, beyond the configuration (an argument's dtype).
    signature: tuple = ()
    # The kernel's jit entry point other than `__call__` (the score modifications' `call_with_mods`).
    entry: str | None = None

    @property
    def key(self) -> tuple:
        return (self.kernel_cls.__module__, self.kernel_cls.__qualname__, self.config) + self.signature

    @property
    def family(self) -> str:
        return self.kernel_cls.__module__.split(".")[-2]  # cute_flash.kernels.<family>.<pass>

    def settings(self) -> dict:
        """The configuration as a dict of its fields."""
        return {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}

    def build(self):
        kernel = self.kernel_cls(self.config)
        return (kernel if self.entry is None else getattr(kernel, self.entry)), self.fake_args

    def compiled(self):
        return cache.get_or_compile(self.key, self.build, self.arch)


# Length classes, the only way lengths reach a compile key: the Hopper forward picks other launch
# settings per class (kernels/sm90/config.py). "short_512": at most SHORT_512_SEQLEN_K keys;
# "short": at most SHORT_SEQLEN_K; "short_2k": at most SHORT_2K_SEQLEN_K; "mid": causal, at most
# MID_SEQLEN_K_CAUSAL; the rest "long". Classes that resolve to the same settings share a kernel.
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


# "short" before "short_512": most head dims compile the same kernel for both, named by the first.
LENGTH_CLASSES = ("short", "short_512", "short_2k", "mid", "long")


def length_classes(causal: bool) -> tuple[str, ...]:
    """The classes length_class returns for causal (or non-causal) problems."""
    return LENGTH_CLASSES if causal else tuple(name for name in LENGTH_CLASSES if name != "mid")


def fake_forward_args(cdtype, head_dim: int, takes_split_workspace: bool) -> tuple:
    """The compile-time arguments of a forward kernel's `__call__`."""
    qkvo_lse = tuple(fake_bshd(cdtype, head_dim) for _ in range(4)) + (fake_rowstat(),)
    if takes_split_workspace:  # + the tail split's workspace and plan
        return qkvo_lse + fake_tail_split_workspace(head_dim) + (
            cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(1), fake_stream())
    return qkvo_lse + (cutlass.Float32(1.0), fake_stream())


NO_MODS = (False, False, False)
"""(sliding window, softcap, ALiBi) switched off: validate.ScoreMods.flags of a plain call."""


def plan_forward(capability: tuple[int, int], dtype: torch.dtype, head_dim: int, causal: bool,
                 length: str = "long", num_sms: int | None = None, family: str | None = None,
                 mods: tuple[bool, bool, bool] = NO_MODS, varlen: bool = False, dropout: bool = False,
                 tf32_products: int = 3) -> Plan:
    """The forward kernel for this GPU and problem class. Lengths matter only through `length`
    (length_class); persistent kernels are sized to `num_sms` (default: the current GPU's).
    `family` picks a kernel family other than the GPU's own (device.kernel_family), e.g. "sm80".
    `mods` (window, softcap, ALiBi: validate.ScoreMods.flags) go to the `call_with_mods` entry
    point of the family's forward (the Hopper forward's where it serves the dtype and head dim).
    `varlen` (packed sequences at cu_seqlens offsets) goes to the family's `call_varlen` entry
    point, with or without `mods` (their values None where off). `dropout`
    (dropout_p > 0: kernels/common/philox.py) goes to the same `call_with_mods` entry points,
    dense batches only. `tf32_products` (fp32: tf32_products_for) to the fp32 kernels: on sm_90 the
    Hopper split-TF32 forward serves fp32 with three products at head dims 64 and 128 (dense, no
    score modifications or dropout: _plan_forward_tf32), the sm80 family's kernels the rest."""
    cdtype = cutlass_dtype(dtype)
    arch = target_arch_for(capability)
    _check_dropout(dropout, varlen)
    _check_tf32_products(dtype, tf32_products)
    if (family or kernel_family(capability)) == "sm90":
        from .kernels.sm90.config import forward_config
        from .kernels.sm90.fwd import FlashAttnFwdSm90

        if dtype == torch.float32:
            plan = _plan_forward_tf32(head_dim, causal, arch, mods, varlen, dropout, tf32_products)
            if plan is not None:
                return plan

        config = forward_config(cdtype, head_dim, causal, length, sm_count() if num_sms is None else num_sms,
                                **_mod_fields(causal, mods, dropout), **({"varlen": True} if varlen else {}))
        if config is not None:
            args = fake_forward_args(cdtype, head_dim, True)
            if varlen:  # the workspace, then cu_seqlens_q, cu_seqlens_k, max_seqlen_q and the scale
                return Plan(FlashAttnFwdSm90, config, args[:8] + (fake_int32_vector(), fake_int32_vector(),
                            cutlass.Int32(1), cutlass.Float32(1.0)) + fake_score_mods(*mods) + args[-1:], arch,
                            entry="call_varlen")
            if mods == NO_MODS and not dropout:
                return Plan(FlashAttnFwdSm90, config, args, arch)
            return Plan(FlashAttnFwdSm90, config, args[:-1] + fake_score_mods(*mods) + fake_dropout_args(dropout)
                        + args[-1:], arch, entry="call_with_mods")
    from .kernels.sm80.config import Sm80FwdConfig
    from .kernels.sm80.fwd import FlashAttnFwdSm80

    tiles = FlashAttnFwdSm80.default_tiles(cdtype, head_dim, causal, dropout, arch, tf32_products)
    if not FlashAttnFwdSm80.can_implement(cdtype, head_dim, causal, **tiles, arch=arch):
        raise UnsupportedDtypeError(f"no forward kernel implements dtype={dtype}, head_dim={head_dim}, causal={causal}")
    config = Sm80FwdConfig(cdtype, head_dim, causal, **tiles, **_mod_fields(causal, mods, dropout), varlen=varlen,
                           tf32_products=tf32_products)
    args = fake_forward_args(cdtype, head_dim, False)
    if varlen:  # + cu_seqlens_q, cu_seqlens_k, max_seqlen_q before the scale
        args = args[:5] + (fake_int32_vector(), fake_int32_vector(), cutlass.Int32(1)) + args[5:-1] + \
            fake_score_mods(*mods) + args[-1:]
        return Plan(FlashAttnFwdSm80, config, args, arch, entry="call_varlen")
    if mods == NO_MODS and not dropout:
        return Plan(FlashAttnFwdSm80, config, args, arch)
    return Plan(FlashAttnFwdSm80, config, args[:-1] + fake_score_mods(*mods) + fake_dropout_args(dropout) + args[-1:],
                arch, entry="call_with_mods")


def fake_tf32_forward_args(head_dim: int) -> tuple:
    """The compile-time arguments of the Hopper fp32 forward's `__call__`: q, k, v, out, lse, then
    its workspace K_lo, V^T, V^T_lo (kernels/sm90/fwd_tf32_prep.py), the scale and the stream."""
    f32 = cutlass.Float32
    return (tuple(fake_bshd(f32, head_dim) for _ in range(4)) + (fake_rowstat(), fake_bshd(f32, head_dim),
            fake_keys_major(f32, head_dim), fake_keys_major(f32, head_dim), f32(1.0), fake_stream()))


def _plan_forward_tf32(head_dim: int, causal: bool, arch: str, mods, varlen: bool, dropout: bool,
                       tf32_products: int) -> Plan | None:
    """The Hopper split-TF32 forward (kernels/sm90/fwd_tf32.py) for fp32 with three TF32 products,
    dense batches without score modifications or dropout, at the head dims it implements; None
    where the sm80 family's fp32 kernels serve the call."""
    from .kernels.sm90.config import tf32_forward_config
    from .kernels.sm90.fwd_tf32 import FlashAttnFwdSm90Tf32

    if tf32_products != 3 or mods != NO_MODS or varlen or dropout:
        return None
    config = tf32_forward_config(head_dim, causal)
    if config is None:
        return None
    return Plan(FlashAttnFwdSm90Tf32, config, fake_tf32_forward_args(head_dim), arch)


def _check_dropout(dropout: bool, varlen: bool) -> None:
    if dropout and varlen:
        raise ValueError("dropout has no packed variable-length kernels (validate rejects dropout_p > 0 there)")


def tf32_products_for(dtype: torch.dtype) -> int:
    """TF32 products per operand pair of an fp32 call, from torch's own fp32 matmul setting
    (torch.set_float32_matmul_precision): "highest" (torch's default) -> 3, split TF32 with
    fp32-grade accuracy; "high" / "medium", which let torch's fp32 matmuls use TF32 -> 1, plain
    TF32. 16-bit inputs: 3 (the field is unused there)."""
    if dtype != torch.float32:
        return 3
    return 3 if torch.get_float32_matmul_precision() == "highest" else 1


def _check_tf32_products(dtype: torch.dtype, tf32_products: int) -> None:
    if tf32_products not in (1, 3) or (tf32_products == 1 and dtype != torch.float32):
        raise ValueError(f"tf32_products is 3, or 1 for fp32 inputs; got {tf32_products} for {dtype}")


def _mod_fields(causal: bool, mods: tuple[bool, bool, bool], dropout: bool = False) -> dict:
    window, softcap, alibi = mods
    if window and causal:
        raise ValueError("a causal window comes as window right = 0 with causal=False (validate.score_mods)")
    fields = dict(window=window, softcap=softcap, alibi=alibi) if mods != NO_MODS else {}
    return dict(fields, dropout=True) if dropout else fields


@dataclass(frozen=True)
class BackwardPlan:
    """The three kernels of one backward: D = rowsum(dO * O) and LSE in log2 (preprocess), dK, dV
    and dQ's fp32 partial sums (main), dQ in the input dtype (postprocess)."""

    pre: Plan
    main: Plan
    post: Plan
    gqa: bool  # the main kernel writes per-query-head fp32 dK / dV, summed per group by the launcher
    deterministic: bool

    @property
    def m_block_size(self) -> int:
        return self.main.settings()["m_block_size"]


def _backward_main_args(cdtype, head_dim: int, dkv_dtype, stat_align: int = 4) -> tuple:
    """The compile-time arguments of a backward main kernel's `__call__` (both families share them:
    q, k, v, dout, LSE·log2(e), D, dQ's fp32 sums, dk, dv, dQ semaphores, scale, stream)."""
    return (
        fake_bshd(cdtype, head_dim), fake_bshd(cdtype, head_dim), fake_bshd(cdtype, head_dim),
        fake_bshd(cdtype, head_dim), fake_rowstat(align=stat_align), fake_rowstat(align=stat_align),
        fake_dq_accum(), fake_bshd(dkv_dtype, head_dim), fake_bshd(dkv_dtype, head_dim), fake_semaphore(),
        cutlass.Float32(1.0), fake_stream(),
    )


def plan_backward(capability: tuple[int, int], dtype: torch.dtype, head_dim: int, causal: bool,
                  deterministic: bool = False, gqa: bool = False, family: str | None = None,
                  mods: tuple[bool, bool, bool] = NO_MODS, varlen: bool = False, dropout: bool = False,
                  tf32_products: int = 3) -> BackwardPlan:
    """The backward kernels for this GPU: on sm_90 the Hopper backward where its configuration
    covers the head dim (it sums GQA groups itself), else the sm80 family's (compiled for the GPU's
    own target, whose register allocation the tiles depend on), whose main kernel writes
    per-query-head fp32 dK / dV under GQA that the launcher sums per group. Both share the sm80
    preprocess. `family`, `mods` and `varlen` as for plan_forward (the Hopper backward takes a
    window, softcap and ALiBi through its `call_with_mods` and a packed batch through the main
    kernel's and its postprocess's `call_varlen`; the sm80 family serves every `mods` and
    `varlen`: its three kernels' `call_varlen` entry points; `dropout` its main kernel's
    `call_with_mods`, dense batches only). `tf32_products` as for plan_forward."""
    from .kernels.sm80.bwd import FlashAttnBwdSm80
    from .kernels.sm80.config import Sm80BwdConfig, Sm80BwdPostConfig, Sm80BwdPreConfig, bwd_default_tiles
    from .kernels.sm80.bwd_post import FlashAttnBwdPostprocessSm80
    from .kernels.sm80.bwd_pre import FlashAttnBwdPreprocessSm80

    cdtype = cutlass_dtype(dtype)
    arch = target_arch_for(capability)
    _check_dropout(dropout, varlen)
    _check_tf32_products(dtype, tf32_products)
    pre_args = (fake_bshd(cdtype, head_dim), fake_bshd(cdtype, head_dim), fake_rowstat(), fake_rowstat(),
                fake_rowstat(), fake_dq_accum(), fake_stream())
    post_args = (fake_dq_accum(), fake_bshd(cdtype, head_dim), cutlass.Float32(1.0), fake_stream())
    if varlen:  # + cu_seqlens_q and max_seqlen_q before the stream
        pre_args = pre_args[:-1] + (fake_int32_vector(), cutlass.Int32(1)) + pre_args[-1:]
    pre = Plan(FlashAttnBwdPreprocessSm80, Sm80BwdPreConfig(cdtype, head_dim, varlen), pre_args, arch,
               entry="call_varlen" if varlen else None)
    if (family or kernel_family(capability)) == "sm90":
        from .kernels.sm90.bwd import FlashAttnBwdSm90
        from .kernels.sm90.bwd_post import FlashAttnBwdPostprocessSm90
        from .kernels.sm90.config import Sm90BwdPostConfig, backward_config

        _mod_fields(causal, mods)  # a causal window is refused here as for the forward
        config = backward_config(cdtype, head_dim, causal, deterministic, *mods, varlen=varlen, dropout=dropout)
        if config is not None:
            # The row statistics are the launcher's padded buffers, which the Hopper kernel reads by TMA.
            main_args = _backward_main_args(cdtype, head_dim, cdtype, stat_align=16)
            post_config = Sm90BwdPostConfig(cdtype, head_dim, config.m_block_size, varlen)
            if varlen:  # as the sm80 kernels' call_varlen below
                main = Plan(FlashAttnBwdSm90, config, main_args[:10] + (
                    fake_int32_vector(), fake_int32_vector(), cutlass.Int32(1)) + main_args[10:-1]
                    + fake_score_mods(*mods) + main_args[-1:], arch, entry="call_varlen")
                post = Plan(FlashAttnBwdPostprocessSm90, post_config,
                            post_args[:2] + (fake_int32_vector(), cutlass.Int32(1)) + post_args[2:], arch,
                            entry="call_varlen")
            else:
                main = Plan(FlashAttnBwdSm90, config, main_args, arch)
                if mods != NO_MODS or dropout:
                    main = Plan(FlashAttnBwdSm90, config, main_args[:-1] + fake_score_mods(*mods)
                                + fake_dropout_args(dropout) + main_args[-1:], arch, entry="call_with_mods")
                post = Plan(FlashAttnBwdPostprocessSm90, post_config, post_args, arch)
            return BackwardPlan(pre=pre, main=main, post=post, gqa=False, deterministic=deterministic)
    tiles = bwd_default_tiles(cdtype, head_dim, causal, arch, gqa, dropout)
    if tiles is None:
        from .kernels.sm80.config import smem_capacity

        raise UnsupportedHeadDimError(
            f"the backward at head dim {head_dim} ({dtype}) needs more shared memory per CTA than the "
            f"{smem_capacity(arch) // 1024} KB of a {arch} GPU; there it takes head dims up to "
            f"{192 if dtype != torch.float32 else 160}")
    dkv_dtype = cutlass.Float32 if gqa else cdtype
    main_args = _backward_main_args(cdtype, head_dim, dkv_dtype)
    entry = post_entry = None
    if varlen:  # + cu_seqlens_q, cu_seqlens_k, max_seqlen_k before the scale; every mod's value or None
        main_args = main_args[:10] + (fake_int32_vector(), fake_int32_vector(), cutlass.Int32(1)) + \
            main_args[10:-1] + fake_score_mods(*mods) + main_args[-1:]
        post_args = post_args[:2] + (fake_int32_vector(), cutlass.Int32(1)) + post_args[2:]
        entry = post_entry = "call_varlen"
    elif mods != NO_MODS or dropout:
        main_args = main_args[:-1] + fake_score_mods(*mods) + fake_dropout_args(dropout) + main_args[-1:]
        entry = "call_with_mods"
    config = Sm80BwdConfig(cdtype, head_dim, causal, deterministic, **tiles, **_mod_fields(causal, mods, dropout),
                           varlen=varlen, tf32_products=tf32_products)
    return BackwardPlan(
        pre=pre,
        main=Plan(FlashAttnBwdSm80, config, main_args, arch, signature=(("dkv_dtype", dkv_dtype),), entry=entry),
        post=Plan(FlashAttnBwdPostprocessSm80,
                  Sm80BwdPostConfig(cdtype, head_dim, tiles["m_block_size"], tiles["atom_m_dq"], tiles["dq_chunks"],
                                    varlen),
                  post_args, arch, entry=post_entry),
        gqa=gqa, deterministic=deterministic,
    )


def plan_group_sum(capability: tuple[int, int], dtype: torch.dtype, head_dim: int) -> Plan:
    """The grouped-query backward's per-group sum of the main kernel's fp32 per-query-head dK / dV
    into the caller's dK / dV (kernels/sm80/bwd_group_sum.py). The C library (cute_flash/export.py)
    runs it; the Python launcher sums with torch instead (launchers.py)."""
    from .kernels.sm80.bwd_group_sum import FlashAttnBwdGroupSumSm80
    from .kernels.sm80.config import Sm80BwdGroupSumConfig

    cdtype = cutlass_dtype(dtype)
    args = (fake_bshd(cutlass.Float32, head_dim), fake_bshd(cutlass.Float32, head_dim), fake_bshd(cdtype, head_dim),
            fake_bshd(cdtype, head_dim), fake_stream())
    return Plan(FlashAttnBwdGroupSumSm80, Sm80BwdGroupSumConfig(cdtype, head_dim), args, target_arch_for(capability))


@dataclass(frozen=True)
class DecodePlan:
    """The kernels of one flash_attn_with_kvcache call: the decode kernel and, when the keys are
    split across CTAs, the merge of the splits."""

    main: Plan
    combines: dict[tuple[int, int], Plan]  # the split merge per (warps, rows per CTA): decode_merge_shape

    @property
    def tile_m(self) -> int:
        return self.main.config.tile_m

    @property
    def tile_n(self) -> int:
        return self.main.config.tile_n

    @property
    def ctas_per_sm(self) -> int:
        """Decode CTAs per SM in the wave decode_splits counts in: one deep CTA,
        DECODE_KEYS_TILE_CTAS_PER_SM of DECODE_KEYS_TILE's on DECODE_KEYS_TILE_THREE_CAPABILITIES,
        else DECODE_CTAS_PER_SM."""
        if self.main.config.num_stages == DECODE_DEEP_STAGES:
            return 1
        three = capability_of(self.main.arch) in DECODE_KEYS_TILE_THREE_CAPABILITIES
        if self.main.config.warps_along_keys and three:
            return DECODE_KEYS_TILE_CTAS_PER_SM
        return DECODE_CTAS_PER_SM


def plan_decode(capability: tuple[int, int], dtype: torch.dtype, head_dim: int, causal: bool,
                page_size: int = 0, mods: tuple[bool, bool, bool] = NO_MODS, leftpad: bool = False,
                deep: bool = False, narrow: bool = False, warps_along_keys: bool = False,
                tf32_products: int = 3) -> DecodePlan:
    """The decode kernels (kernels/sm80/decode.py, decode_combine.py): one family for every GPU
    from sm_80 on, since decoding is bound by memory bandwidth, which mma.sync and cp.async reach on
    Hopper too. `page_size` 0 is a contiguous cache; a paged cache compiles per page size. `mods`
    (window, softcap, ALiBi) go to the main kernel's `call_with_mods`; `leftpad`: cache_leftpad given;
    `deep` (`decode_is_deep`): DECODE_DEEP_STAGES K/V buffers where they fit, one CTA per SM;
    `narrow` (`decode_is_narrow`): DECODE_NARROW_TILE's rows and warps; `warps_along_keys`
    (`decode_warps_along_keys`): DECODE_KEYS_TILE, 16 rows with the warps side by side along the keys."""
    from .kernels.sm80.config import Sm80DecodeCombineConfig, Sm80DecodeConfig
    from .kernels.sm80.decode import FlashDecodeSm80
    from .kernels.sm80.decode_combine import FlashDecodeCombineSm80

    _check_tf32_products(dtype, tf32_products)
    cdtype = cutlass_dtype(dtype)
    arch = target_arch_for(capability)
    tiles = FlashDecodeSm80.default_tiles(head_dim, fp32=cdtype is cutlass.Float32)
    if deep and capability in DECODE_DEEP_CAPABILITIES and FlashDecodeSm80.can_implement(
            cdtype, head_dim, causal, page_size, **dict(tiles, num_stages=DECODE_DEEP_STAGES)):
        tiles["num_stages"] = DECODE_DEEP_STAGES
    if narrow and FlashDecodeSm80.can_implement(cdtype, head_dim, causal, page_size,
                                                **dict(tiles, **DECODE_NARROW_TILE)):
        tiles.update(DECODE_NARROW_TILE)
    if warps_along_keys and FlashDecodeSm80.can_implement(cdtype, head_dim, causal, page_size,
                                                          **dict(tiles, **DECODE_KEYS_TILE)):
        tiles.update(DECODE_KEYS_TILE)
    if not FlashDecodeSm80.can_implement(cdtype, head_dim, causal, page_size, **tiles):
        raise UnsupportedDtypeError(
            f"no decode kernel implements dtype={dtype}, head_dim={head_dim}, causal={causal}, page size {page_size}")
    fp32_bshd = fake_bshd(cutlass.Float32, head_dim)
    main_args = (fake_bshd(cdtype, head_dim), fake_bshd(cdtype, head_dim), fake_bshd(cdtype, head_dim),
                 fake_bshd(cdtype, head_dim), fake_rowstat(), fp32_bshd, fake_rowstat(), fake_int32_vector(),
                 fake_int32_vector(), fake_block_table(), fake_int32_vector() if leftpad else None, cutlass.Int32(0),
                 cutlass.Float32(1.0), cutlass.Int32(1), fake_stream())
    entry = None
    if mods != NO_MODS:
        main_args, entry = main_args[:-1] + fake_score_mods(*mods) + main_args[-1:], "call_with_mods"
    window, softcap, alibi = mods
    dependent_launch = capability >= DEPENDENT_LAUNCH_CAPABILITY
    combine_args = (fake_bshd(cutlass.Float32, head_dim), fake_rowstat(), fake_bshd(cdtype, head_dim), fake_rowstat(),
                    cutlass.Int32(2), fake_stream())
    return DecodePlan(
        main=Plan(FlashDecodeSm80, Sm80DecodeConfig(cdtype, head_dim, causal, page_size, **tiles, window=window,
                                                    softcap=softcap, alibi=alibi, leftpad=leftpad,
                                                    tf32_products=tf32_products, dependent_launch=dependent_launch),
                  main_args, arch, entry=entry),
        combines={shape: Plan(FlashDecodeCombineSm80, Sm80DecodeCombineConfig(
            cdtype, head_dim, MAX_SPLITS, num_warps=shape[0], rows_per_cta=shape[1], dependent_launch=dependent_launch),
            combine_args, arch) for shape in DECODE_MERGE_SHAPES},
    )


DECODE_CTAS_PER_SM = 2
"""Decode CTAs resident per SM (80 KB of shared memory each at head dim 128): one wave is this
many CTAs on every SM. The 32-row narrow tile (72 KB) fits three, but filling the third slot with
more splits measured 1.5–7% slower (H200, 2026-11-29: batch 8 and 1 at 32:8 and 8:1 heads; the
splits' CTAs get shorter and the merge longer)."""

DECODE_KEYS_TILE_THREE_CAPABILITIES = ((9, 0),)
"""GPUs whose 228 KB of shared memory per SM hold three DECODE_KEYS_TILE CTAs (an A100's 164 KB
holds two)."""

DECODE_KEYS_TILE_CTAS_PER_SM = 3
"""DECODE_KEYS_TILE's CTAs per SM on DECODE_KEYS_TILE_THREE_CAPABILITIES: 69 KB of shared memory
and at most 168 registers per thread (a compile test holds both), so three are resident. Counting
its wave as three per SM splits batch 64 at 32:8 heads (512 tiles, 1.3 waves) 3 ways instead of
none: +2.4%, +5.7%, +8.6% at 4k, 8k, 32k keys (H200, 2026-11-29; 0.96–0.99x cuDNN from 0.92–0.94x)."""

DECODE_SPLIT_MAX_WAVES = 4
"""A grid of this many waves of CTAs or more is not split: its last, partial wave is a small part
of the call, and splits add their pieces' traffic and the merge. Batch 256 at 32:8 heads (2,048
tiles of 16 rows, 5.2 waves) split 4 ways measured 4% slower than unsplit (H200, 2026-11-29)."""

DEPENDENT_LAUNCH_CAPABILITY = (9, 0)
"""From here on (griddepcontrol is sm_90 PTX) the decode kernel and its merge are launched as
programmatic dependents (Sm80DecodeConfig.dependent_launch): each grid is scheduled as the CTAs of
the kernel ahead of it exit, so a decode step's two launches and the step before it no longer wait
one launch latency apiece."""

DECODE_DEEP_STAGES = 4
"""K/V buffers of a deep decode CTA (144 KB at head dim 128: one CTA per SM). Measured against 2
stages in the same call, contiguous cache, hd 128, one token: +32% (H100, a0f80ad) and +23% (H200,
04daba6) at batch 1, 128k keys, 8:1 heads, where each of 256 CTAs reads 8 key blocks and waits on
filling a 2-deep pipeline; a tie at batch 1, 32k keys, 8:1 (1.01) and batch 8, 4k keys, 8:1 (1.02);
-13 to -27% wherever the calls have 8 or more row tiles of real work (batch 8 at 8:1, 32:8 heads)."""

DECODE_DEEP_CAPABILITIES = ((8, 0), (9, 0))
"""GPUs with the 163 KB (or more) of shared memory per CTA a deep CTA needs (sm_86 / sm_89 have 99)."""


def decode_is_deep(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, head_dim: int) -> bool:
    """Whether a decode call takes the deep CTA: when the whole call is one row tile (batch 1, one KV
    head, its query rows in one tile), only the splits spread it over the GPU, and each CTA's
    pipeline fill is what it waits on. With more row tiles the 2-stage CTAs, two per SM, won
    (DECODE_DEEP_STAGES)."""
    return batch * nheads_kv * -(-_packed_rows(nheads, nheads_kv, seqlen_q) // _decode_tile_rows(head_dim)) == 1


def _packed_rows(nheads: int, nheads_kv: int, seqlen_q: int) -> int:
    """A (sequence, KV head)'s packed query rows: each query position times its group of heads."""
    return seqlen_q * (nheads // nheads_kv)


@lru_cache(maxsize=None)
def _decode_tile_rows(head_dim: int) -> int:
    """The decode kernel's default packed rows per tile (once per head dim: calls ask per step)."""
    from .kernels.sm80.decode import FlashDecodeSm80

    return FlashDecodeSm80.default_tiles(head_dim)["tile_m"]


DECODE_NARROW_TILE = dict(tile_m=32, num_warps=2)
"""The decode CTA's rows and warps where a tile of 64 rows (4 warps) would be mostly padding: each
warp's m16 MMAs run over 16 packed rows whether real or not, and at 4 real rows per token (32:8
heads) the MMAs of a 64-row tile, not the reads, bound the CTA. Measured against 64 rows in the
same call (H200, hd 128, one token, contiguous): +4 to +14% with 8 or 64 row tiles (batch 8 / 64
at 8:1, batch 1 / 8 at 32:8); -7% with 512 (batch 64 at 32:8, where 4-warp CTAs fill the SMs
without splits) and -5% on the deep one-tile call."""


def decode_is_narrow(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, num_sms: int) -> bool:
    """Whether a decode call takes DECODE_NARROW_TILE: each (sequence, KV head)'s packed rows fit
    one narrow tile (more tiles would read its keys once each), and the call's tiles number more
    than one (one is decode_is_deep's) and fewer than the SMs."""
    rows = _packed_rows(nheads, nheads_kv, seqlen_q)
    return rows <= DECODE_NARROW_TILE["tile_m"] and 1 < batch * nheads_kv < num_sms


DECODE_KEYS_TILE = dict(tile_m=16, num_warps=4, warps_along_keys=True)
"""16 packed rows per CTA, its 4 warps side by side along the keys (each a 16-key slice of every
block, its own softmax state, merged in shared memory after the loop): a quarter of a 64-row
tile's MMAs for the same reads, with 4 warps still issuing them."""


def decode_warps_along_keys(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, head_dim: int,
                            num_sms: int) -> bool:
    """Whether a decode call takes DECODE_KEYS_TILE: each (sequence, KV head)'s packed rows fit 16
    (one token of a group up to 16, or a few of a smaller one), head dims 64 and 128 (the merge's
    scratch fits sK's stages), and either its row tiles fill the SMs without splits or the call is
    one row tile (then on the deep CTA's stages too). Calls of 2 to SMs - 1 tiles take
    DECODE_NARROW_TILE, which tied this shape there. Measured against the shape each replaced (H200,
    hd 128, one token, contiguous, CUDA graphs, same call): one tile (batch 1, 8:1 heads) +8% at 32k
    keys and +24% at 128k over the deep 64-row CTA; 2,048 tiles +11% and 512 tiles 0.96 to 1.0x
    (a tie) over the 64-row tile."""
    rows = _packed_rows(nheads, nheads_kv, seqlen_q)
    tiles = batch * nheads_kv
    return rows <= DECODE_KEYS_TILE["tile_m"] and head_dim in (64, 128) and (tiles >= num_sms or tiles == 1)


@lru_cache(maxsize=4096)
def decode_cta_shape(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, head_dim: int,
                     num_sms: int) -> tuple[bool, bool, bool]:
    """plan_decode's (deep, narrow, warps_along_keys) for a call's shape, once per shape (a decode
    step asks every call)."""
    shape = (batch, nheads, nheads_kv, seqlen_q)
    return (decode_is_deep(*shape, head_dim), decode_is_narrow(*shape, num_sms),
            decode_warps_along_keys(*shape, head_dim, num_sms))


DECODE_MERGE = (8, 1)
"""The split merge's CTA as (warps, query rows): 8 warps on one row."""
DECODE_WIDE_MERGE = (16, 1)
"""16 warps on one row: a few rows split many ways."""
DECODE_ROWS_MERGE = (8, 8)
"""8 rows on a warp each: many rows split a few ways."""
DECODE_MERGE_SHAPES = (DECODE_MERGE, DECODE_WIDE_MERGE, DECODE_ROWS_MERGE)


def decode_merge_shape(rows: int, num_splits: int) -> tuple[int, int]:
    """The split merge's CTA for `rows` query rows (batch x tokens x query heads) split `num_splits`
    ways. A few rows split many ways wait on their CTAs' walks, which more warps shorten; many rows
    split a few ways would leave most warps of a CTA per row idle, and crowd the SMs with such CTAs.
    Merge kernel time on the H200, hd 128, all three shapes in one run (2026-11-29, 1d16e73; 8 warps
    on a row / 16 on a row / a warp per row, µs): 8 rows split 128 ways 5.2 / 4.0 / 15.5; 8 and 64
    rows split 16 ways 2.1 / 2.2 / 3.3 and 2.4 / 2.4 / 3.9; 512 rows split 4 ways 2.8 / 4.0 / 2.4;
    1,024 rows split 8 and 16 ways 4.4 / 6.7 / 3.4 and 4.7 / 7.2 / 4.5; 2,048 rows split 4 ways
    6.8 / 11.4 / 2.9; 4,096 rows split 4 ways 11.9 / 21.1 / 3.8 (the call 56 → 48 µs)."""
    if rows < 32 and num_splits >= 64:
        return DECODE_WIDE_MERGE
    if rows >= 512 and num_splits <= 16:
        return DECODE_ROWS_MERGE
    return DECODE_MERGE


DECODE_MIN_SPLIT_BLOCKS = 2
"""A split reads at least this many key blocks, so the merge stays small next to the reads. Short
calls are latency-bound, and more, shorter splits win there: against 4 blocks (H200, 2026-11-29,
graph step, one token, hd 128) batch 1 2k 8:1 7.85 → 6.87 µs, 4k 8:1 8.19 → 7.36 (cuDNN 7.46),
8k 8:1 9.53 → 8.97, batch 1 4k 32:8 11.04 → 10.75, batch 8 4k 8:1 11.24 → 10.90; one block per
split was faster still at 4k 8:1 (7.16) but slower at 32:8 (13.4: two waves)."""

DECODE_SPLIT_COST_BLOCKS = 1
"""What a CTA costs beyond its key blocks (loading Q, writing its piece), in key-block reads."""


@lru_cache(maxsize=4096)
def decode_splits(batch: int, nheads_kv: int, m_blocks: int, max_keys: int, tile_n: int, num_sms: int,
                  ctas_per_sm: int = DECODE_CTAS_PER_SM) -> int:
    """num_splits=0: how many splits along the keys a decode call takes. One CTA per (packed row
    block, batch, KV head, split); the call's time is taken as its waves of `ctas_per_sm` CTAs
    per SM (DecodePlan.ctas_per_sm) times one CTA's key blocks (plus DECODE_SPLIT_COST_BLOCKS), and
    the fewest splits with the least time win; a grid of DECODE_SPLIT_MAX_WAVES waves or more takes
    one. 64 CTAs on 132 SMs split 4 ways fill one wave, where 5 ways (the smallest split count
    reaching a wave) would run a second wave for 56 CTAs. Splits keep at least
    DECODE_MIN_SPLIT_BLOCKS key blocks and number at most validate.MAX_SPLITS. `max_keys` is the
    longest sequence the call may see (host-known: the cache's capacity, or the given length)."""
    blocks = -(-max_keys // tile_n)
    most = max(1, min(blocks // DECODE_MIN_SPLIT_BLOCKS, MAX_SPLITS))
    ctas, wave = batch * nheads_kv * m_blocks, ctas_per_sm * num_sms
    if ctas >= DECODE_SPLIT_MAX_WAVES * wave:
        return 1
    return _fastest_split(ctas, blocks, wave, most)


def _fastest_split(ctas: int, blocks: int, wave: int, most: int) -> int:
    def time(splits: int) -> int:
        return -(-ctas * splits // wave) * (-(-blocks // splits) + DECODE_SPLIT_COST_BLOCKS)

    return min(range(1, most + 1), key=lambda splits: (time(splits), splits))
