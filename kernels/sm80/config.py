"""The sm80 kernels' compile-time configurations: one frozen object per compiled kernel.

Dispatch (cute_flash/dispatch.py) builds them from the kernels' pure tile rules
(`FlashAttnFwdSm80.default_tiles`, `FlashAttnBwdSm80.default_tiles`), and a configuration is its
plan's compile-cache key. The backward's preprocess and postprocess kernels take only what
changes their code, so one of them serves every causal and deterministic variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass


@dataclass(frozen=True)
class Sm80FwdConfig:
    dtype: type[cutlass.Numeric]
    head_dim: int
    causal: bool
    tile_m: int = 128  # query rows per CTA
    tile_n: int = 64  # keys per K/V block
    num_warps: int = 4  # stacked along M
    num_stages: int = 2  # K/V buffers
    # Score modifications (kernels/common/mask.py), compile-time switches; their values (window
    # sides, cap, slopes) are runtime arguments of the kernel's `call_with_mods` entry point.
    window: bool = False  # sliding window; causal is False then (a causal window has right = 0)
    softcap: bool = False
    alibi: bool = False
    # Dropout of the probabilities (kernels/common/philox.py); its Philox seed and offset, keep
    # threshold and 1 / (1 - p) are runtime arguments of `call_with_mods` too.
    dropout: bool = False
    # Packed variable-length batches: q, k, v (1, total tokens, heads, head_dim), sequences at the
    # offsets of cu_seqlens (int32, read on the device); the kernel's `call_varlen` entry point.
    varlen: bool = False

    @property
    def has_mods(self) -> bool:
        return self.window or self.softcap or self.alibi or self.dropout


@dataclass(frozen=True)
class Sm80BwdConfig:
    dtype: type[cutlass.Numeric]
    head_dim: int
    causal: bool
    deterministic: bool = False  # dQ accumulated in a fixed order (a semaphore per query block)
    m_block_size: int = 64  # query rows per inner step
    n_block_size: int = 128  # keys per CTA
    num_stages_Q: int = 2
    num_stages_dO: int = 1
    atom_m_sdp: int = 2  # warp layouts of the S/dP, dK/dV and dQ GEMMs
    atom_n_dkv: int = 4
    atom_m_dq: int = 4
    p_in_registers: bool = False  # dS from the fp32 P kept in registers, not the 16-bit P in smem
    dq_chunks: int = 1  # dQ computed in this many column chunks of head_dim
    window: bool = False  # as Sm80FwdConfig
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False  # the same mask as the forward's, regenerated
    varlen: bool = False  # as Sm80FwdConfig; the workspaces are packed (layouts.packed_stat_offset)

    @property
    def has_mods(self) -> bool:
        return self.window or self.softcap or self.alibi or self.dropout


@dataclass(frozen=True)
class Sm80BwdPreConfig:
    dtype: type[cutlass.Numeric]
    head_dim: int
    varlen: bool = False


@dataclass(frozen=True)
class Sm80BwdPostConfig:
    dtype: type[cutlass.Numeric]
    head_dim: int
    m_block_size: int
    atom_m_dq: int
    dq_chunks: int = 1
    varlen: bool = False


@dataclass(frozen=True)
class Sm80BwdGroupSumConfig:
    """The grouped-query backward's per-group sum of dK and dV (kernels/sm80/bwd_group_sum.py)."""

    dtype: type[cutlass.Numeric]
    head_dim: int


@dataclass(frozen=True)
class Sm80DecodeConfig:
    """The decode kernel (kernels/sm80/decode.py): attention of a few query rows per sequence on a
    KV cache, the query heads of one KV head packed into one tile, the keys split across CTAs."""

    dtype: type[cutlass.Numeric]
    head_dim: int
    causal: bool
    page_size: int = 0  # keys per cache page; 0: a contiguous cache (batch, max_len, kv heads, hd)
    tile_m: int = 64  # packed query rows (query position x query head of the group) per CTA
    tile_n: int = 64  # keys per K/V block
    num_warps: int = 4  # stacked along M
    num_stages: int = 2  # K/V buffers


@dataclass(frozen=True)
class Sm80DecodeCombineConfig:
    """The split-KV merge (kernels/sm80/decode_combine.py)."""

    dtype: type[cutlass.Numeric]
    head_dim: int
