"""The sm80 kernels' compile-time configurations: one frozen object per compiled kernel.

Dispatch (cute_flash/dispatch.py) builds them from the kernels' pure tile rules
(`FlashAttnFwdSm80.default_tiles`, and `bwd_default_tiles` below for the backward's main kernel,
with the shared-memory budget of each compile target), and a configuration is its
plan's compile-cache key. The backward's preprocess and postprocess kernels take only what
changes their code, so one of them serves every causal and deterministic variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass

from cute_flash.kernels.common.blocks import BlockRanges
from cute_flash.kernels.common.layouts import round_up

# Opt-in shared memory per CTA: the sm80 kernels' budget (A100, sm_80 / sm_87), the sm_86 / sm_89
# GPUs' (RTX 30 / 40, A10, L4, L40), and the H100's for the sm80 kernels it runs compiled for sm_90a.
SMEM_CAPACITY_SM80 = 163 * 1024
SMEM_CAPACITY_SM86 = 99 * 1024
SMEM_CAPACITY_SM90 = 227 * 1024  # the H100's larger opt-in smem


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
    # fp32 only: TF32 products per pair of operands (kernels/common/tf32.py): 3 (split TF32,
    # fp32-grade) or 1 (plain TF32: torch.get_float32_matmul_precision() "high" / "medium")
    tf32_products: int = 3
    # fp32 only: each key block's P V summed apart from O and added into it by fp32 adds
    # (tf32.gemm_split_tf32's fresh_sum): the tensor cores' truncating accumulation otherwise biases
    # O by the number of MMAs into it (as the Hopper fp32 forward's block_accumulator).
    block_accumulator: bool = False

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
    tf32_products: int = 3  # as Sm80FwdConfig

    @property
    def has_mods(self) -> bool:
        return self.window or self.softcap or self.alibi or self.dropout

    @property
    def shortest_walk_first(self) -> bool:
        return BlockRanges.dq_turns_descend(self.deterministic, self.causal, self.window)


# The backward main kernel's tile rules (kernels/sm80/bwd.py: FlashAttnBwdSm80), pure host code
# that dispatch turns into an Sm80BwdConfig. The H100 runs that kernel too, compiled for sm_90a.

# Threads of the main kernel's CTA, and of the postprocess's: the dQ workspace's order depends on it
# (kernels/sm80/bwd.py: dq_accum_offset).
BWD_NUM_THREADS = 256


def targets_sm90(arch: str) -> bool:
    """Whether a compile target is the H100's (sm_90 / sm_90a), which runs the sm80 backward too."""
    return arch.startswith("sm_90")


def smem_capacity(arch: str) -> int:
    """Opt-in shared memory per CTA on a compile target."""
    if targets_sm90(arch):
        return SMEM_CAPACITY_SM90
    return SMEM_CAPACITY_SM86 if arch in ("sm_86", "sm_89") else SMEM_CAPACITY_SM80


# Smaller backward blocks, largest first, for targets whose shared memory holds no stage option of
# the default ones (sm_86 / sm_89): (m_block_size, n_block_size).
BWD_SMALLER_BLOCKS = ((64, 128), (64, 64), (64, 32), (32, 32))


