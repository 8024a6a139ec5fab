"""FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.

FlashAttention-2 Algorithm 1, mapped onto Hopper:

* A tile is one (tile_m x head_dim) block of O for one (batch, head). A CTA computes one tile,
  or, persistent (`num_sms` > 0), tiles blockIdx.x, blockIdx.x + gridDim.x, ... with its
  pipelines running on from tile to tile.
* Warp group 0 is the producer: one warp issues TMA loads of Q (once per tile; with `q_by_group`
  in one piece per consumer warp group) and of K, V (one n_block at a time) into a
  `num_stages`-deep shared-memory ring guarded by mbarriers
  (`cutlass.pipeline.PipelineTmaAsync`). It gives most of its registers to the consumers
  (`setmaxnreg`).
* Warp groups 1..num_wg_mma are consumers; each owns 64 rows of the Q tile and runs
  S = Q K^T (wgmma, both operands in smem), the online softmax on the S accumulator, and
  O += P V (wgmma with P straight from registers).
* Intra-warp-group overlap: the S GEMM of the next K/V block is issued together with the PV
  GEMM of the current one, and the softmax of the next block runs while that PV GEMM does.
  Causal-masked blocks overlap too; P's conversion is pinned in place so
  that this fits in registers (see `convert_P`).
* Inter-warp-group ping-pong: named barriers make the consumer warp groups take turns
  issuing GEMMs, so one group's softmax hides behind the other group's GEMMs.
* Epilogue: O is normalized, written to smem (its own buffer where it fits, else Q's) and
  stored by TMA, which clips rows past seqlen_q; LSE is written straight from registers.
* Tail split (persistent, non-causal): when the last round of tiles would leave SMs idle, its
  tiles are cut along the keys into pieces that run side by side; each piece leaves its O and LSE
  in a global workspace and the last piece of a tile to finish merges them (`merge_pieces`).

K/V blocks are visited from the last one down, so the blocks that need masking (the
seqlen_k tail, the causal diagonal) come first and the rest run mask-free.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from functools import partial
from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils.layout import LayoutEnum

from ..common.blocks import BlockRanges, kv_head
from ..common.layouts import gmem_tiled_copy, reshape_acc_to_mn, store_tile_rows
from ..common.mask import apply_mask
from ..common.packed16 import convert_f32_to_16bit, cvt_pack_16bit
from ..common.softmax import LOG2_E, OnlineSoftmax

# Named barrier ids (0 is __syncthreads). Consumer warp group i waits on barrier
# _SCHED_BARRIER_BASE + i before issuing its GEMMs.
_EPILOGUE_BARRIER = 1  # + warp group index when each group stores its own rows (wg_epilogue)
_SCHED_BARRIER_BASE = 4
_SPLIT_BARRIER = 8  # consumer warp groups around a tail-split piece's hand-off

_SMEM_BYTES = 227 * 1024
_L2_BYTES = 50 * 1024 * 1024  # the H100's L2: what K/V of concurrently running heads may fill
_MAX_SPLITS = 4  # pieces per tail tile: each adds a prologue, a workspace slot and a merge read
_MIN_PIECE_BLOCKS = 2  # K/V blocks per piece, so that a piece still overlaps its GEMMs
# Stream-K tails only where a tile has this many K/V blocks: a share's pieces cost about 20 us
# per SM (each refills the pipeline behind Q's buffer, writes its float32 O to the workspace, and
# half of them merge), which only long tiles repay. Measured (d256, bf16 / fp16, session 37):
# 16k keys (205 blocks) +0.6 to +2.4%, 8k (103) -2 to -3%, 4k (52) -14 to -15%.
_STREAM_K_MIN_BLOCKS = 128
_SCHED_STAGES = 2  # next-unit slots between the producer and the consumers (dynamic_schedule)
# The walk plan's cost model (planned_tail): a tile costs this many K/V blocks' time besides its
# blocks (its prologue, epilogue and first loads). Per-CTA timeline, causal d128 512 keys (session
# 21): 2.0 us + 1.68 us per block.
_TILE_COST_BLOCKS = 1.2
_PLANNED_TAIL_ROUNDS = 4  # at most this many full rounds before the end are planned
_NO_UNIT = 2**31 - 1  # a walk plan's entry for a CTA that has no more units
# L2 eviction priorities of TMA's .L2::cache_hint operand (createpolicy encodings): Q and O pass
# through once, K/V serve every m_block of their head.
_L2_EVICT_FIRST = 0x12F0000000000000
_L2_EVICT_LAST = 0x14F0000000000000


class TailPlan:
    """Which pieces the last `tiles` tiles of a persistent non-causal walk run as, in the order the
    walk hands them out. Piece i keeps its O and LSE in workspace slot i; its row of the plan
    (`words`, which the kernel reads after its counters) is: its tile, n_block_min, n_block_max,
    the tile's number of pieces and their slots (the last repeated up to _MAX_SPLITS), so that
    the tile's last piece to finish finds the others."""

    UNIT_WORDS = 4 + _MAX_SPLITS

    def __init__(self, tiles: int, units: list[tuple[int, int, int]]):
        self.tiles, self.units = tiles, units  # (tail tile, n_block_min, n_block_max) per piece

    def whole_tiles(self, num_tiles: int) -> int:
        return num_tiles - self.tiles

    @staticmethod
    def schedule_counter(num_sms: int) -> int:
        """Index of the dynamic schedule's counter: after one counter per tail tile (fewer than
        two rounds of tiles)."""
        return 2 * num_sms

    @staticmethod
    def plan_offset(num_sms: int) -> int:
        return TailPlan.schedule_counter(num_sms) + 1

    def words(self, num_tiles: int) -> list[int]:
        """The plan as the kernel reads it, with tile indices in the walk of `num_tiles` tiles."""
        slots: dict[int, list[int]] = {}
        for slot, (tile, _, _) in enumerate(self.units):
            slots.setdefault(tile, []).append(slot)
        padded = {tile: own + own[-1:] * (_MAX_SPLITS - len(own)) for tile, own in slots.items()}
        whole = self.whole_tiles(num_tiles)
        return [w for tile, lo, hi in self.units for w in (whole + tile, lo, hi, len(slots[tile]), *padded[tile])]

    @staticmethod
    def even(split_tiles: int, splits: int, num_n_blocks: int) -> "TailPlan":
        """Each tail tile in `splits` equal runs of its blocks (tail_split_plan), tile by tile."""
        return TailPlan(split_tiles, [(tile, piece * num_n_blocks // splits, (piece + 1) * num_n_blocks // splits)
                                      for tile in range(split_tiles) for piece in range(splits)])

    @staticmethod
    def stream_k(num_tiles: int, num_n_blocks: int, num_sms: int) -> "TailPlan | None":
        """The last round's leftover tiles and one full round before them (or all tiles, when
        fewer than that) as one run of K/V blocks, cut into num_sms equal shares, one per SM;
        a share covers parts of two or three tiles. Cuts within _MIN_PIECE_BLOCKS of a tile's
        edge move to it. Pieces go out in the order their shares would start them with every SM
        starting its share at once, so that the dynamic schedule, which hands the next unit to
        the first SM free, keeps each SM's total at one share. A tile that one share covers is one
        piece, which stores its O itself. None when no tiles are left over or a tile would come in
        more than _MAX_SPLITS pieces."""
        leftover = num_tiles % num_sms
        if leftover == 0:
            return None
        tiles = min(num_tiles, leftover + num_sms)
        total = tiles * num_n_blocks
        cuts = []
        for share in range(num_sms + 1):
            cut = round(share * total / num_sms)
            edge = round(cut / num_n_blocks) * num_n_blocks
            cut = edge if abs(cut - edge) < _MIN_PIECE_BLOCKS else cut
            if not cuts or cut > cuts[-1]:
                cuts.append(cut)
        pieces = []  # (start within its share, share, tail tile, n_block_min, n_block_max)
        for share, (begin, end) in enumerate(zip(cuts, cuts[1:])):
            at = begin
            while at < end:
                tile = at // num_n_blocks
                stop = min(end, (tile + 1) * num_n_blocks)
                pieces.append((at - begin, share, tile, at - tile * num_n_blocks, stop - tile * num_n_blocks))
                at = stop
        if max(Counter(p[2] for p in pieces).values()) > _MAX_SPLITS:
            return None
        return TailPlan(tiles, [p[2:] for p in sorted(pieces, key=lambda p: p[:2])])


class FlashAttnFwdSm90:
    """Hopper forward. See the module docstring for the structure."""

    _HEAD_DIMS = (64, 96, 128, 192, 256)
    # __call__ takes the tail split's workspace and plan after the LSE (cute_flash/forward_sm90.py).
    takes_split_workspace = True

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        causal: bool,
        tile_m: int = 128,
        tile_n: int = 128,
        num_stages: int = 2,
        intra_wg_overlap: bool = True,
        pingpong: bool = True,
        lpt: str = "l2",
        num_sms: int = 0,
        rescale_o_early: bool | None = None,
        prefetch_next: bool = False,
        wg_epilogue: bool = False,
        q_stages: int = 1,
        rescale_if_moved: bool = False,
        dynamic_schedule: bool = False,
        spin_waits: bool = True,
        recompute_epilogue: bool = False,
        q_by_group: bool = False,
        o_from_registers: bool = False,
        release_q_early: bool = True,
        planned_tail: bool = False,
        wg_tma_store: bool = False,
        lazy_rescale: bool = False,
        stale_max: bool = False,
        dependent_launch: bool = True,
        cache_hints: bool = False,
    ):
        assert FlashAttnFwdSm90.can_implement(
            dtype, head_dim, causal, tile_m=tile_m, tile_n=tile_n, num_stages=num_stages,
            q_stages=q_stages, wg_epilogue=wg_epilogue,
        ), (dtype, head_dim, causal, tile_m, tile_n, num_stages, q_stages, wg_epilogue)
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.intra_wg_overlap = intra_wg_overlap
        # With the overlap, O's rescale by the previous block's row factors can run while this
        # block's S GEMM is in flight, right before the PV GEMM that needs it, instead of after
        # the softmax, where it delays the next S GEMM. Measured (interleaved A/B on the H100):
        # d256 +2-7%, d128 causal +1-3% (non-causal within ±2%), d192 within ±2%.
        if rescale_o_early is None:
            rescale_o_early = head_dim >= 128
        # The running max moves only when a row of the warp outgrows it by 2^8 (softmax.py:
        # grown_row_max): otherwise the block is exponentiated against the old max and neither
        # the row sums nor O are rescaled. The rare rescale runs right after the PV wait (so O
        # is not rescaled early). The loop's common path loses the row factors and O's
        # multiplies: long non-causal d128 383 -> 313 SASS instructions per block, d256 501 ->
        # 373, d64 418 -> 388. Measured: long non-causal d128 +6-7% (length_config).
        # The lazy form without the row maxima on the common path (softmax.py: exponentiate_stale):
        # an unmasked block is exponentiated against the running max at once, and a warp vote on
        # the block's partial row sums (> 2^8) finds the rare rows that outgrew it; those are
        # rescaled from P, or scored again (rescore) where an exponential overflowed. Long
        # non-causal d64 418 -> ~307 SASS instructions per block. Measured (interleaved A/B,
        # session 35): long non-causal d64 +4-7%, d96 +6%, d128 +6%, short non-causal d128 1k / 2k
        # +7.5 / +13%, causal d64 / d128 long +4-7% / +2-5% (length_config says where it is off).
        # Masked blocks of a kernel with it rescale lazily too.
        self.stale_max = stale_max and intra_wg_overlap
        self.lazy_rescale = (lazy_rescale or self.stale_max) and intra_wg_overlap
        self.rescale_o_early = rescale_o_early and intra_wg_overlap and not self.lazy_rescale
        # Skip O's rescale for a block when no row max of the warp moved (row_scale is then 1).
        # Measured (interleaved A/B, bf16): non-causal d128 +1% at 2k, +0-4% at 4k, +4% at 8k,
        # +7% at 16k; d256 -2 to -3%, causal d64 -5% at 16k, elsewhere within 2%.
        self.rescale_if_moved = rescale_if_moved and not self.lazy_rescale
        # Persistent CTAs with a static walk only (the dynamic schedule knows the next tile late):
        # the producer prefetches the next tile's Q and first K, V block to L2.
        self.prefetch_next = (
            prefetch_next and num_sms > 0
            and not FlashAttnFwdSm90.dynamic_schedule_enabled(num_sms, dynamic_schedule)
        )
        # Each consumer warp group stores its own 64 rows of O (16-byte stores from smem) and goes
        # on to its next tile, instead of all groups meeting for one TMA store per tile.
        self.wg_epilogue = wg_epilogue
        # Causal tile order: "l2" longest-first within groups of heads whose K/V fit in L2,
        # "head" longest-first within each head, "none" launch order.
        self.lpt = lpt if causal else "none"
        # Persistent CTAs: with num_sms > 0 the grid is at most num_sms CTAs, each walking the tiles
        # (m_block, head, batch) with a stride of the grid size, so the producer loads the next
        # tile's K, V (and Q, when O has its own smem buffer) while the consumers finish the
        # current one. 0: one CTA per tile.
        self.num_sms = num_sms
        # Pipeline waits as plain mbarrier.try_wait loops (spin_wait) instead of the DSL's wait,
        # whose suspend-time hint becomes a NANOSLEEP.SYNCS that wakes late. Measured (two
        # interleaved runs): d128 +1-2% long, +2-5% at 1k-2k; d64 non-causal 512 +3.5%; long
        # non-causal d64 -1 to -2% and, on today's kernels, short non-causal d128 -0.3 to -1%, so
        # those keep the DSL's wait (length_config).
        self.spin_waits = spin_waits
        # Persistent CTAs: the epilogue's tile and thread coordinates are derived anew after each
        # mainloop instead of being hoisted out of the tile loop by the compiler, which keeps them
        # live through the mainloop. With those registers free, ptxas waits for a P V GEMM after
        # the softmax's first dozen exp2 (as FA4 does) instead of before the first (long
        # non-causal d64). Measured (two interleaved runs): long non-causal d64 +2.6 / +3.4-4.4 /
        # +4.8-5.1% at 4k / 8k / 16k, short non-causal d256 +1.5 / +2.9-3.7 / +4.3% at 512 / 1k /
        # 2k, short causal d128 +2.4-2.6% at 512, +1.3% at 2k; but short non-causal d64 -3.6% at
        # 512, causal d64 -2 to -4%, non-causal d128 -1.5%: set per class in length_config.
        self.recompute_epilogue = recompute_epilogue and num_sms > 0
        # Persistent CTAs take their next unit from a global counter (in the tile order) as they
        # finish, instead of a fixed stride: the units in flight stay a window of that order, and
        # a CTA whose tiles were short does not run ahead into other heads' K/V.
        self.dynamic_schedule = FlashAttnFwdSm90.dynamic_schedule_enabled(num_sms, dynamic_schedule)
        # The last rounds of the static per-head causal walk come from a plan the host makes per
        # call (plan_walk): their tiles, longest first, to the CTAs with the least modeled work.
        self.planned_tail = (
            planned_tail and causal and lpt == "head" and num_sms > 0 and not self.dynamic_schedule
        )
        # Programmatic dependent launch: the grid may start once the CTAs of the kernel before it
        # in the stream have exited, before that grid has completed and flushed, and waits for it
        # (griddepcontrol.wait) ahead of its first global memory access; the launch and the
        # prologue (descriptor prefetch, barrier init) overlap the end of the kernel before.
        # Measured (session 36, ten calls back to back, bf16 / fp16): causal d128 512 +2.8 / +1.5%,
        # 1k +1.5 / +1.6%, causal d256 512 +1.2 / +2.8%, non-causal d128 512 +2.8 / +2.5%, causal d64
        # 512 +1.8 / +2.7%; one call between CUDA events (the paper bench) within +-0.5%. The
        # kernel does not release the kernel after it early (griddepcontrol.launch_dependents):
        # released at the start, the next call of this kernel ran 2-3% slower than without
        # dependent launch, 4-5% slower than unreleased; released after the producer's last load,
        # 0-2% slower than unreleased. Not verified why; presumably a kernel released early takes
        # each SM as one of these CTAs leaves it, not the order a fresh launch spreads them in.
        # Off only to measure.
        self.dependent_launch = dependent_launch
        # TMA loads and stores carry L2 eviction priorities: Q and O first out, K/V last, so
        # that the tiles' one-pass traffic does not push out K/V that the head's other tiles
        # still read. Measured (session 40, interleaved, one call after an L2 flush): short causal
        # d256 +3.7% at 512, +1.8-2.2% at 1k; causal d128 512 +0.9-1.3% (Q's and K/V's hints each
        # give about half, O's alone nothing); length_config says where it is on.
        self.cache_hints = cache_hints
        # Tail split: the host decides per call (tail_split_plan).
        self.splits_tail = FlashAttnFwdSm90.tail_split_enabled(num_sms, causal)
        # Q stages: with two, the producer loads the next tile's Q while this one runs.
        self.q_stages = q_stages
        self.separate_o = (
            FlashAttnFwdSm90.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, q_stages)
            + tile_m * head_dim * dtype.width // 8
            <= _SMEM_BYTES
        )
        # O from the accumulator straight to global memory (16-byte stores after a transpose
        # within each quad of threads), for kernels where O would otherwise pass through Q's
        # only buffer: Q is then free once the mainloop ends, and the next tile's Q loads while
        # this one's epilogue runs. Where O has its own buffer, its smem path is faster: skipping
        # it lost 1-6% at short d64 / d128 and long non-causal d128 (session 10, run 4).
        self.o_from_registers = o_from_registers and not self.separate_o
        # With wg_epilogue, each group's rows of O go out by TMA (one 64-row box per group), which
        # must have read sO only by the group's next epilogue, instead of by 128 threads' 16-byte
        # stores.
        self.wg_tma_store = wg_tma_store and wg_epilogue and not self.o_from_registers
        # ... and released after the tile's last S GEMM instead of after its mainloop, so that
        # the load overlaps the last PV GEMM too. Measured (interleaved, short d256): non-causal
        # +0.3-0.8% over the late release, causal -4.3% at 512 (length_config).
        self.release_q_early = release_q_early and self.o_from_registers
        self.num_wg_mma = tile_m // 64
        # Q in one 64-row piece per consumer warp group, each with its own barriers: a group that
        # is done with its rows of Q (and of O, when O passes through Q's buffer: wg_epilogue)
        # releases them, and the producer loads them for the next tile while the other groups
        # still run this one. With one Q buffer (d256), a whole-tile Q leaves every group waiting
        # for the last group's epilogue and then for the load.
        self.q_by_group = q_by_group and (wg_epilogue or self.separate_o or self.o_from_registers)
        self.q_pieces = self.num_wg_mma if self.q_by_group else 1
        self.q_piece_rows = tile_m // self.q_pieces
        self.pingpong = pingpong and self.num_wg_mma >= 2
        self.num_mma_threads = 128 * self.num_wg_mma
        self.num_threads = 128 + self.num_mma_threads
        # 64K registers per SM shared by one producer and num_wg_mma consumer warp groups.
        self.num_producer_regs, self.num_mma_regs = {2: (24, 240), 3: (32, 160)}[
            self.num_wg_mma
        ]
        # Chunks of the tail merge whose loads go out together (store_merged): 20 registers each.
        self.merge_batch = 8 if self.num_wg_mma == 2 else 4

    # ------------------------------------------------------------------ host-side config

    @staticmethod
    def smem_bytes(dtype, head_dim: int, tile_m: int, tile_n: int, num_stages: int, q_stages: int = 1,
                   **_) -> int:
        elem = dtype.width // 8
        q = q_stages * tile_m * head_dim * elem  # O reuses this buffer when it has none
        kv = 2 * num_stages * tile_n * head_dim * elem
        return q + kv + 1024  # alignment padding and mbarriers

    @staticmethod
    def can_implement(
        dtype, head_dim: int, causal: bool, tile_m: int = 128, tile_n: int = 128,
        num_stages: int = 2, q_stages: int = 1, wg_epilogue: bool = False, **_,
    ) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if head_dim not in FlashAttnFwdSm90._HEAD_DIMS:
            return False
        if tile_m not in (128, 192) or tile_n % 16 != 0 or not 16 <= tile_n <= 256:
            return False
        if num_stages < 1 or q_stages < 1:
            return False
        if wg_epilogue and not FlashAttnFwdSm90.wg_epilogue_fits(head_dim):
            return False
        # Accumulator registers per consumer thread: S (tile_n/2) + P (tile_n/4) + O (head_dim/2).
        # A coarse filter only: the compile test checks that the chosen tiles do not spill.
        acc_regs = tile_n // 2 + tile_n // 4 + head_dim // 2
        if acc_regs > (200 if tile_m == 128 else 128):
            return False
        smem = FlashAttnFwdSm90.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, q_stages)
        if q_stages > 1:  # O then needs its own buffer
            smem += tile_m * head_dim * dtype.width // 8
        return smem <= _SMEM_BYTES

    @staticmethod
    def wg_epilogue_fits(head_dim: int) -> bool:
        """A warp group's 128 threads store whole rows of O, 8 elements (16 bytes) each: d64, d128,
        d256, not d96 or d192."""
        return 128 % (head_dim // 8) == 0

    @staticmethod
    def default_tiles(dtype, head_dim: int, causal: bool) -> dict:
        # Measured on the H100 (bf16, perf/NOTES.md): d64 with three consumer warpgroups of 64
        # rows and 128-column blocks is 2-8% faster than 192x96 (which beat 128x128 by 13%); d128
        # gains 4% from a third K/V stage, which still fits in 227 KB of smem, and loses 2-15% with
        # wider blocks (144-176 columns, two stages); non-causal d128 skips O rescales that change
        # nothing (rescale_if_moved).
        if head_dim <= 64:
            tiles = dict(tile_m=192, tile_n=128, num_stages=2)
        elif head_dim <= 96:
            tiles = dict(tile_m=128, tile_n=128, num_stages=2)
        elif head_dim <= 128:
            tiles = dict(tile_m=128, tile_n=128, num_stages=3, rescale_if_moved=not causal)
        elif head_dim <= 192:
            tiles = dict(tile_m=128, tile_n=112, num_stages=2)
        else:
            tiles = dict(tile_m=128, tile_n=80, num_stages=2)
        if causal:
            tiles["lpt"] = "l2"
        return tiles

    @staticmethod
    def length_config(dtype, head_dim: int, causal: bool, length: str, num_sms: int) -> dict:
        """Init arguments for a length class (dispatch.length_class: "short_512" up to 512 keys,
        "short" up to 1024, "short_2k" up to 2048, "mid" causal up to 4096, "long").

        Measured on the H100 (bf16, perf/NOTES.md, docs/kernels/sm90-forward.md):
        * Short (and short_2k, on its settings) and mid: persistent CTAs are 5-24% faster at seqlen
          512-2048 for head dims up to 128, where a tile is only a few K/V blocks and the next
          tile's loads hide behind this one's epilogue, and 0-4% at d192/d256 (causal, with the
          snake walk of unit_of_round: d128 +13-18%, d256 +1-8%, and still +2-9% at 4k). d128 then
          prefers two K/V stages, which leave room for O's own smem buffer. Short causal tiles run
          longest first within each head ("head"): +19%/+11% at d128 512/1k over "l2". Short causal
          d64 switches to 128 x 128 tiles, which waste less of the diagonal block: +8% at 512 and
          +9% at 1k against 192 x 128 (-2% at 2k, +5% for 192 x 128 at 4k: so "mid" keeps them; non-
          causal: -2% at 1k, -11% at 2k). Short d64 also warms L2 with the next tile's first blocks
          (prefetch_next): +2-5% at 512-1k, while d128 loses 1-8% with it. Each warp group stores
          its own rows of O (wg_epilogue) and Q is double-buffered (q_stages=2): non-causal d64/d128
          +2-7% at 512-2k, causal d128 +7/+5/+3/+0.5% at 512/1k/2k/4k, causal d64 +4.4/+2.8/+1.7% at
          512/1k/2k (mid: -1.9%); wg_epilogue alone: causal d64 +2-4%, d256 +0-2% at 512-2k (two Q
          stages do not fit there); 96- and 192-element rows do not split into 16-byte pieces over
          128 threads.
        * Mid (causal, 2049-4096 keys): the short settings, but the CTAs take their tiles from a
          global counter (dynamic_schedule) in the L2-grouped order, at 4k: d64 +1.3%, d96 +7.7%,
          d128 +3.0%, d192 +13%, d256 +1.2% against the static snake walk; d128 takes the long
          kernel's 192 x 80 tiles (below).
        * Short non-causal d128, d192 and d256 (up to 1024 keys) take their tiles from the counter
          too: d128 +0.5-2.7% at 512 and 1k, d192 +1.6-3.0%, d256 0 to +4.6% at 512 and +-0.3% at
          1k (session 21, three runs, bf16 and fp16, one call after an L2 flush): a static walk's
          CTAs end up to 10% apart at 512 keys (Nsight Compute, d128: active cycles 201k-221k,
          cuDNN's 200k-214k), and the counter evens them out. Short_2k (+0.3 / -1.0% at d128 2k),
          short d64 (-3.8% at 512: it gives up prefetch_next), d96 (-4.5% at 512) and short causal
          problems (-1 to -3% in the per-head order, -3 to -14% in "l2") keep the static walk.
        * Short_2k (1025-2048 keys): the short settings, but non-causal d128 rescales O after the
          softmax (rescale_o_early off): +1.2-1.7% at 2k (bf16 and fp16, three interleaved runs,
          session 12); at 1k +0.2-0.5% and at 512 -0.2 to -1.1%, so short problems keep the early one.
          Short causal d256 runs 64-column blocks, which waste less of the diagonal block: +1.6 /
          +2.1% at 512 and +1.6 / +1.7% at 1k (bf16 / fp16, session 20, run 2; +0.8-1.9% at 512 in
          sessions 6-7), but -0.1 to -0.5% at 2k, which keeps 80.
        * Short_512 (up to 512 keys): non-causal d256 runs 64-column blocks too, since 512 keys are
          6.4 blocks of 80 (a seventh, mostly masked, block per tile): +2.0 to +2.2% at 512 (bf16 /
          fp16, with and without an L2 flush, session 24, run 3), while at 1k 80 is 2.3-2.7% faster
          (13 blocks against 16) and at 256 / 384 keys the two are within -1.3 to +1.1%.
        * Short d192 runs 64-column blocks instead of 112: non-causal +4.5 to +5.8% at 512, causal
          +6.5 to +7.5% at 512 and +13 to +16% at 1k (bf16 / fp16, with and without an L2 flush,
          session 24, run 4).
        * Short non-causal d128 (up to 1024 keys) keeps the DSL's sleeping pipeline waits
          (spin_waits off): +0.3 to +1.0% at 512 and 0 to +0.5% at 1k in five interleaved runs
          (bf16 and fp16, sessions 12-13); short_2k keeps the spinning waits.
        * Long: persistent with the dynamic schedule. A static walk lost there when causal (16k
          d128 427 vs 636 TFLOP/s: CTAs whose tiles were short raced ahead over other heads' K/V);
          the counter keeps the tiles in flight a window of the longest-first order. Against one
          CTA per tile: causal d64 +4.1% / +2.2% at 8k / 16k, d256 +2.6% / +1.8%, d96 / d192 +1-2%
          at 8k, d128 (then on 128 x 128) +5.1% / +1.9%; non-causal d96 +8%, d192 +2%, d256
          +1-1.5%. d128 runs 192 x 80 tiles (three consumer warp groups, three K/V stages):
          non-causal +1-3% at 4k-16k over 128 x 128, and +2% with the counter over a static walk;
          causal (mid too) with lazy rescaling +6.5-8.0% at 4k, +9.5-11% at 8k-16k over 128 x 128
          with two K/V and two Q stages, eager (session 32, two interleaved runs, bf16 and fp16;
          eager on 192 x 80 -1 to -2.5%, two K/V stages or per-group O stores within +-1.5%, the
          same tiles at 2k -3%). Most short problems keep the static walk (the counter:
          causal d64 -10% at 1k; see below for the exceptions). Long non-causal d64 keeps the DSL's
          sleeping pipeline waits (spin_waits: -1 to -2% there).
        * Long and mid problems rescale lazily (lazy_rescale, see __init__; session 26, runs 1-3,
          interleaved, bf16 / fp16): non-causal d128 +5.6 to +7.3% at 4k-16k, d96 +2.6 / +5.3% at
          8k, d192 +2.6 / +1.2% at 8k, d256 -0.2 to +3.8% at 4k-16k; causal d96 +4.0 to +6.5% at
          4k-8k, d192 +0.8 to +8.3%, d256 -0.9 to +4.9%, d64 -0.8 to +2.7%; but non-causal d64 -1.7
          to +0.7% (off there). Causal d128 gains only on 192 x 80 tiles (above): on 128 x 128 it
          was +0.3 to +2.8% with a register spilled in the producer. Short problems: within -1.6
          to +1.8%, not used.
        * stale_max (see __init__; session 35, interleaved A/B, bf16 / fp16): long non-causal d64
          +4.3-5.9 / +5.9-7.3% at 4k-16k, d96 +6.1%, d128 16k +5.8 / +6.1%, d192 +2.1-3.2%; short
          non-causal d64 1k / 2k +4.4 / +6.1%, d128 +7.5 / +13.1%; causal d64 4k-16k +4-7%, d128
          2k-16k +1.4-4.9%, d256 2k +1.4-1.9%. Off for long d256 (causal 16k -3.2 / -2.2% bf16,
          non-causal within +-2%) and for short causal d64 up to 1k keys (512 -2.7 to -2.9%).
        * recompute_epilogue (see __init__): long non-causal d64, short non-causal d256, short
          causal d128.
        * q_by_group (see __init__; session 8, interleaved runs 3-9 of the variant log): d256 short and mid +0.7 to
          +1.8% in every cell, long causal d256 with per-group O stores +0.7 to +2.9%, long
          non-causal d256 with them in bf16 +0.6 to +1.8% at 4k / 8k / 16k (fp16 +0.5 to +0.7% at
          4k / 8k but -0.4 / -0.7% at 16k, so bf16 only; session 39, two interleaved runs), short
          non-causal d128 +0.3-0.8 / +1.3 / +2.4-2.5% at 512 / 1k / 2k, long non-causal d64
          +1.5-2.4% at 4k / 8k in bf16 but -3.3 / -4.0 / -1.6% at 4k / 8k / 16k in fp16 (so bf16
          only there); it lost 1-3% at short d64, causal d128 and long non-causal d128.
        * From 1025 keys on d96 runs 192 x 96 tiles (three consumer warp groups) instead of 128 x 128:
          +11-15% at 2k-16k non-causal and +14-21% causal, bf16 and fp16 (session 19, run 3; causal
          2k +15.0 / +15.4% in session 20, run 2); short problems keep 128 x 128 (192 x 96: -2 to -3%
          at 512 non-causal, -8% causal at 512 and 1k). Long
          d96 skipped O rescales that change nothing (rescale_if_moved) when non-causal,
          +0.9-1.2% at 8k and +1.4-3.1% at 16k (lazy rescaling since), and derives the epilogue's coordinates per tile
          (recompute_epilogue) when causal, +2.3-3.3% at 16k (two interleaved runs, bf16 and fp16,
          session 19 runs 5-6).
        * Short and short_2k causal problems take the last rounds of their walk from a host plan
          (planned_tail, plan_walk): d64 +0.3 / +0.8% at 512, +1.7 to +2.6% at 1k, +1.9 / +2.0% at
          2k; d128 +0.6 / +0.7% at 512, +0.5 to +1.6% at 1k, +0.7 / +1.0% at 2k; d256 +0.0 to
          +0.6% at 1k and 2k, no plan at 512 (session 22, runs 1-2, bf16 and fp16, one call after
          an L2 flush).
        * Short and short_2k d128, and non-causal d64, store each warp group's rows of O by TMA
          (wg_tma_store; session 23, runs 3-4, bf16 / fp16, one call after an L2 flush):
          non-causal d128 +1.8 to +2.4% at 512, +0.7 / +1.9% at 1k, -0.3 / +0.7% at 2k; causal d128
          +0.0 to +0.5% at 512, +2.2 to +2.5% at 1k, +1.8% at 2k; non-causal d64 +1.1 / +1.2% at
          512, +0.5 / +0.6% at 1k-2k. Short causal d64 lost 1.2-1.9% at 512-2k; mid and long causal
          moved -1.2 to +2.6% (d128 4k -0.3 / -1.2%, d64 4k +1.6 / +0.8%, d128 and d256 8k +1.0 /
          -1.1% and +2.6 / +0.1%), not past the spread of one run: they keep the 16-byte stores.
        * o_from_registers (see __init__; session 10, runs 1-3 of its variant log): short d256
          causal +2.8-3.0 / +1.1-1.2 / +0.6-0.8% at 512 / 1k / 2k with Q released after the
          mainloop, non-causal +3.2-3.7 / +1.8-2.2 / +1.0-1.3% with Q released after the last S
          GEMM (release_q_early); within +-0.6% at mid and long d256, which keep the smem path.
        * cache_hints (see __init__; session 40, runs 1-4, interleaved, bf16 / fp16): short causal
          d256 +3.5-3.9 / +3.7% at 512, +1.8 / +2.2% at 1k, +1.0-1.2% at 2k (bf16); d128 +0.9-1.3 /
          +1.3% at 512, +0.2% at 1k, 0 to +0.2% at 2k; d64 +0.6-1.1 / +0.7-0.9% at 512, +0.4% at 1k;
          d192 +1.4-1.5 / +0.5% at 512; short non-causal d256 +1.8-1.9 / +1.8% at 512, +0.7% at 1k
          (fp16). Off for causal d96 (-0.9 to -1.3% at 512, -0.6% at 1k), short non-causal d128
          (-0.4 to -0.9% at 512, -0.2% at 2k) and d64 (+-0.1%), and for mid and long problems
          (causal d64-d256 4k-16k -0.4 to +1.1%, non-causal d256 16k -0.2 / -0.7%, d128 4k-16k -2.5 to
          +0.6% and d64 8k -1.6 to +1.5% in three repeats, run 7).
        """
        # short_512 and short_2k take the short settings, but for d256's non-causal blocks
        # (short_512), d96's tiles, d128's O rescale and d256's causal blocks (short_2k).
        up_to_512 = length == "short_512"
        up_to_1k = up_to_512 or length == "short"
        short = up_to_1k or length == "short_2k"
        three_groups_d96 = dict(tile_m=192, tile_n=96) if 64 < head_dim <= 96 and not up_to_1k else {}
        # Long and mid kernels but non-causal d64 (-1.7 to +0.7%).
        lazy_rescale = not (head_dim <= 64 and not causal)
        # d128 from mid on, causal or not: three consumer warp groups of 64 x 80, three K/V stages.
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
        late_rescale = length == "short_2k" and not causal
        # Mid d128 runs the long kernel, whose groups store O together.
        if FlashAttnFwdSm90.wg_epilogue_fits(head_dim) and not three_groups_d128:
            config["wg_epilogue"] = True
            if short and head_dim <= 128 and not (causal and head_dim <= 64):
                config["wg_tma_store"] = True
        if causal and short:
            config.update(lpt="head", planned_tail=True)
        elif causal:
            config["lpt"] = "l2"
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
                config.update(q_by_group=True, rescale_o_early=not late_rescale, spin_waits=late_rescale)
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

    @staticmethod
    def dynamic_schedule_enabled(num_sms: int, dynamic_schedule: bool) -> bool:
        """Only persistent CTAs take their tiles from the counter (which the host then passes)."""
        return num_sms > 0 and dynamic_schedule

    @staticmethod
    def tail_split_enabled(num_sms: int, causal: bool) -> bool:
        """Persistent non-causal kernels split their last round: causal tiles differ in length and
        run longest first, so their last round is short anyway."""
        return num_sms > 0 and not causal

    @staticmethod
    def tail_work(seqlen_q: int, tile_m: int, num_heads_batch: int) -> int:
        """The tiles' work in whole tiles: a head's last tile costs only the warp groups that have
        rows in it (the others pass its blocks, pass_blocks), e.g. a third for 4096 rows in 192-row
        tiles."""
        m_blocks, groups = -(-seqlen_q // tile_m), tile_m // 64
        last_groups = -(-(seqlen_q - (m_blocks - 1) * tile_m) // 64)
        return -(-((m_blocks - 1) * groups + last_groups) * num_heads_batch // groups)

    @staticmethod
    def tail_split_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int | None = None) -> tuple[int, int]:
        """(split_tiles, splits) for one call of a tail-splitting kernel: the last `split_tiles`
        tiles of the walk run as `splits` pieces each, all at once on the SMs that the last round
        would leave idle. (0, 1) when the round is full, or too full for two pieces per tile, or
        when pieces would be shorter than _MIN_PIECE_BLOCKS K/V blocks. Measured (perf/NOTES.md):
        pieces over two rounds lost 7-13% (per-piece prologue and merge, and an H100 that clocks
        up while SMs idle), so they all fit one; planned where no one-round split exists (session
        14), they lost 3-7% at d128 1k / 2k and tied at d64 8k / 16k.
        When the tiles leave no split, the plan is taken again on their work (`work_tiles`,
        tail_work): partial tiles run ahead of the walk, and what is left after the last full
        round of work is what idles. d128 at 4k keys (1408 tiles, 1366 of work): (46, 2), +3%
        (session 9); at 8k / 16k, where the tiles' own plan (56, 2) applies, the work's plan
        lost 1-2%."""
        plan = FlashAttnFwdSm90._split_leftover(num_tiles, num_n_blocks, num_sms)
        if plan == (0, 1) and work_tiles is not None:
            plan = FlashAttnFwdSm90._split_leftover(work_tiles, num_n_blocks, num_sms)
        return plan

    @staticmethod
    def tail_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int | None = None,
                  dynamic_schedule: bool = False) -> TailPlan | None:
        """The pieces of one call's tail (TailPlan), None for none. Equal pieces all in the last
        round where tail_split_plan finds them; otherwise, on the dynamic schedule, with tiles of
        equal cost and at least _STREAM_K_MIN_BLOCKS blocks a tile, equal shares of the last two
        rounds' blocks per SM (TailPlan.stream_k). Why: 128-row d256 tiles leave 100 / 116 / 124
        of 132 SMs busy in the last round at 16k / 8k / 4k tokens (8 heads), too many to split
        within the round; a full last round measured +2% TFLOP/s for both ours and FA4 (seqlen_q
        16896 / 8448 / 4224 against 16384 / 8192 / 4096, session 37)."""
        split_tiles, splits = FlashAttnFwdSm90.tail_split_plan(num_tiles, num_n_blocks, num_sms, work_tiles)
        if split_tiles:
            return TailPlan.even(split_tiles, splits, num_n_blocks)
        # The shares are equal in blocks, so only where every tile costs the same (no head's last
        # tile with fewer rows: tail_work).
        whole_cost = work_tiles is None or work_tiles == num_tiles
        if dynamic_schedule and whole_cost and num_n_blocks >= _STREAM_K_MIN_BLOCKS:
            return TailPlan.stream_k(num_tiles, num_n_blocks, num_sms)
        return None

    @staticmethod
    def _split_leftover(num_tiles: int, num_n_blocks: int, num_sms: int) -> tuple[int, int]:
        leftover = num_tiles % num_sms
        if leftover == 0:
            return 0, 1
        splits = min(num_sms // leftover, num_n_blocks // _MIN_PIECE_BLOCKS, _MAX_SPLITS)
        return (leftover, splits) if splits >= 2 else (0, 1)

    @staticmethod
    def plan_walk(seqlen_q: int, seqlen_k: int, num_heads_batch: int, tile_m: int, tile_n: int,
                  num_sms: int) -> list[int]:
        """The planned tail of a persistent per-head causal walk (planned_tail), as the int32
        words the kernel reads: [first planned round, then one row of grid entries per planned
        round, unit or _NO_UNIT, then a row of _NO_UNIT]. Rounds before the first follow
        unit_of_round's snake. The planned units, the last 1.._PLANNED_TAIL_ROUNDS full rounds and
        the partial one, go longest first to the CTA with the least modeled work so far
        (_TILE_COST_BLOCKS); the number of rounds with the shortest modeled end wins. [_NO_UNIT]
        when no plan ends sooner than the snake.

        Why: the snake pairs a round's long tiles with the next round's short ones, but the last
        full round and the partial one are not paired. Causal d128, 512 keys, 2048 tiles on 132
        SMs: CTAs with 16 tiles end at 59.2 modeled blocks, those with 15 at 54.2 to 57.2
        (per-CTA timeline, session 21: 99.4 against 91.9-95.6 us); planned, 58.2."""
        m_blocks = -(-seqlen_q // tile_m)
        num_tiles = m_blocks * num_heads_batch
        grid = min(num_tiles, num_sms)
        full_rounds = num_tiles // grid
        ranges = BlockRanges(tile_m, tile_n, True)
        # Unit u of the per-head order is m_block m_blocks - 1 - u % m_blocks (tile_coord).
        cost = [_TILE_COST_BLOCKS + ranges.n_block_end((m_blocks - i) * tile_m, seqlen_q, seqlen_k)
                for i in range(m_blocks)]

        def snake_loads(rounds: int) -> list[float]:
            # A round's costs depend only on its parity and on where it starts within a head.
            loads = [0.0] * grid
            for (odd, start), count in Counter((r % 2, r * grid % m_blocks) for r in range(rounds)).items():
                for lane in range(grid):
                    loads[grid - 1 - lane if odd else lane] += count * cost[(start + lane) % m_blocks]
            return loads

        snake_end = snake_loads(full_rounds)
        odd_last = full_rounds % 2
        for unit in range(full_rounds * grid, num_tiles):
            lane = unit - full_rounds * grid
            snake_end[grid - 1 - lane if odd_last else lane] += cost[unit % m_blocks]
        best_end, best = max(snake_end), [_NO_UNIT]
        for planned_full in range(1, min(_PLANNED_TAIL_ROUNDS, full_rounds) + 1):
            first = full_rounds - planned_full
            free = [(load, cta) for cta, load in enumerate(snake_loads(first))]
            heapq.heapify(free)
            units = [[] for _ in range(grid)]
            for unit in sorted(range(first * grid, num_tiles), key=lambda u: -cost[u % m_blocks]):
                load, cta = heapq.heappop(free)
                units[cta].append(unit)
                heapq.heappush(free, (load + cost[unit % m_blocks], cta))
            end = max(load for load, _ in free)
            if end < best_end - 1e-6:  # shorter by more than float rounding
                rows = max(len(u) for u in units) + 1
                best_end, best = end, [first] + [
                    units[cta][row] if row < len(units[cta]) else _NO_UNIT
                    for row in range(rows) for cta in range(grid)
                ]
        return best

    # ------------------------------------------------------------------ host entry

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor,
        mLSEpiece: cute.Tensor,
        mPieceCount: cute.Tensor,
        softmax_scale: cutlass.Float32,
        whole_tiles: Int32,
        split_units: Int32,
        stream: cuda.CUstream,
    ):
        """mOpiece (slots, tile_m, head_dim) and mLSEpiece (slots, tile_m), float32, are the tail
        split's workspace (TailPlan says how much; ignored when split_units is 0, and by kernels
        that never split). The walk's first whole_tiles tiles run whole (the host passes them all
        when it splits none). mPieceCount, int32, holds the counters (zero; the kernel leaves them
        zero again): one per split tile, then the dynamic schedule's; after them the tail plan
        of split_units pieces (TailPlan.words)."""
        # (batch, seqlen, heads, d) -> (seqlen, d, heads, batch): the first two modes are what a
        # tile covers; V is viewed transposed, (d, seqlen_k, heads, batch), as the B operand of P V.
        mQ, mK, mO = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mO)
        ]
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg_mma, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_wg_mma, 1, 1), tiler_mn=(64, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )

        # Swizzled smem layouts wgmma can read: Q, K are K-major; V^T is MN-major (d contiguous).
        qk_tiler = (self.tile_m, self.tile_n, self.head_dim)
        pv_tiler = (self.tile_m, self.head_dim, self.tile_n)
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tiler, self.dtype, self.q_stages)
        sQ_stage_layout = cute.slice_(sQ_layout, (None, None, 0))
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, qk_tiler, self.dtype, self.num_stages
        )
        sVt_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, pv_tiler, self.dtype, self.num_stages
        )

        # TMA descriptors are built here, from the dynamic-layout tensors of this call.
        # The first `rows` rows within Q's (tile_m, head_dim) smem layout: the box of a piece of Q
        # (q_by_group) and of one warp group's O (wg_tma_store).
        def first_rows(rows):
            return cute.composition(sQ_stage_layout, cute.make_layout((rows, self.head_dim), stride=(1, self.tile_m)))

        sQ_piece_layout = first_rows(self.q_piece_rows)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_piece_layout, (self.q_piece_rows, self.head_dim)
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)),
            (self.tile_n, self.head_dim),
        )
        tma_atom_V, tma_Vt = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mVt, cute.slice_(sVt_layout, (None, None, 0)),
            (self.head_dim, self.tile_n),
        )
        # O's box: a whole tile, or one warp group's 64 rows (wg_tma_store).
        sO_box_layout, o_box_rows = sQ_stage_layout, self.tile_m
        if const_expr(self.wg_tma_store):
            sO_box_layout, o_box_rows = first_rows(64), 64
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_box_layout, (o_box_rows, self.head_dim)
        )
        # Not size_in_bytes: that counts the layout's cosize, and a piece's rows are strided.
        self.tx_bytes_Q = cute.size(sQ_piece_layout) * self.dtype.width // 8
        self.tx_bytes_KV = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages * self.q_pieces]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sVt_layout)], 1024]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_stage_layout) if self.separate_o else 0], 1024
            ]
            pieces_done: cute.struct.MemRange[Int32, 1]  # the tail split's counter, read back
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * _SCHED_STAGES]
            sched_units: cute.struct.MemRange[Int32, _SCHED_STAGES]

        num_units = self.num_units(mQ.shape[0], mQ.shape[2], mQ.shape[3],
                                   SimpleNamespace(whole_tiles=whole_tiles, units=split_units))
        grid_x = num_units
        if const_expr(self.num_sms > 0):
            grid_x = cutlass.min(num_units, self.num_sms)
        softmax_scale_log2 = softmax_scale * Float32(LOG2_E)
        gmem_copy_O = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.dtype, 128, self.head_dim)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_Vt, tma_atom_O, tma_O, mO, mQ, mK, gmem_copy_O,
            mLSE, mOpiece, mLSEpiece, mPieceCount, whole_tiles, split_units, softmax_scale_log2,
            tiled_mma_qk, tiled_mma_pv,
            sQ_layout, sK_layout, sVt_layout, SharedStorage,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.dependent_launch,
        )

    # ------------------------------------------------------------------ device entry

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom, mVt: cute.Tensor,
        tma_atom_O: cute.CopyAtom, mO: cute.Tensor,
        mO_gmem: cute.Tensor, mQ_gmem: cute.Tensor, mK_gmem: cute.Tensor, gmem_copy_O: cute.TiledCopy,
        mLSE: cute.Tensor,
        mOpiece: cute.Tensor, mLSEpiece: cute.Tensor, mPieceCount: cute.Tensor,
        whole_tiles: Int32, split_units: Int32,
        softmax_scale_log2: Float32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one elected thread per consumer warp.
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        # With q_by_group, stage q_stage * q_pieces + g holds warp group g's rows of Q stage q_stage,
        # which only g's warps release.
        q_piece_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32 // self.q_pieces)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=self.q_stages * self.q_pieces,
            producer_group=tma_warp, consumer_group=q_piece_warps,
            tx_count=self.tx_bytes_Q, defer_sync=True,
        )
        pipeline_k, pipeline_v = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=self.num_stages,
                producer_group=tma_warp, consumer_group=mma_warps,
                tx_count=self.tx_bytes_KV, defer_sync=True,
            )
            for mbar in (storage.mbar_K, storage.mbar_V)
        ]
        sched = None
        if const_expr(self.dynamic_schedule):
            sched = dict(
                pipe=pipeline.PipelineAsync.create(
                    barrier_storage=storage.mbar_sched.data_ptr(), num_stages=_SCHED_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
                    defer_sync=True,
                ),
                units=storage.sched_units.data_ptr(),
                counter=mPieceCount.iterator + TailPlan.schedule_counter(self.num_sms),
            )
        if const_expr(self.dependent_launch):
            # Nothing above reads or writes global memory; everything below may (the walk plan
            # and the schedule's counter, Q, K, V, O and LSE).
            cute.arch.griddepcontrol_wait()
        walk_plan = None
        if const_expr(self.planned_tail):
            # A causal kernel never splits its tail: the walk plan takes the counters' place.
            walk_plan = SimpleNamespace(first=mPieceCount[0], units=cute.domain_offset((1,), mPieceCount))
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        split = SimpleNamespace(whole_tiles=whole_tiles, units=split_units, mO=mOpiece, mLSE=mLSEpiece,
                                mCount=mPieceCount, done=storage.pieces_done.get_tensor(cute.make_layout(1)))
        sO = sQ
        if const_expr(self.separate_o):
            sQ_stage_layout = cute.slice_(sQ_layout, (None, None, 0))
            sO = storage.sO.get_tensor(sQ_stage_layout.outer, swizzle=sQ_stage_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if warp_idx == 0:
                self.load(
                    tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt,
                    pipeline_q, pipeline_k, pipeline_v, split, role_namespace(sched), walk_plan,
                )
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            self.mma(
                tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_O, mO, mO_gmem, mQ_gmem, mK_gmem, gmem_copy_O,
                mLSE, pipeline_q, pipeline_k, pipeline_v, tidx - 128, mQ.shape[0], mK.shape[0], softmax_scale_log2,
                split, role_namespace(sched), walk_plan,
            )

    # ------------------------------------------------------------------ tile order

    @cute.jit
    def tile_coord(self, tile: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_batch: Int32):
        """(m_block, head, batch) of tile index `tile` (blockIdx.x, then + gridDim.x per step).

        With causal masking the tiles at the end of the sequence do the most work, so they
        should start first (longest processing time first), but tiles running at the same time
        should also share K/V in L2. "head": descending m_block within each (head, batch) pair.
        "l2": descending m_block across groups of pairs whose K and V fit in L2 together (a power
        of two of them, as FA4 does). Measured (causal, bf16, against the former 40 MB groups of
        any size and "head"): 8k d256 700 vs 600/636 TFLOP/s, d128 600 vs 573/577; d64 +2% at
        8k-16k. At 16k d192 / d256 (two heads a group) against "head": +0.8 / +2.8% and +0.8 /
        +2.1% (bf16 / fp16, interleaved A/B, session 38); "head" led there in session 4, with one
        CTA per tile and no dynamic schedule.
        """
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        hb = tile // num_m_blocks
        m_block = tile - hb * num_m_blocks
        batch = hb // num_heads
        head = hb - batch * num_heads
        if const_expr(self.lpt == "head"):
            m_block = num_m_blocks - 1 - m_block
        if const_expr(self.lpt == "l2"):
            kv_tokens_in_l2 = _L2_BYTES // (2 * self.head_dim * self.dtype.width // 8)
            group = cutlass.max(Int32(kv_tokens_in_l2) // cutlass.max(seqlen_k, 1), 1)
            group = Int32(1) << (Int32(31) - Int32(cute.arch.clz(group)))
            num_hb = num_heads * num_batch
            group_idx = tile // (group * num_m_blocks)
            in_group = tile - group_idx * (group * num_m_blocks)
            group_size = cutlass.min(group, num_hb - group_idx * group)
            m_rev = in_group // group_size
            hb = group_idx * group + (in_group - m_rev * group_size)
            m_block = num_m_blocks - 1 - m_rev
            batch = hb // num_heads
            head = hb - batch * num_heads
        return m_block, head, batch

    @cute.jit
    def unit_of_round(self, round_idx: Int32, walk_plan) -> Int32:
        """This CTA's unit of work in round `round_idx` of a persistent walk (one CTA per tile:
        round 0 only); units are tiles, then the tail split's pieces (unit_work). A round is the
        next grid-size units, so the tiles that run together (and share K/V in L2) stay those of
        the tile order; only which CTA takes which changes. A plain stride would hand a CTA the
        same m_block every round whenever the grid is a multiple of the m_blocks per head, so
        one CTA would get every short tile: with the per-head causal order odd rounds run
        backwards (a snake: a CTA that got one of a round's first, longest tiles gets one of the
        next round's last, shortest; measured d64 causal 2k 245 vs 384 TFLOP/s against the plain
        stride), and otherwise each round turns by one CTA, so the heads' partial last tiles
        (which cost only their warp groups with rows, pass_blocks) spread over all CTAs
        (measured, session 9: non-causal d64 +4.6 / +4.9 / +1.3% at 512 / 1k / 2k keys, where
        192-row tiles leave every third, sixth or eleventh tile partial; d128 / d256 equal).
        With planned_tail, rounds from the plan's first on come from `walk_plan` (plan_walk).
        """
        cta, grid = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        lane = cta
        if const_expr(self.lpt == "head"):
            if round_idx % 2 == 1:
                lane = grid - 1 - cta
        else:
            lane = (cta + round_idx) % grid
        unit = round_idx * grid + lane
        if const_expr(self.planned_tail):
            if round_idx >= walk_plan.first:
                unit = walk_plan.units[(round_idx - walk_plan.first) * grid + cta]
        return unit

    @cute.jit
    def fetch_unit(self, sched, num_units: Int32) -> Int32:
        """The dynamic schedule's next unit for this CTA (producer warp): the first grid-size units
        are the CTAs' first; the counter hands out the rest in order. Every CTA fetches once per
        unit it runs, the last time past the end, so num_units fetches in all: the one that gets
        the last value resets the counter for the next launch."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(sched.counter.llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
            if taken == num_units - 1:
                cute.make_tensor(sched.counter, cute.make_layout(1))[0] = 0
        taken = cute.arch.shuffle_sync(taken, 0)
        return taken + cute.arch.grid_dim()[0]

    def sched_units(self, sched):
        """The schedule's shared-memory slots, viewed where they are used (each role's own view)."""
        return cute.make_tensor(sched.units, cute.make_layout(_SCHED_STAGES))

    @cute.jit
    def publish_unit(self, sched, state, unit):
        """Producer warp: hand `unit` to the consumers (one slot of the sched pipeline)."""
        self.acquire_empty(sched.pipe, state)
        units = self.sched_units(sched)
        if cute.arch.lane_idx() == 0:
            units[state.index] = unit
        # Every lane arrives: lane 0's store comes before its arrive, and the slot fills with the last.
        sched.pipe.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def receive_unit(self, sched, state):
        """Consumers: the next unit the producer published."""
        self.wait_full(sched.pipe, state)
        unit = self.sched_units(sched)[state.index]
        sched.pipe.consumer_release(state)
        state.advance()
        return unit, state

    def num_tiles(self, seqlen_q, num_heads, num_batch):
        return cute.ceil_div(seqlen_q, self.tile_m) * num_heads * num_batch

    def num_units(self, seqlen_q, num_heads, num_batch, split):
        """Tiles, or for a tail-splitting kernel the host's count of whole tiles and pieces."""
        if const_expr(self.splits_tail):
            return split.whole_tiles + split.units
        return self.num_tiles(seqlen_q, num_heads, num_batch)

    def tail_plan_words(self, split):
        """The tail plan after the counters, viewed where it is read (TailPlan.words)."""
        return cute.domain_offset((TailPlan.plan_offset(self.num_sms),), split.mCount)

    @cute.jit
    def unit_work(self, unit: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_batch: Int32,
                  block_ranges: BlockRanges, split):
        """What unit `unit` of the walk computes: (m_block, head, batch), the K/V blocks
        [n_block_min, n_block_max) and its workspace `slot`, -1 for a whole tile. After the
        split.whole_tiles whole tiles come split.units pieces of the tiles after them, piece i in
        slot i, its tile and blocks in row i of the tail plan (TailPlan)."""
        tile = unit
        slot = Int32(-1)
        plan = self.tail_plan_words(split) if const_expr(self.splits_tail) else None
        if const_expr(self.splits_tail):
            if unit >= split.whole_tiles:
                slot = unit - split.whole_tiles
                tile = plan[slot * TailPlan.UNIT_WORDS]
        m_block, head, batch = self.tile_coord(tile, seqlen_q, seqlen_k, num_heads, num_batch)
        n_block_min, n_block_max = block_ranges.n_block_min_max(m_block, seqlen_q, seqlen_k)
        if const_expr(self.splits_tail):
            if slot >= 0:
                n_block_min, n_block_max = plan[slot * TailPlan.UNIT_WORDS + 1], plan[slot * TailPlan.UNIT_WORDS + 2]
        return m_block, head, batch, n_block_min, n_block_max, slot

    # ------------------------------------------------------------------ producer

    @cute.jit
    def load(
        self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt,
        pipeline_q, pipeline_k, pipeline_v, split, sched, walk_plan,
    ):
        seqlen_q, seqlen_k, num_heads, num_batch = mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3]
        block_ranges = BlockRanges(self.tile_m, self.tile_n, self.causal)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages * self.q_pieces)
        num_units = self.num_units(seqlen_q, num_heads, num_batch, split)
        round_idx = Int32(0)
        unit = self.unit_of_round(round_idx, walk_plan)
        sched_state = None
        if const_expr(self.dynamic_schedule):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, _SCHED_STAGES)
            sched_state = self.publish_unit(sched, sched_state, unit)
        while unit < num_units:
            next_unit = self.unit_of_round(round_idx + 1, walk_plan)
            n_block_min, n_block_max, (tQsQ, tQgQ), (tKsK, tKgK), (tVsV, tVgV) = self.tile_views(
                unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split
            )
            load_K = partial(self.load_block, tma_atom_K, tKgK, tKsK, pipeline_k)
            load_V = partial(self.load_block, tma_atom_V, tVgV, tVsV, pipeline_v)

            if n_block_max > n_block_min:
                # With one Q stage, K first: Q's buffer may still hold the previous tile (or its
                # O) until the consumers release it.
                if const_expr(self.q_stages == 1):
                    load_K(n_block_max - 1, kv_state)
                for piece in cutlass.range_constexpr(self.q_pieces):
                    self.acquire_empty(pipeline_q, q_state)
                    cute.copy(tma_atom_Q, tQgQ[None, piece], tQsQ[None, piece, q_state.index // self.q_pieces],
                              tma_bar_ptr=pipeline_q.producer_get_barrier(q_state),
                              **self.l2_hint(_L2_EVICT_FIRST))
                    q_state.advance()
                if const_expr(self.q_stages > 1):
                    load_K(n_block_max - 1, kv_state)
                if const_expr(self.prefetch_next):
                    self.prefetch_tile(
                        next_unit, tma_atom_Q, mQ, tma_atom_K, mK,
                        tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split,
                    )
                if const_expr(self.intra_wg_overlap):
                    # Consumers want K of block j before V of block j+1: issue in that order.
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_block = n_block_max - 2 - i
                        state_prev = kv_state.clone()
                        kv_state.advance()
                        load_K(n_block, kv_state)
                        load_V(n_block + 1, state_prev)
                    load_V(n_block_min, kv_state)
                else:
                    load_V(n_block_max - 1, kv_state)
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_block = n_block_max - 2 - i
                        kv_state.advance()
                        load_K(n_block, kv_state)
                        load_V(n_block, kv_state)
                kv_state.advance()
            if const_expr(self.dynamic_schedule):
                # Claimed only now, num_stages blocks before the consumers finish this unit: a CTA
                # that claimed at the start of a long tile would leave the next (longest) units
                # waiting behind it while CTAs with short tiles idle.
                next_unit = self.fetch_unit(sched, num_units)
                sched_state = self.publish_unit(sched, sched_state, next_unit)
            round_idx += 1
            unit = next_unit

    def tile_views(self, unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split):
        """The K/V blocks [n_block_min, n_block_max) of one unit of the walk and the TMA (smem,
        gmem) views of its Q and of K, V by n_block."""
        seqlen_q, seqlen_k, num_heads, num_batch = mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3]
        m_block, head, batch, n_block_min, n_block_max, _ = self.unit_work(
            unit, seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split
        )
        head_kv = kv_head(head, num_heads, mK.shape[2])
        # Q by pieces of a tile's rows (q_by_group), smem (rows, d, piece, stage), gmem (rows, d, piece).
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.q_piece_rows, self.head_dim), (None, 0))
        gQ = cute.local_tile(gQ, (self.q_piece_rows, self.head_dim, self.q_pieces), (0, 0, m_block))
        sQ = cute.flat_divide(sQ, (self.q_piece_rows, self.head_dim))
        sQ = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[0, 1, 2, 4]))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gVt = cute.local_tile(mVt[None, None, head_kv, batch], (self.head_dim, self.tile_n), (0, None))
        no_mcast = cute.make_layout(1)
        views = [
            cpasync.tma_partition(atom, 0, no_mcast, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            for atom, sX, gX in ((tma_atom_Q, sQ, gQ), (tma_atom_K, sK, gK), (tma_atom_V, sVt, gVt))
        ]
        return n_block_min, n_block_max, views[0], views[1], views[2]

    @cute.jit
    def prefetch_tile(self, unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges,
                      split):
        """Warm L2 with Q and the first K, V block of `unit` (this CTA's next one) while the current
        one runs, so the next tile does not start with a DRAM round trip."""
        if unit < self.num_units(mQ.shape[0], mQ.shape[2], mQ.shape[3], split):
            n_block_min, n_block_max, (_, tQgQ), (_, tKgK), (_, tVgV) = self.tile_views(
                unit, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sVt, block_ranges, split
            )
            if n_block_max > n_block_min:
                for piece in cutlass.range_constexpr(self.q_pieces):
                    cute.prefetch(tma_atom_Q, tQgQ[None, piece])
                cute.prefetch(tma_atom_K, tKgK[None, n_block_max - 1])
                cute.prefetch(tma_atom_V, tVgV[None, n_block_max - 1])

    def wait_full(self, pipe, state):
        """consumer_wait, as a plain try_wait loop with spin_waits (see __init__)."""
        if const_expr(self.spin_waits):
            spin_wait(pipe.sync_object_full.get_barrier(state.index), state.phase)
        else:
            pipe.consumer_wait(state)

    def acquire_empty(self, pipe, state):
        """producer_acquire, its empty-slot wait a plain try_wait loop with spin_waits."""
        if const_expr(self.spin_waits):
            spin_wait(pipe.sync_object_empty.get_barrier(state.index), state.phase)
            pipe.producer_acquire(state, True)
        else:
            pipe.producer_acquire(state)

    def load_block(self, tma_atom, tXgX, tXsX, pipe, n_block, state):
        self.acquire_empty(pipe, state)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state), **self.l2_hint(_L2_EVICT_LAST))

    def l2_hint(self, policy: int) -> dict:
        """cute.copy's keyword for a TMA copy's L2 eviction priority (cache_hints), else none."""
        return dict(cache_policy=cutlass.Int64(policy)) if const_expr(self.cache_hints) else {}

    # ------------------------------------------------------------------ consumers

    @cute.jit
    def mma(
        self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_O, mO, mO_gmem, mQ_gmem, mK_gmem, gmem_copy_O, mLSE,
        pipeline_q, pipeline_k, pipeline_v, tidx, seqlen_q, seqlen_k, softmax_scale_log2, split, sched, walk_plan,
    ):
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        # P as the register A operand of the PV wgmma. Its k-blocks of 16 columns are pairs of
        # the S accumulator's 8-column chunks, so both fragments share one register order.
        tOrP = tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((self.tile_m, self.tile_n)))

        softmax = OnlineSoftmax.create(
            softmax_scale_log2, cute.size(reshape_acc_to_mn(acc_O), mode=[0])
        )
        # The factor O still owes the last softmax when O is rescaled early (rescale_o_early).
        row_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)

        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_pv,
        )

        if const_expr(self.pingpong):
            # The last consumer warp group lets the first one go first.
            if wg_idx == self.num_wg_mma - 1:
                cute.arch.barrier_arrive(
                    barrier_id=_SCHED_BARRIER_BASE, number_of_threads=256
                )

        num_heads, num_batch = mO.shape[2], mO.shape[3]
        block_ranges = BlockRanges(self.tile_m, self.tile_n, self.causal)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        # This warp group's first Q stage: its own piece of the first Q buffer (q_by_group).
        q_state = pipeline.PipelineState(
            self.q_stages * self.q_pieces, Int32(0), wg_idx if const_expr(self.q_by_group) else Int32(0), Int32(0)
        )
        num_units = self.num_units(seqlen_q, num_heads, num_batch, split)
        round_idx = Int32(0)
        unit = self.unit_of_round(round_idx, walk_plan)
        sched_state = None
        if const_expr(self.dynamic_schedule):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, _SCHED_STAGES)
            unit, sched_state = self.receive_unit(sched, sched_state)
        while unit < num_units:
            next_unit = unit
            if const_expr(self.planned_tail):
                # Read now: in the planned rounds it comes from global memory.
                next_unit = self.unit_of_round(round_idx + 1, walk_plan)
            m_block, head, batch, n_block_min, n_block_max, slot = self.unit_work(
                unit, seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split
            )
            acc_O.fill(0.0)
            softmax.reset()
            q_buffer = q_state.index // self.q_pieces  # this tile's Q stage (a piece's stage with q_by_group)
            c = SimpleNamespace(
                tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK,
                tOrVt=tOrVt, acc_S=acc_S, acc_O=acc_O, tOrP=tOrP, thr_qk=thr_qk, softmax=softmax,
                pipeline_k=pipeline_k, pipeline_v=pipeline_v, wg_idx=wg_idx, m_block=m_block,
                seqlen_q=seqlen_q, seqlen_k=seqlen_k, row_scale=row_scale, q_index=q_buffer,
                pipeline_q=pipeline_q, q_state=q_state, mQ=mQ_gmem, mK=mK_gmem, head=head, batch=batch,
            )
            if n_block_max > n_block_min:
                self.wait_full(pipeline_q, q_state)
                wg_n_block_max = self.wg_n_block_max(c, n_block_min, n_block_max, block_ranges)
                runs_mainloop = wg_n_block_max > n_block_min
                kv_state = self.pass_blocks(
                    c, kv_state, n_block_max - cutlass.max(wg_n_block_max, n_block_min), runs_mainloop
                )
                if runs_mainloop:
                    kv_state = self.mainloop(c, kv_state, n_block_min, wg_n_block_max, block_ranges)
                if const_expr(self.separate_o or (self.o_from_registers and not self.release_q_early)):
                    # The producer may load the next tile's Q while this one's epilogue runs.
                    pipeline_q.consumer_release(q_state)
                elif const_expr(self.release_q_early):
                    if not runs_mainloop:  # else the mainloop released Q after its last S GEMM
                        pipeline_q.consumer_release(q_state)
            tidx_tile = tidx
            if const_expr(self.recompute_epilogue):
                # From values the compiler cannot see through, so that what the epilogue derives
                # from them is not hoisted out of the tile loop (see __init__).
                tidx_tile = opaque_i32(tidx)
                m_block, head, batch, n_block_min, n_block_max, slot = self.unit_work(
                    opaque_i32(unit), seqlen_q, seqlen_k, num_heads, num_batch, block_ranges, split
                )
            tOcO_mn = reshape_acc_to_mn(
                tiled_mma_pv.get_slice(tidx_tile).partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            )
            softmax.rescale_O(acc_O, softmax.finalize())
            if const_expr(self.o_from_registers):
                store = partial(self.store_O_from_registers, acc_O, softmax.row_sum, tOcO_mn, tidx_tile, mO_gmem,
                                mLSE, m_block, head, batch, seqlen_q)
            else:
                # O through its own buffer, or through this tile's stage of Q's.
                sO_tile = sO if const_expr(self.separate_o) else sO[None, None, q_buffer]
                store = partial(self.epilogue, acc_O, softmax.row_sum, tOcO_mn, smem_copy_O, sO_tile, tma_atom_O,
                                mO, mO_gmem, gmem_copy_O, mLSE, tidx_tile, wg_idx, m_block, head, batch, seqlen_q)
            if const_expr(self.splits_tail):
                # A tile that one piece covers (stream_k) stores itself, like a whole tile.
                whole = slot < 0
                if not whole:
                    whole = self.tail_plan_words(split)[slot * TailPlan.UNIT_WORDS + 3] == 1
                if whole:
                    store()
                else:
                    self.merge_pieces(acc_O, softmax.row_sum, tOcO_mn, tidx_tile, slot, split, mO_gmem, mLSE,
                                      m_block, head, batch, seqlen_q)
            else:
                store()
            if n_block_max > n_block_min:
                if const_expr(not (self.separate_o or self.o_from_registers)):
                    # O went out through Q's buffer; the epilogue waited until TMA had read it.
                    pipeline_q.consumer_release(q_state)
                for _ in cutlass.range_constexpr(self.q_pieces):
                    q_state.advance()
            round_idx += 1
            if const_expr(self.dynamic_schedule):
                unit, sched_state = self.receive_unit(sched, sched_state)
            elif const_expr(self.planned_tail):
                unit = next_unit
            else:
                unit = self.unit_of_round(round_idx, walk_plan)
        if const_expr(self.wg_tma_store):
            # sO must outlive the last store's read.
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop(self, c, kv_state, n_block_min, n_block_max, block_ranges):
        """Algorithm 1's inner loop over the K/V blocks [n_block_min, n_block_max) of one unit,
        last block first."""
        n_block_causal = n_block_max
        if const_expr(self.causal):
            n_block_causal = block_ranges.n_block_min_causal_mask(c.m_block, c.seqlen_q, c.seqlen_k, 0)
        # Blocks [n_block_min, n_block_unmasked) need no mask; the last block is always masked (a
        # piece's last block is inside seqlen_k unless the piece ends the row: masking is harmless).
        n_block_unmasked = cutlass.min(n_block_causal, n_block_max - 1)
        if const_expr(self.intra_wg_overlap):
            # First block: S and softmax only; its PV GEMM overlaps the next block's S GEMM.
            self.wait_full(c.pipeline_k, kv_state)
            self.gemm_qk(c, kv_state.index)
            warpgroup.wait_group(0)
            c.pipeline_k.consumer_release(kv_state)
            self.mask(c, n_block_max - 1, True, self.causal)
            c.softmax.online_softmax(c.acc_S, is_first=True)
            if const_expr(self.rescale_o_early):
                c.row_scale.fill(1.0)  # O is still zero: nothing to rescale before the first PV GEMM
            self.convert_P(c)
            if const_expr(self.causal):
                for i in cutlass.range(n_block_max - 1 - n_block_unmasked, unroll=1):
                    kv_state = self.one_block(c, kv_state, n_block_max - 2 - i, True)
            for i in cutlass.range(n_block_unmasked - n_block_min, unroll=1):
                kv_state = self.one_block(c, kv_state, n_block_unmasked - 1 - i, False)
            if const_expr(self.release_q_early):
                # The S GEMMs are done and O will not pass through Q's buffer: the next Q may load.
                c.pipeline_q.consumer_release(c.q_state)
            if const_expr(self.rescale_o_early):
                c.softmax.rescale_O(c.acc_O, c.row_scale)
            self.wait_full(c.pipeline_v, kv_state)
            self.gemm_pv(c, kv_state.index)
            warpgroup.wait_group(0)
            c.pipeline_v.consumer_release(kv_state)
            kv_state.advance()
        else:
            kv_state = self.one_block_serial(c, kv_state, n_block_max - 1, True, self.causal, True)
            for i in cutlass.range(n_block_max - 1 - n_block_unmasked, unroll=1):
                kv_state = self.one_block_serial(c, kv_state, n_block_max - 2 - i, False, True, False)
            for i in cutlass.range(n_block_unmasked - n_block_min, unroll=1):
                kv_state = self.one_block_serial(
                    c, kv_state, n_block_unmasked - 1 - i, False, False, False
                )
            if const_expr(self.release_q_early):
                c.pipeline_q.consumer_release(c.q_state)
        return kv_state

    @cute.jit
    def wg_n_block_max(self, c, n_block_min, n_block_max, block_ranges):
        """End of the K/V blocks this warp group's 64 rows need: n_block_min when none of its rows
        exist (the last m_block of a ragged seqlen_q); causal, the end of its own rows' diagonal,
        which for the first groups of a tile can lie a block before the tile's."""
        wg_row = c.m_block * self.tile_m + c.wg_idx * 64
        wg_n_block_max = n_block_min
        if wg_row < c.seqlen_q:
            wg_n_block_max = n_block_max
            if const_expr(self.causal):
                wg_n_block_max = cutlass.min(
                    n_block_max, block_ranges.n_block_end(wg_row + 64, c.seqlen_q, c.seqlen_k)
                )
        return wg_n_block_max

    @cute.jit
    def pass_blocks(self, c, kv_state, num_blocks, mainloop_follows):
        """The mainloop's waits, releases and ping-pong turns without its GEMMs and softmax, for
        blocks this warp group does not need (wg_n_block_max): every block of the tile, when none
        of its rows exist, or, causal, the first blocks visited, which only the tile's later rows
        see. The other groups run as before and the tile costs about what its needed blocks do.
        The mainloop takes a turn for every block but its first: a group passing the whole tile
        takes one less, one passing blocks before its mainloop one per block."""
        for i in cutlass.range(num_blocks, unroll=1):
            self.wait_full(c.pipeline_k, kv_state)
            c.pipeline_k.consumer_release(kv_state)
            if const_expr(self.intra_wg_overlap):
                if mainloop_follows or i > 0:
                    self.sched_wait(c.wg_idx)
                    self.sched_signal(c.wg_idx)
            self.wait_full(c.pipeline_v, kv_state)
            c.pipeline_v.consumer_release(kv_state)
            kv_state.advance()
        return kv_state

    # ------------------------------------------------------------------ one K/V block

    def gemm_qk(self, c, stage):
        gemm(c.tiled_mma_qk, c.acc_S, c.tSrQ[None, None, None, c.q_index], c.tSrK[None, None, None, stage],
             zero_init=True)

    def gemm_pv(self, c, stage):
        gemm(c.tiled_mma_pv, c.acc_O, c.tOrP, c.tOrVt[None, None, None, stage], zero_init=False)

    def convert_P(self, c):
        # Not `tOrP.store(acc_S.load().to(dtype))`: LLVM sinks that pure conversion to its use, the
        # PV GEMM of the next block, which is issued after that block's S GEMM. S of the previous
        # block then stays live (and is copied) while the new S GEMM is in flight: 64 extra
        # registers, and ptxas serializes every wgmma of the kernel (C7512) once the masked loop
        # overlaps. The conversion below is an asm statement with side effects, so it stays here.
        convert_f32_to_16bit(c.acc_S, c.tOrP)

    @cute.jit
    def one_block(self, c, kv_state, n_block, mask_causal: cutlass.Constexpr):
        """S GEMM of n_block overlapped with the PV GEMM of the block before it."""
        kv_state_v = kv_state.clone()
        kv_state.advance()
        self.wait_full(c.pipeline_k, kv_state)
        self.sched_wait(c.wg_idx)
        self.gemm_qk(c, kv_state.index)
        if const_expr(self.rescale_o_early):
            self.rescale_O(c, c.row_scale)
        # V's wait inside the turn, after the S GEMM is issued: the producer loads this block's K
        # before the previous block's V, so waiting for V before the turn delays the turn and
        # every group behind it (session 28: -2.4 to -4.0% at long non-causal d64).
        self.wait_full(c.pipeline_v, kv_state_v)
        self.gemm_pv(c, kv_state_v.index)
        self.sched_signal(c.wg_idx)
        warpgroup.wait_group(1)  # S is ready; the PV GEMM may still run
        c.pipeline_k.consumer_release(kv_state)
        if const_expr(mask_causal):
            self.mask(c, n_block, False, True)
        if const_expr(self.stale_max and not mask_causal):
            # stale_max: the exponentials first, while the PV GEMM runs; its wait before P's registers
            # are rewritten (and O, in the rare rescale).
            block_sum = cute.make_rmem_tensor_like(c.softmax.row_sum, Float32)
            outgrown = c.softmax.exponentiate_stale(c.acc_S, block_sum)
            warpgroup.wait_group(0)
            c.softmax.settle_stale(outgrown, c.acc_S, c.acc_O, block_sum, partial(self.rescore, c, n_block))
            c.pipeline_v.consumer_release(kv_state_v)
            self.convert_P(c)
            return kv_state
        # Wait for the previous block's PV GEMM between the row maxima and the exponentials, with
        # the exponentials made to depend on O (f32_after): otherwise ptxas places that wait where
        # it likes, after 0-12 of the exponentials, by dtype and by unrelated options. Measured
        # (interleaved A/B, bf16 / fp16, session 18): non-causal d128 +1.5-2.1% at 4k, +2.6-3.6%
        # at 8k; d256 +0.6-2.1% at 8k, causal 2k +0.3-3.7%; d64 non-causal +1.5% at 512, +2.5% at
        # 2k, fp16 +0.7-1.4% at 4k-16k; causal d64 4k +1.7%; elsewhere within +-1.2% (noise).
        if const_expr(self.lazy_rescale):
            row_max_new, grows = c.softmax.grown_row_max(c.acc_S)
            warpgroup.wait_group(0)
            c.softmax.rescale_if_grown(c.acc_O, row_max_new, grows)
            max_scaled = c.softmax.max_scaled()
            row_scale = None
        else:
            max_scaled, row_scale = c.softmax.update_row_max(c.acc_S)
            warpgroup.wait_group(0)
        for r in cutlass.range_constexpr(cute.size(max_scaled)):
            max_scaled[r] = f32_after(max_scaled[r], c.acc_O[0])
        c.softmax.exponentiate(c.acc_S, max_scaled, row_scale)
        c.pipeline_v.consumer_release(kv_state_v)
        self.convert_P(c)
        if const_expr(self.rescale_o_early):
            c.row_scale.store(row_scale.load())
        elif const_expr(not self.lazy_rescale):
            self.rescale_O(c, row_scale)
        return kv_state

    @cute.jit
    def rescore(self, c, n_block):
        """S of this thread's entries of block n_block again, on CUDA cores from Q and K in global
        memory: the redo of a block whose exponentials overflowed against the stale running max
        (stale_max: a score 128 / scale_log2 above it, rare enough that speed does not matter).
        Rows past seqlen_q, which no one stores, score against the last row of Q."""
        tScS = c.thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        head_kv = kv_head(c.head, c.mQ.shape[2], c.mK.shape[2])
        for i in cutlass.range_constexpr(cute.size(c.acc_S)):
            q_row = c.mQ[cutlass.min(c.m_block * self.tile_m + tScS[i][0], c.seqlen_q - 1), None, c.head, c.batch]
            k_row = c.mK[n_block * self.tile_n + tScS[i][1], None, head_kv, c.batch]
            score = Float32.zero
            for k in cutlass.range(self.head_dim, unroll=1):
                score += q_row[k].to(Float32) * k_row[k].to(Float32)
            c.acc_S[i] = score

    def rescale_O(self, c, row_scale):
        if const_expr(self.rescale_if_moved):
            c.softmax.rescale_O_if_needed(c.acc_O, row_scale)
        else:
            c.softmax.rescale_O(c.acc_O, row_scale)

    @cute.jit
    def one_block_serial(
        self, c, kv_state, n_block, mask_seqlen: cutlass.Constexpr,
        mask_causal: cutlass.Constexpr, is_first: cutlass.Constexpr,
    ):
        """S GEMM, softmax, PV GEMM of one block with no overlap inside the warp group."""
        self.wait_full(c.pipeline_k, kv_state)
        self.gemm_qk(c, kv_state.index)
        warpgroup.wait_group(0)
        c.pipeline_k.consumer_release(kv_state)
        if const_expr(mask_seqlen or mask_causal):
            self.mask(c, n_block, mask_seqlen, mask_causal)
        row_scale = c.softmax.online_softmax(c.acc_S, is_first=is_first)
        self.convert_P(c)
        if const_expr(not is_first):
            self.rescale_O(c, row_scale)
        self.wait_full(c.pipeline_v, kv_state)
        self.gemm_pv(c, kv_state.index)
        warpgroup.wait_group(0)
        c.pipeline_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ------------------------------------------------------------------ ping-pong

    def sched_wait(self, wg_idx):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_SCHED_BARRIER_BASE + wg_idx, number_of_threads=256)

    def sched_signal(self, wg_idx):
        if const_expr(self.pingpong):
            next_wg = wg_idx + 1
            if const_expr(self.num_wg_mma == 2):
                next_wg = 1 - wg_idx
            else:
                next_wg = (wg_idx + 1) % self.num_wg_mma
            cute.arch.barrier_arrive(barrier_id=_SCHED_BARRIER_BASE + next_wg, number_of_threads=256)

    def mask(self, c, n_block, mask_seqlen: bool, mask_causal: bool):
        apply_mask(c.acc_S, c.thr_qk, self.tile_m, self.tile_n, c.m_block, n_block,
                   c.seqlen_q, c.seqlen_k, mask_seqlen, mask_causal)

    # ------------------------------------------------------------------ tail split

    @cute.jit
    def merge_pieces(self, acc_O, lse, tOcO_mn, tidx, slot, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """Hand-off of the tail-split piece in workspace slot `slot`: its normalized O and its LSE
        go to the workspace; the CTA that completes the tile's last piece reads every piece back
        and stores the merged tile itself (O = sum_p exp(lse_p - lse) O_p, lse the log-sum-exp
        of the lse_p)."""
        acc_O_mn = reshape_acc_to_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tOcO_mn[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                split.mO[slot, row, tOcO_mn[r, j][1]] = acc_O_mn[r, j]
            split.mLSE[slot, row] = lse[r]
        # Release this piece's writes to the CTA that merges (the classic fence, barrier, atomic).
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=_SPLIT_BARRIER, number_of_threads=self.num_mma_threads)
        # Read only now: loaded before the stores above, its words took registers O needed there.
        plan_row = cute.domain_offset((slot * TailPlan.UNIT_WORDS,), self.tail_plan_words(split))
        tail_tile = plan_row[0] - split.whole_tiles
        if tidx == 0:
            counter = split.mCount.iterator + tail_tile
            split.done[0] = cute.arch.atomic_add(counter.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=_SPLIT_BARRIER, number_of_threads=self.num_mma_threads)
        if split.done[0] == plan_row[3] - 1:
            if tidx == 0:
                split.mCount[tail_tile] = 0  # every piece has counted: ready for the next call
            cute.arch.fence_acq_rel_gpu()
            self.store_merged(tidx, plan_row, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q)

    @cute.jit
    def store_merged(self, tidx, plan_row, split, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """The merge of the pieces in the slots of `plan_row` (TailPlan), in 16-byte pieces of rows
        that consecutive threads read together, straight to O and LSE in global memory. Every
        piece's LSE and O are loaded at once (the row repeats the last slot, read with weight 0),
        for merge_batch chunks before any is stored: a loop over the pieces, or reading them in the
        accumulator's scattered layout, left the loads one after another (~30 us a merge), and so
        did each chunk's loads behind the stores of the chunk before, which might alias them: a
        stream-K tail with a merge per SM lost 40 us a call (d256 bf16: -22% at 4k keys, -6% at
        8k, session 37)."""
        vec = 4
        row_vecs = self.head_dim // vec
        last_piece = plan_row[3] - 1
        slots = [plan_row[4 + p] for p in range(_MAX_SPLITS)]
        chunks = self.tile_m * row_vecs // self.num_mma_threads
        for first in cutlass.range_constexpr(0, chunks, self.merge_batch):
            loaded = []
            for i in cutlass.range_constexpr(first, min(first + self.merge_batch, chunks)):
                chunk = tidx + i * self.num_mma_threads
                row = chunk // row_vecs
                col_vec = chunk - row * row_vecs
                lses = [split.mLSE[slot, row] for slot in slots]
                outs = [cute.local_tile(split.mO[slot, None, None], (1, vec), (row, col_vec)).load() for slot in slots]
                loaded.append((row, col_vec, lses, outs))
            for row, col_vec, lses, outs in loaded:
                lse_max = lses[0]
                for p in cutlass.range_constexpr(1, _MAX_SPLITS):
                    lse_max = cutlass.max(lse_max, lses[p])
                lse_max = 0.0 if lse_max == -Float32.inf else lse_max
                weight_sum = Float32(0.0)
                merged = outs[0]
                for p in cutlass.range_constexpr(_MAX_SPLITS):
                    weight = cute.math.exp2((lses[p] - lse_max) * LOG2_E, fastmath=True)
                    weight = weight if p <= last_piece else Float32(0.0)
                    weight_sum += weight
                    if const_expr(p == 0):
                        merged = outs[p] * weight
                    else:
                        merged = merged + outs[p] * weight
                # A row no piece saw a key of keeps the kernel's convention: O = 0, LSE = -inf.
                no_key = weight_sum == 0.0
                inv_weight_sum = 0.0 if no_key else cute.arch.rcp_approx(weight_sum)
                row_global = m_block * self.tile_m + row
                if row_global < seqlen_q:
                    gO = cute.local_tile(mO_gmem[None, None, head, batch], (1, vec), (row_global, col_vec))
                    gO.store((merged * inv_weight_sum).to(self.dtype))
                    if col_vec == 0:
                        lse_row = lse_max + cute.math.log2(weight_sum, fastmath=True) * math.log(2.0)
                        mLSE[batch, head, row_global] = -Float32.inf if no_key else lse_row

    # ------------------------------------------------------------------ epilogue

    @cute.jit
    def store_lse(self, lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q):
        """LSE straight from registers: the thread holding column 0 of a row writes it."""
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = lse[r]

    @cute.jit
    def store_O_from_registers(self, acc_O, lse, tOcO_mn, tidx, mO_gmem, mLSE, m_block, head, batch, seqlen_q):
        """O and LSE from the accumulator to global memory, without smem (o_from_registers).

        In the wgmma accumulator, the four threads of a quad hold one row's 8-column chunk as four
        packed pairs, lane t the pair at columns 2t, 2t+1. For each run of four chunks the quad
        transposes its 4 x 4 pairs (two butterfly shuffle steps), after which lane t holds all of
        chunk t: one 16-byte store instead of four 4-byte ones."""
        self.store_lse(lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q)
        acc_O_mn = reshape_acc_to_mn(acc_O)
        lane = tidx % 4
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        chunk = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        chunk_elems = cute.make_tensor(cute.recast_ptr(chunk.iterator, dtype=self.dtype), cute.make_layout(8))
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            row = m_block * self.tile_m + tOcO_mn[r, 0][0]
            for run in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1]) // 8):
                # pairs[i]: this lane's pair of chunk 4 * run + i (columns 8 * chunk + 2 * lane).
                pairs = []
                for i in cutlass.range_constexpr(4):
                    pairs.append(
                        cvt_pack_16bit(acc_O_mn[r, 8 * run + 2 * i], acc_O_mn[r, 8 * run + 2 * i + 1], self.dtype)
                    )
                # Step 1 swaps the off-diagonal 2 x 2 blocks between lanes t and t ^ 2, step 2
                # transposes each 2 x 2 block between lanes t and t ^ 1.
                for bit, firsts in ((2, (0, 1)), (1, (0, 2))):
                    upper = (lane & bit) != 0
                    for k in firsts:
                        low, high = pairs[k], pairs[k + bit]
                        got = cute.arch.shuffle_sync_bfly(high if not upper else low, offset=bit)
                        pairs[k] = got if upper else low
                        pairs[k + bit] = high if upper else got
                for i in cutlass.range_constexpr(4):
                    chunk[i] = pairs[i]
                if row < seqlen_q:
                    gO = cute.local_tile(mO_gmem[None, None, head, batch], (1, 8), (row, 4 * run + lane))
                    cute.copy(store_atom, chunk_elems, gO[0, None])

    @cute.jit
    def epilogue(
        self, acc_O, lse, tOcO_mn, smem_copy_O, sO, tma_atom_O, mO, mO_gmem, gmem_copy_O, mLSE, tidx,
        wg_idx, m_block, head, batch, seqlen_q,
    ):
        self.store_lse(lse, tOcO_mn, mLSE, m_block, head, batch, seqlen_q)

        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        thr_copy_O = smem_copy_O.get_slice(tidx)
        if const_expr(self.wg_epilogue):
            # Each warp group stages its own rows of O in sO (its rows of Q's buffer when O has
            # none: its own S GEMMs, the only readers of those rows, are done) and stores them,
            # clipped at seqlen_q: with 16-byte vector stores, or (wg_tma_store) with one TMA box
            # that the group's first warp issues, waiting for TMA to have read the rows only before
            # the group writes them again (or, through Q's buffer, before Q is released). The first
            # barrier keeps a fast thread from overwriting rows that a slow one (or TMA) is still
            # reading for the previous tile.
            if const_expr(self.wg_tma_store):
                if tidx % 128 < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            group_barrier = partial(
                cute.arch.barrier, barrier_id=_EPILOGUE_BARRIER + wg_idx, number_of_threads=128
            )
            group_barrier()
            cute.copy(smem_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))
            if const_expr(self.wg_tma_store):
                cute.arch.fence_proxy("async.shared", space="cta")
            group_barrier()
            if const_expr(self.wg_tma_store):
                if tidx % 128 < 32:
                    gO = cute.local_tile(mO[None, None, head, batch], (64, self.head_dim), (None, 0))
                    tOsO, tOgO = cpasync.tma_partition(
                        tma_atom_O, 0, cute.make_layout(1),
                        cute.group_modes(cute.flat_divide(sO, (64, self.head_dim)), 0, 2), cute.group_modes(gO, 0, 2),
                    )
                    cute.copy(tma_atom_O, tOsO[None, wg_idx, 0], tOgO[None, m_block * self.num_wg_mma + wg_idx],
                              **self.l2_hint(_L2_EVICT_FIRST))
                    cute.arch.cp_async_bulk_commit_group()
                    if const_expr(not self.separate_o):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                sO_rows = cute.local_tile(sO, (64, self.head_dim), (wg_idx, 0))
                gO_rows = cute.local_tile(
                    mO_gmem[None, None, head, batch], (64, self.head_dim), (m_block * self.num_wg_mma + wg_idx, 0)
                )
                store_tile_rows(gmem_copy_O, tidx % 128, sO_rows, gO_rows,
                                seqlen_q - m_block * self.tile_m - wg_idx * 64)
        else:
            # O: registers -> smem -> one TMA store, clipped at seqlen_q. sO is its own buffer or
            # Q's (each warp group overwrites only its own rows, which its last S GEMM has finished
            # reading). The storing warp waits until TMA has read sO; the barrier first makes every
            # warp wait for that, so a warp group with a short tile cannot overwrite rows that the
            # previous tile's store has not read yet.
            cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)
            cute.copy(smem_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO))
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.num_mma_threads)
            if tidx < 32:
                gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O, 0, cute.make_layout(1),
                    cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO, **self.l2_hint(_L2_EVICT_FIRST))
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)


