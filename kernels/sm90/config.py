"""The Hopper forward's compile-time configuration: one frozen object per compiled kernel.

`forward_config(dtype, head_dim, causal, length, num_sms)` is the only place that decides how a
problem class is launched: tiles, stages, the tile schedule, the softmax form and the epilogue. It
is a pure function, and its result is the dispatch plan's (and the compile cache's) key, so classes
that resolve to the same settings share one compiled kernel. Why each setting is where it is, with
the measurements, is in docs/kernels/sm90-forward.md (section "Settings per problem class").

`Sm90FwdConfig.create(...)` resolves settings that depend on each other (e.g. a dynamic schedule
only for persistent CTAs, Q by warp group only where each group can release its rows), so two
requests that mean the same kernel compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass

from cute_flash.kernels.common.blocks import BlockRanges

SMEM_BYTES = 227 * 1024
HEAD_DIMS = (64, 96, 128, 192, 256)


class ConsumerWarpGroups:
    """The thread counts of a forward with one producer warp group and tile_m / 64 consumer
    (MMA) warp groups of 64 rows each."""

    @property
    def num_wg_mma(self) -> int:
        return self.tile_m // 64

    @property
    def num_mma_threads(self) -> int:
        return 128 * self.num_wg_mma

    @property
    def num_threads(self) -> int:
        return 128 + self.num_mma_threads  # one producer warp group


@dataclass(frozen=True)
class Sm90FwdConfig(ConsumerWarpGroups):
    dtype: type[cutlass.Numeric]
    head_dim: int
    causal: bool
    tile_m: int = 128  # rows of O per tile: 64 per consumer warp group
    tile_n: int = 128  # keys per K/V block
    num_stages: int = 2  # K/V blocks in flight
    q_stages: int = 1  # Q buffers: with two, the next tile's Q loads while this one runs
    # Persistent CTAs: a grid of at most num_sms CTAs walks the tiles; 0 is one CTA per tile.
    num_sms: int = 0
    # Causal tile order: "l2" longest first within groups of heads whose K/V fit in L2, "head"
    # longest first within each head; "none" (non-causal) launch order.
    tile_order: str = "none"
    # Persistent CTAs take their next unit from a global counter as they finish (tile_scheduler.py).
    dynamic_schedule: bool = False
    # The last rounds of a static per-head causal walk come from a host plan (plan_walk).
    planned_tail: bool = False
    # Softmax forms (kernels/common/softmax.py): exponentiate against the running max first and
    # settle the rare rows that outgrew it (stale_max), or rescale O only when a row's max grew
    # past 2^8 (lazy_rescale); otherwise every block rescales O by its row factors.
    stale_max: bool = False
    lazy_rescale: bool = False
    # Static walk: the producer warms L2 with the next tile's Q and first K/V block.
    prefetch_next: bool = False
    # Each consumer warp group stores its own 64 rows of O (16-byte stores from smem, or one TMA
    # box per group with wg_tma_store) and goes on to its next tile.
    wg_epilogue: bool = False
    wg_tma_store: bool = False
    # Q in one piece per consumer warp group, each released by its own group.
    q_by_group: bool = False
    # O from the accumulator straight to global memory (where O has no smem buffer of its own),
    # releasing Q after the last S GEMM (release_q_early) or after the mainloop.
    o_from_registers: bool = False
    release_q_early: bool = False
    # The epilogue's coordinates derived anew per tile, not kept live through the mainloop.
    recompute_epilogue: bool = False
    # Pipeline waits as plain try_wait loops instead of the DSL's suspending wait.
    spin_waits: bool = True
    # L2 eviction priorities on the TMA copies: Q and O evict-first, K and V evict-last.
    cache_hints: bool = False
    # Score modifications (kernels/common/mask.py), their values given at run time through
    # `call_with_mods`: a sliding window (only the key blocks some row of a tile sees are loaded,
    # only those crossing its edges masked; a causal window comes as right = 0 with causal off),
    # softcap, ALiBi. Off, the kernel is the plain one instruction for instruction.
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    # Dropout on P after its row sums (kernels/common/philox.py), its seed, offset and p at run time.
    dropout: bool = False
    # Packed variable-length batches (`call_varlen`): each tile's sequence bounds come from
    # cu_seqlens on the device, and O leaves from registers, clipped at the sequence's last row
    # (a TMA box would run into the next sequence's rows).
    varlen: bool = False

    @staticmethod
    def create(dtype, head_dim: int, causal: bool, *, num_sms: int = 0, dynamic_schedule: bool = False,
               planned_tail: bool = False, stale_max: bool = False, lazy_rescale: bool = False,
               prefetch_next: bool = False, recompute_epilogue: bool = False, o_from_registers: bool = False,
               release_q_early: bool = True, wg_epilogue: bool = False, wg_tma_store: bool = False,
               q_by_group: bool = False, tile_order: str = "none", **settings) -> "Sm90FwdConfig":
        """The configuration with its interdependent settings resolved (see the field comments)."""
        varlen = settings.get("varlen", False)
        if varlen:
            # The walk covers every sequence's tiles at the longest one's count; no host plan knows
            # their lengths, and the row-clipped register epilogue is the one that suits them.
            planned_tail, prefetch_next, wg_epilogue, o_from_registers = False, False, False, True
            tile_order = "head" if tile_order != "none" else tile_order
        plain = Sm90FwdConfig(dtype, head_dim, causal, num_sms=num_sms, wg_epilogue=wg_epilogue, **settings)
        assert can_implement(plain), plain
        persistent = num_sms > 0
        dynamic_schedule = persistent and dynamic_schedule
        tile_order = tile_order if causal else "none"
        o_from_registers = o_from_registers and (varlen or not plain.separate_o)
        return replace(
            plain,
            tile_order=tile_order,
            dynamic_schedule=dynamic_schedule,
            planned_tail=planned_tail and causal and tile_order == "head" and persistent and not dynamic_schedule,
            stale_max=stale_max,
            lazy_rescale=lazy_rescale or stale_max,
            prefetch_next=prefetch_next and persistent and not dynamic_schedule,
            recompute_epilogue=recompute_epilogue and persistent,
            o_from_registers=o_from_registers,
            # With its own O buffer Q is released after the mainloop anyway (a second release would
            # run the pipeline out of step).
            release_q_early=release_q_early and o_from_registers and not plain.separate_o,
            wg_tma_store=wg_tma_store and wg_epilogue and not o_from_registers,
            q_by_group=q_by_group and (wg_epilogue or plain.separate_o or o_from_registers),
        )

    # Derived, never set: what the settings above imply for the kernel's shape (and
    # ConsumerWarpGroups' thread counts).

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread: 64K per SM over the four or five groups."""
        return {2: (24, 240), 3: (32, 160)}[self.num_wg_mma]

    @property
    def splits_tail(self) -> bool:
        """Persistent non-causal kernels split their last round (causal tiles run longest first,
        so their last round is short anyway). Not with a window: the tail plan cuts every tile's
        keys from block 0 to the last, where a window's tiles span runs of their own. Nor packed
        batches: the host does not know their tiles."""
        return self.num_sms > 0 and not self.causal and not self.window and not self.varlen

    @property
    def separate_o(self) -> bool:
        """O has its own smem buffer (else it passes through Q's)."""
        return smem_bytes(self) + self.tile_m * self.head_dim * self.dtype.width // 8 <= SMEM_BYTES

    @property
    def q_pieces(self) -> int:
        return self.num_wg_mma if self.q_by_group else 1

    @property
    def q_piece_rows(self) -> int:
        return self.tile_m // self.q_pieces

    @property
    def merge_batch(self) -> int:
        """Chunks of the tail merge whose loads go out together: 20 registers each."""
        return 8 if self.num_wg_mma == 2 else 4