def bwd_default_tiles(dtype, head_dim: int, causal: bool, arch: str = "sm_80", gqa: bool = False,
                      dropout: bool = False) -> dict | None:
    """FlashAttention-2's sm80 choices: (m, n) = (128, 128) up to d = 64, (64, 128) up to 128,
    (64, 64) above; warp layouts that keep every warp's sub-tile 16-column aligned; a second
    dO buffer wherever it fits in the target's shared memory (smem_capacity) and registers.
    `arch` is the compile target: ptxas allocates registers differently for sm_90a (the H100
    runs the kernel too), which lets d = 128 and 256 keep the fp32 P."""
    if dtype is cutlass.Float32:
        return _bwd_fp32_tiles(head_dim, arch)
    d = round_up(head_dim, 32)
    if d <= 64:
        tiles = dict(m_block_size=128, n_block_size=128, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4)
    elif d <= 128:
        tiles = dict(m_block_size=64, n_block_size=128, atom_m_sdp=2, atom_n_dkv=4,
                     atom_m_dq=2 if d % 64 == 0 else 4)
    else:
        wide = d % 64 == 0
        tiles = dict(m_block_size=64, n_block_size=64, atom_m_sdp=4, atom_n_dkv=2 if wide else 4,
                     atom_m_dq=2 if wide else 4)
    # The fp32 P kept across the dP GEMM fits the registers except, compiled for sm_80, at
    # d = 128 and 256, whose tiles already sit at 255 registers (8-84 bytes of spill there, by
    # dtype).
    # Measured on the H100 against P read back from smem (2026-11-24, interleaved): d32
    # +4-10%, d64 +4-11%, d96 +1-5%, d192 +1-2%; dS is also more precise (fp32 P).
    # For sm_90a, d = 128 and 256 keep the fp32 P without spills too: fp16 as they are, bf16
    # d = 128 once dQ's GEMM splits rows over four warps (two spill 8 bytes). Measured on the
    # H100 against the read-back (2026-11-24, interleaved, through autograd, 1k-16k): d128
    # bf16 non-causal +3.0 to +3.8%, causal +1.1 to +1.8% (four warps alone lose 1.3-2.5%),
    # fp16 +1.2 to +2.0% (with four warps: -0.3 to -2.1%); d256 bf16 +0.8 to +1.1%, fp16 +0.1
    # to +1.5%. sm_80 keeps the read-back there: unmeasured (no A100 at hand).
    h100 = targets_sm90(arch)
    tiles["p_in_registers"] = h100 or d not in (128, 256)
    tiles["dq_chunks"] = 1
    if h100 and d == 128 and dtype is cutlass.BFloat16:
        tiles["atom_m_dq"] = 4
    if h100 and d == 256:
        # The H100's 227 KB hold a second Q buffer (FA2's choice there), which the registers
        # allow once dQ is computed 64 columns at a time over four warps' rows; grouped-query
        # attention's fp32 dK/dV stores then leave no room for the fp32 P. Measured against one
        # Q buffer (2026-11-24, interleaved, through autograd): non-causal bf16 +7.6 to +8.9%,
        # fp16 +8.6 to +9.2%, causal +1.2 to +5.4%; 2-3% more than two Q buffers with spills.
        tiles.update(dq_chunks=4, atom_m_dq=4, p_in_registers=not gqa)
    # At (64, 128), and at d = 256 on the H100, a second dO buffer costs the registers that
    # keep the kernel free of spills; at d <= 64 without causal masking one dO buffer measured
    # 1-2% faster on the H100.
    if 64 < d <= 128 or (d <= 64 and not causal) or (h100 and d == 256):
        stage_options = ((2, 1), (1, 1))
    else:
        stage_options = ((2, 2), (2, 1), (1, 1))
    if dropout:
        # The Philox rounds need registers the plain tiles use up: at most 64 query rows; at
        # d = 128 and 256 dS's P comes back from smem on sm_90a too (the fp32 P spilled 24
        # bytes there), with 64 keys (d = 128 on sm_80: 32 bytes of spill with softcap at 128).
        tiles["m_block_size"] = min(tiles["m_block_size"], 64)
        if d in (128, 256):
            tiles.update(p_in_registers=False, n_block_size=64)
    return _fit_stages(dtype, head_dim, tiles, stage_options, arch)


def _fit_stages(dtype, head_dim: int, tiles: dict, stage_options, arch: str) -> dict | None:
    """The first stage option whose shared memory fits the target; where none does, the largest of
    BWD_SMALLER_BLOCKS (with warp layouts that suit it) that fits with one of them; None where
    nothing fits (large head dims on sm_86 / sm_89). On sm_80 and sm_90 the default blocks fit."""
    def fitting(t):
        for stages_Q, stages_dO in stage_options:
            t = dict(t, num_stages_Q=stages_Q, num_stages_dO=stages_dO)
            if bwd_smem_bytes(dtype, head_dim, **t) <= smem_capacity(arch):
                return t
        return None

    found = fitting(tiles)
    if found is not None:
        return found
    for m, n in BWD_SMALLER_BLOCKS:
        if m * n >= tiles["m_block_size"] * tiles["n_block_size"]:
            continue
        for atoms in ((2, 4, 2), (4, 2, 2), (2, 4, 4), (4, 2, 4), (2, 2, 2), (4, 4, 4), (1, 4, 1), (2, 1, 2)):
            t = dict(tiles, m_block_size=m, n_block_size=n, atom_m_sdp=atoms[0], atom_n_dkv=atoms[1],
                     atom_m_dq=atoms[2], num_stages_Q=1, num_stages_dO=1)
            if _warp_layouts_suit(dtype, round_up(head_dim, 32), t):
                found = fitting(t)
                if found is not None:
                    return found
    return None