@dsl_user_op
def spin_wait(mbar_ptr: cute.Pointer, phase: Int32, *, loc=None, ip=None) -> None:
    """Wait for the mbarrier phase with mbarrier.try_wait and no suspend-time hint, in a loop (a
    memory clobber keeps the compiler from moving loads of what the barrier guards above it)."""
    llvm.inline_asm(
        None, [mbar_ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred ready;\nwait_again:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [$0], $1;\n"
        "@!ready bra wait_again;\n}",
        "r,r,~{memory}", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def opaque_i32(value: Int32, *, loc=None, ip=None) -> Int32:
    """`value`, through an asm move the compiler cannot see through."""
    return Int32(llvm.inline_asm(
        cutlass.Int32.mlir_type, [Int32(value).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1; // opaque_i32", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def f32_after(value: Float32, dependency: Float32, *, loc=None, ip=None) -> Float32:
    """`value` (exactly, for a finite `dependency`), as fma(dependency, 0, value) in asm: code that
    uses the result cannot be scheduled before `dependency` is available, e.g. before the
    wgmma.wait_group that guards an accumulator, which ptxas otherwise places where it likes."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type,
        [Float32(value).ir_value(loc=loc, ip=ip), Float32(dependency).ir_value(loc=loc, ip=ip)],
        "fma.rn.f32 $0, $2, 0f00000000, $1;", "=f,f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def role_namespace(handles: dict | None) -> SimpleNamespace | None:
    """The producer's or the consumers' own namespace of shared handles: the tracer rebinds the
    fields of a namespace that a staged loop carries, and the other role's branch must not see
    values defined inside the first one's loop."""
    return None if handles is None else SimpleNamespace(**handles)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr):
    """Issue one warp-group GEMM (all k-blocks) as one wgmma commit group; does not wait."""
    warpgroup.fence()
    # A fresh atom carries the accumulate flag: setting it on the shared tiled MMA inside a
    # staged loop would leak a loop-local value into later uses of that tiled MMA.
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init or k != 0)
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
    warpgroup.commit_group()