def smem_bytes(config: Sm90FwdConfig) -> int:
    """Q's buffers (O reuses one when it has none of its own), the K/V ring, alignment and barriers."""
    elem = config.dtype.width // 8
    q = config.q_stages * config.tile_m * config.head_dim * elem
    kv = 2 * config.num_stages * config.tile_n * config.head_dim * elem
    return q + kv + 1024


def wg_epilogue_fits(head_dim: int) -> bool:
    """A warp group's 128 threads store whole rows of O, 8 elements (16 bytes) each: d64, d128,
    d256, not d96 or d192."""
    return 128 % (head_dim // 8) == 0


def can_implement(config: Sm90FwdConfig) -> bool:
    if config.dtype not in (cutlass.Float16, cutlass.BFloat16) or config.head_dim not in HEAD_DIMS:
        return False
    if config.tile_m not in (128, 192) or config.tile_n % 16 != 0 or not 16 <= config.tile_n <= 256:
        return False
    if config.num_stages < 1 or config.q_stages < 1:
        return False
    if config.window and config.causal:  # a causal window is a window with right = 0
        return False
    if config.varlen and config.dropout:
        return False
    if config.wg_epilogue and not wg_epilogue_fits(config.head_dim):
        return False
    # Accumulator registers per consumer thread: S (tile_n/2) + P (tile_n/4) + O (head_dim/2).
    # A coarse filter only: the compile test checks that the chosen tiles do not spill.
    if config.tile_n // 2 + config.tile_n // 4 + config.head_dim // 2 > (200 if config.tile_m == 128 else 128):
        return False
    smem = smem_bytes(config)
    if config.q_stages > 1:  # O then needs its own buffer
        smem += config.tile_m * config.head_dim * config.dtype.width // 8
    return smem <= SMEM_BYTES


def forward_config(dtype, head_dim: int, causal: bool, length: str, num_sms: int, **mods) -> Sm90FwdConfig | None:
    """The kernel for a problem class (cute_flash/dispatch.py: length_class), None where this
    family has none (the sm80 kernels serve it). docs/kernels/sm90-forward.md gives each rule's
    measurements. `mods`: window / softcap / alibi switches, on the class's own settings (a
    window is non-causal, so its tiles walk in launch order and no tail is split)."""
    if head_dim not in HEAD_DIMS or dtype not in (cutlass.Float16, cutlass.BFloat16):
        return None
    if mods.get("dropout") and (head_dim > 128 or mods.get("alibi")):
        # the Philox rounds spill 48-96 bytes in four hd 192 / 256 classes, and 16-196 with ALiBi
        # in six classes at hd 64-128 (2026-11-28 compile reports): the sm80 forward serves those
        return None
    settings = _tiles(head_dim, causal) | _length_settings(dtype, head_dim, causal, length, num_sms)
    masked = causal or mods.get("window")
    if settings["tile_m"] == 192 and ((mods.get("alibi") and causal) or (mods.get("dropout") and masked)
                                      or (mods.get("softcap") and head_dim <= 64)):
        # Three consumer warp groups leave 128 registers per thread: causal ALiBi (hd 96, 128),
        # dropout with a causal mask or a window (hd 64, 128) and softcap at hd 64 spill there
        # (32-192 bytes, 2026-11-28 compile reports); two groups of 128-row tiles do not.
        settings.update(tile_m=128, tile_n=128)
    if mods.get("alibi") and causal and head_dim > 192 and length == "mid":
        settings["wg_epilogue"] = False  # with per-group O stores it spills 24 bytes (2026-11-28)
    if mods.get("alibi") and settings.get("stale_max"):
        # ALiBi's bias raises a row's max by slope * tile_n per key block on the way to the
        # diagonal: against a stale max the exponentials overflow every few blocks and each time
        # the block is rescored on CUDA cores (non-causal hd 64 at 8k: 48 TFLOP/s against 612
        # without ALiBi, H200, 2026-11-28). The lazy rescale keeps the max current.
        settings["stale_max"] = False
    return Sm90FwdConfig.create(dtype, head_dim, causal, **settings, **mods)


def _tiles(head_dim: int, causal: bool) -> dict:
    """Every class's starting point: d64 on three consumer warp groups of 64 x 128, d128 with a
    third K/V stage, d192 / d256 on narrower K/V blocks."""
    if head_dim <= 64:
        tiles = dict(tile_m=192, tile_n=128, num_stages=2)
    elif head_dim <= 96:
        tiles = dict(tile_m=128, tile_n=128, num_stages=2)
    elif head_dim <= 128:
        tiles = dict(tile_m=128, tile_n=128, num_stages=3)
    elif head_dim <= 192:
        tiles = dict(tile_m=128, tile_n=112, num_stages=2)
    else:
        tiles = dict(tile_m=128, tile_n=80, num_stages=2)
    if causal:
        tiles["tile_order"] = "l2"
    return tiles


def _length_settings(dtype, head_dim: int, causal: bool, length: str, num_sms: int) -> dict:
    """What a length class changes from _tiles ("short_512" up to 512 keys, "short" up to 1024,
    "short_2k" up to 2048, "mid" causal up to 4096, "long")."""
    up_to_512 = length == "short_512"
    up_to_1k = up_to_512 or length == "short"
    short = up_to_1k or length == "short_2k"
    three_groups_d96 = dict(tile_m=192, tile_n=96) if 64 < head_dim <= 96 and not up_to_1k else {}
    lazy_rescale = not (head_dim <= 64 and not causal)
    three_groups_d128 = dict(tile_m=192, tile_n=80, num_stages=3) if 96 < head_dim <= 128 and not short else {}
    if length == "long":
        config = dict(num_sms=num_sms, dynamic_schedule=True, stale_max=head_dim <= 192, **three_groups_d96)
        if lazy_rescale:
            config["lazy_rescale"] = True
        if head_dim <= 64 and not causal:
            config.update(spin_waits=False, recompute_epilogue=True, q_by_group=dtype is cutlass.BFloat16)
        if head_dim > 192 and (causal or dtype is cutlass.BFloat16):
            config.update(wg_epilogue=True, q_by_group=True)
        if three_groups_d96 and causal:
            config["recompute_epilogue"] = True
        config.update(three_groups_d128)
        return config
    config = dict(num_sms=num_sms, stale_max=not (causal and head_dim <= 64 and up_to_1k), **three_groups_d96)
    # Mid d128 runs the long kernel, whose groups store O together.
    if wg_epilogue_fits(head_dim) and not three_groups_d128:
        config["wg_epilogue"] = True
        if short and head_dim <= 128 and not (causal and head_dim <= 64):
            config["wg_tma_store"] = True
    if causal and short:
        config.update(tile_order="head", planned_tail=True)
    elif causal:
        config["tile_order"] = "l2"
    if short and ((causal and head_dim != 96) or (up_to_1k and head_dim > 192)):
        config["cache_hints"] = True
    if length == "mid" or (up_to_1k and not causal and head_dim > 96):
        config["dynamic_schedule"] = True
    if length == "mid" and lazy_rescale:
        config["lazy_rescale"] = True
    if three_groups_d128:
        config.update(three_groups_d128)
    elif 96 < head_dim <= 128:
        config.update(num_stages=2, q_stages=2)
        if causal:
            config["recompute_epilogue"] = True
        else:
            config.update(q_by_group=True, spin_waits=length == "short_2k")
    if head_dim > 192:
        config["q_by_group"] = True
        if not causal:
            config["recompute_epilogue"] = True
        if short:
            config.update(o_from_registers=True, release_q_early=not causal)
        if up_to_1k and (causal or up_to_512):
            config["tile_n"] = 64
    if 128 < head_dim <= 192 and up_to_1k:
        config["tile_n"] = 64
    if head_dim <= 64:
        if short:
            config["prefetch_next"] = True
        if causal and short:
            config.update(tile_m=128, tile_n=128)
        if not causal or short:
            config["q_stages"] = 2
    return config


# ---------------------------------------------------------------------------------------------
# The Hopper backward (kernels/sm90/bwd.py, bwd_post.py)

# Head dims the Hopper backward implements; the others run the sm80 backward.
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Sm90BwdConfig:
    """One Hopper backward kernel: a CTA owns n_block_size keys of one KV head and walks the
    query blocks (m_block_size rows) of every query head that reads it."""

    dtype: type[cutlass.Numeric]
    head_dim: int
    causal: bool
    deterministic: bool = False  # dQ added in a fixed key-block order (a semaphore per query block)
    window: bool = False  # sliding window (its sides arrive at call time: call_with_mods)
    alibi: bool = False  # ALiBi bias (slopes at call time)
    softcap: bool = False  # scores capped by softcap * tanh (the cap at call time)
    # Packed variable-length batches (`call_varlen`): bounds from cu_seqlens, dK / dV by plain stores.
    varlen: bool = False
    dropout: bool = False  # the forward's Philox keep mask, drawn again (kernels/common/philox.py)
    m_block_size: int = 64  # query rows per step
    n_block_size: int = 128  # keys per CTA: 64 per MMA warp group (one 64-key block with split_head_dim)
    q_stages: int = 2  # Q (with its LSE) and dO (with its D) buffers in flight
    register_split: tuple[int, int] = (24, 240)  # setmaxnreg: producer warp group, MMA warp groups

    num_wg_mma = 2

    @property
    def shared_stats(self) -> bool:
        """128-row query blocks hold too many per-query statistics: each lane keeps a share of the
        LSE values (the others shuffle them in) and the dP GEMM starts from -D, so D is never held.
        With 64 rows they measured slower (2026-11-28, H100: 1-6% at hd 128, with the causal mask's
        offset hoisted as well)."""
        return self.m_block_size >= 128

    @property
    def split_head_dim(self) -> bool:
        """A CTA of 64 keys: each MMA warp group accumulates half of dK's and dV's head-dim
        columns for all of them, and the groups split the query block's columns of S^T and dP^T.
        Each group then holds only part of P^T and dS^T, so both go through shared memory to the
        dV and dK GEMMs. Above head dim 128 this is the only shape that fits (64 keys per group
        would need 2 * head_dim accumulator registers per thread); at 128 and below it serves the
        problem classes whose two-times-64-key kernel spills (`backward_config`)."""
        return self.n_block_size == 64

    @property
    def shortest_walk_first(self) -> bool:
        return BlockRanges.dq_turns_descend(self.deterministic, self.causal, self.window)

    @property
    def dkv_columns(self) -> int:
        """Head-dim columns of dV and dK each MMA group accumulates (and reads of Q and dO)."""
        return self.head_dim // self.num_wg_mma if self.split_head_dim else self.head_dim

    @property
    def num_mma_threads(self) -> int:
        return 128 * self.num_wg_mma

    @property
    def num_threads(self) -> int:
        return self.num_mma_threads + 128

@dataclass(frozen=True)
class Sm90BwdPostConfig:
    """The postprocess reads dQ's fp32 sums in the main kernel's accumulator order."""

    dtype: type[cutlass.Numeric]
    head_dim: int
    m_block_size: int
    varlen: bool = False  # packed sequences (`call_varlen`): dQ's sums at packed_stat_offset


def dq_atom_layout(m_block_size: int) -> tuple[int, int, int]:
    """How the two MMA warp groups share dQ = dS K: by rows when the query block has 64 rows per
    group, else by columns (head_dim halves)."""
    by_rows = m_block_size // 64
    return (by_rows, Sm90BwdConfig.num_wg_mma // by_rows, 1)


def backward_smem_bytes(config: Sm90BwdConfig) -> int:
    m, n, d, stages = config.m_block_size, config.n_block_size, config.head_dim, config.q_stages
    score_tiles = 2 if config.split_head_dim else 1  # dS, and P with split_head_dim
    tiles = 2 * (2 * stages * m * d + 2 * n * d + score_tiles * stages * m * n)  # Q, dO; K, V; dS, P (16-bit)
    return tiles + 4 * m * d + 2 * 4 * stages * m + 1024  # dQ staging (fp32), LSE and D, barriers


def backward_config(dtype, head_dim: int, causal: bool, deterministic: bool, window: bool = False,
                    softcap: bool = False, alibi: bool = False, varlen: bool = False,
                    dropout: bool = False) -> Sm90BwdConfig | None:
    """The Hopper backward for this problem class, or None where the sm80 backward serves it."""
    if head_dim not in BWD_HEAD_DIMS or dtype not in (cutlass.Float16, cutlass.BFloat16):
        return None
    # Classes whose 128-key kernel spills (bytes per MMA thread, 2026-11-28 compile reports) take
    # the split-head-dim shape, 64 keys per CTA, which does not.
    spills_at_128_keys = ((alibi and causal and head_dim in (96, 128))  # 56 bytes
                          or ((softcap or dropout) and head_dim == 128)  # 8-88; dropout's Philox draws 80
                          or (varlen and window and not alibi and head_dim == 128))  # 32
    # 128-row query blocks where they fit the 240 registers without spilling: hd 64, causal or not,
    # without a window, bias or cap (causal with the mask on every block: Sm90 bwd.one_block), nor
    # dropout (its dS needs D apart from dP, where shared_stats folds it in).
    m_block_size = 128 if head_dim == 64 and not (window or alibi or softcap or dropout) else 64
    # Above hd 128 (split_head_dim) one 64-key block per CTA; at hd 256 one Q / dO buffer each
    # (two would need 272 KB of smem with dQ's 64 KB staging buffer).
    tiles = {}
    if head_dim > 128:
        tiles = dict(n_block_size=64, q_stages=1 if head_dim > 192 else 2)
    elif spills_at_128_keys:
        tiles = dict(n_block_size=64)
    config = Sm90BwdConfig(dtype, head_dim, causal, deterministic, window, alibi, softcap, varlen=varlen,
                           dropout=dropout, m_block_size=m_block_size, **tiles)
    assert backward_smem_bytes(config) <= SMEM_BYTES
    return config


# ---------------------------------------------------------------------------------------------
# The Hopper fp32 forward on split TF32 (kernels/sm90/fwd_tf32.py)

# Head dims it implements; the others (and fp32 with one TF32 product) run the sm80 forward.
TF32_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Sm90Tf32FwdConfig(ConsumerWarpGroups):
    """One Hopper split-TF32 forward kernel for fp32 inputs: per key block S = Q K^T and O += P V,
    each as three TF32 wgmma chains (hi*lo, lo*hi, hi*hi). Q, K, K_lo, V^T, V^T_lo are fp32 tiles in
    shared memory (4 bytes a word: a K/V stage costs 4 * 4 * tile_n * head_dim bytes)."""

    head_dim: int
    causal: bool
    tile_m: int = 128  # rows of O per CTA: 64 per consumer warp group
    tile_n: int = 32  # keys per block
    num_stages: int = 2  # K/V blocks in flight
    # Each block's S GEMM issued with the previous block's PV GEMM (fwd.py's intra-warp-group overlap).
    overlap: bool = False
    # With overlap: the consumer warp groups take turns issuing their GEMMs (fwd.py's ping-pong).
    pingpong: bool = False
    # Each key block's PV GEMM into a zeroed accumulator of its own, added into O in fp32 (round to
    # nearest). Tensor cores have been measured to align and add by truncation (Fasi et al. 2021,
    # Volta to Ampere), a bias that grows with the MMAs into one accumulator (3 per 8 keys: 1,536 at
    # 4k keys); the errors of the fp32 adds cancel instead. At 4k keys the error fell 3.6-14x, to
    # 1.4-2.4x torch's fp32 memory-efficient SDPA (perf/results/h200-20261129-run6.md).
    block_accumulator: bool = False

    dtype = cutlass.Float32
    register_split = (24, 240)  # setmaxnreg: producer warp group, consumer warp groups


def tf32_smem_bytes(config: Sm90Tf32FwdConfig) -> int:
    """Q, then K, K_lo, V^T, V^T_lo per stage, fp32; alignment and barriers."""
    q = config.tile_m * config.head_dim * 4
    kv = 4 * config.num_stages * config.tile_n * config.head_dim * 4
    return q + kv + 1024


def tf32_can_implement(config: Sm90Tf32FwdConfig) -> bool:
    if config.head_dim not in TF32_HEAD_DIMS or config.tile_m != 128 or (config.pingpong and not config.overlap):
        return False
    # V^T's smem rows are tile_n keys, K-major in 128-byte (32-word) swizzle atoms.
    if config.tile_n % 32 != 0 or not 32 <= config.tile_n <= 256 or config.num_stages < 1:
        return False
    # d128 holds Q_lo (64 registers) and O (64): a second O for the block spilled with the causal
    # mask (24 bytes per thread, 2026-11-29).
    if config.block_accumulator and config.head_dim == 128 and config.causal:
        return False
    return tf32_smem_bytes(config) <= SMEM_BYTES


def tf32_forward_config(head_dim: int, causal: bool) -> Sm90Tf32FwdConfig | None:
    """The split-TF32 kernel for fp32 at this head dim, None where the sm80 forward serves it.
    d128: Q takes 64 KB, so two stages of 32 keys (2 KB a key with the four operand tiles) fill
    192 KB; d64: two stages of 64 keys and Q, 160 KB, the next block's S GEMM issued before this
    block's PV GEMM (overlap). Each block's PV GEMM has an accumulator of its own wherever that
    fits in registers (not d128 causal): the error falls 3.6-14x, to 1.4-2.4x torch's fp32
    memory-efficient SDPA, at the same speed (docs/kernels/sm90-forward.md)."""
    if head_dim == 64:
        config = Sm90Tf32FwdConfig(head_dim, causal, tile_n=64, num_stages=2, overlap=True, block_accumulator=True)
    elif head_dim == 128:
        config = Sm90Tf32FwdConfig(head_dim, causal, tile_n=32, num_stages=2, block_accumulator=not causal)
    else:
        return None
    assert tf32_can_implement(config), config
    return config