def _bwd_fp32_tiles(head_dim: int, arch: str) -> dict | None:
    """fp32 operands take twice the smem of 16-bit ones: 64 x 64 blocks up to d = 128 (160 KB
    with one Q and one dO buffer there), 32 x 32 above (64 x 32 on the H100's 227 KB); warp
    layouts whose sub-tiles are whole m16 x n8 TF32 atoms."""
    d = round_up(head_dim, 32)
    if d <= 128:
        tiles = dict(m_block_size=64, n_block_size=64, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4)
    elif targets_sm90(arch):
        tiles = dict(m_block_size=64, n_block_size=32, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=4)
    else:
        tiles = dict(m_block_size=32, n_block_size=32, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2)
    tiles.update(p_in_registers=True, dq_chunks=1)
    return _fit_stages(cutlass.Float32, head_dim, tiles, ((2, 2), (2, 1), (1, 1)), arch)


def bwd_smem_bytes(dtype, head_dim, m_block_size, n_block_size, num_stages_Q, num_stages_dO, **_) -> int:
    """The main kernel's shared storage: Q and dO in their buffers, K and V, P and dS, and each
    buffer's row statistics (LSE or D, 128 fp32 slots); the launch adds up to 1023 bytes of
    alignment."""
    d = round_up(head_dim, 32)
    elems = (m_block_size * d * (num_stages_Q + num_stages_dO) + 2 * n_block_size * d
             + 2 * m_block_size * n_block_size)
    return elems * dtype.width // 8 + 4 * 128 * (num_stages_Q + num_stages_dO)


def bwd_can_implement(dtype, head_dim: int, causal: bool, arch: str = "sm_80", **tiles) -> bool:
    """Whether the tiles (by default the target's) suit the main kernel's warp layouts and fit
    the target's shared memory."""
    if dtype not in (cutlass.Float16, cutlass.BFloat16, cutlass.Float32) or head_dim % 8 != 0 or head_dim > 256:
        return False
    t = tiles or bwd_default_tiles(dtype, head_dim, causal, arch)
    if t is None:
        return False
    d = round_up(head_dim, 32)
    return _warp_layouts_suit(dtype, d, t) and bwd_smem_bytes(dtype, head_dim, **t) <= smem_capacity(arch)


def _warp_layouts_suit(dtype, d: int, t: dict) -> bool:
    """Each GEMM's warp layout tiles its block in whole MMA atoms (padded head dim d)."""
    warps = BWD_NUM_THREADS // 32
    n_unit = 8 if dtype is cutlass.Float32 else 16  # N extent of one warp's atom (tiled_mma_sm80)
    return (
        t["m_block_size"] % (16 * t["atom_m_sdp"]) == 0
        and t["n_block_size"] % (n_unit * warps // t["atom_m_sdp"]) == 0
        and t["n_block_size"] % (16 * t["atom_n_dkv"]) == 0
        and d % (n_unit * warps // t["atom_n_dkv"]) == 0
        and t["m_block_size"] % (16 * t["atom_m_dq"]) == 0
        and d % t.get("dq_chunks", 1) == 0
        and d // t.get("dq_chunks", 1) % (n_unit * warps // t["atom_m_dq"]) == 0
    )


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
    num_warps: int = 4  # stacked along M, or side by side along the keys (warps_along_keys)
    num_stages: int = 2  # K/V buffers
    # each warp takes tile_n / num_warps keys of every block for all tile_m (16) rows, with its own
    # softmax state; the warps' states merge in shared memory at the end
    warps_along_keys: bool = False
    window: bool = False  # score modifications, as Sm80FwdConfig's (values at call time: call_with_mods)
    softcap: bool = False
    alibi: bool = False
    leftpad: bool = False  # each sequence's keys start at its cache_leftpad position
    tf32_products: int = 3  # fp32 caches: as Sm80FwdConfig
    # programmatic dependent launch (sm_90 on): the grid may be scheduled before the kernel ahead of
    # it in the stream has flushed, and waits for it (griddepcontrol.wait) before touching memory
    dependent_launch: bool = False


@dataclass(frozen=True)
class Sm80DecodeCombineConfig:
    """The split-KV merge (kernels/sm80/decode_combine.py)."""

    dtype: type[cutlass.Numeric]
    head_dim: int
    max_splits: int  # the most splits a call may take (validate.MAX_SPLITS)
    num_warps: int = 8  # per CTA (dispatch.decode_merge_shape)
    rows_per_cta: int = 1  # 1: all warps on one row, each walking every num_warps-th split; num_warps: a warp per row
    dependent_launch: bool = False  # as Sm80DecodeConfig's: launched while the decode kernel's CTAs drain
