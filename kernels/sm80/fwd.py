"""FlashAttention-2 forward for sm80+ (mma.sync m16n8k16, cp.async, ldmatrix).

One CTA computes one (tile_m, head_dim) tile of O for one (batch, head): Algorithm 1 of the
FlashAttention-2 paper with the outer loop over query tiles spread across the grid
(m_block, head, batch) and the inner loop over key/value tiles run from the last key block down
to the first, so that the only blocks needing masks (key tail, causal diagonal) come first.

Data movement per key block n (num_stages K/V buffers in smem, cp.async groups):
    wait K[n]            -> issue V[n - num_stages + 1]
    S = Q K[n]^T          (ldmatrix Q, K; mma.sync, fp32 accumulators)
    mask (boundary blocks only), online softmax, rescale O (only when a row max moved),
    P = bf16/fp16(S) kept in registers
    wait V[n]            -> issue K[n - num_stages]
    O += P V[n]           (P straight from registers as the A operand; ldmatrix.trans for V)
Epilogue: O /= row_sum, stage O through smem (reusing sQ) for 16-byte stores, write LSE.

fp32 inputs take the same loop with split TF32 products (kernels/common/tf32.py: three m16n8k8
TF32 mma.sync per product, operands read through the MMA's partitions instead of ldmatrix, P kept
in fp32 as the A operand of P V) and their own tiles (`_fp32_tiles`).

Score modifications (config.window / softcap / alibi, kernels/common/mask.py) are compiled in only
where the configuration asks, and their values come at run time through `call_with_mods`
(`__call__` is the plain kernel's entry). A sliding window loads only the key blocks some row of the
query tile sees (blocks.py: n_block_min_max_window) and masks only the blocks crossing an edge of
the window; softcap and ALiBi touch every score. Dropout (config.dropout, kernels/common/philox.py)
zeroes dropped probabilities after the online softmax has taken their row sums, so the LSE is that
of the full softmax, and scales O by 1 / (1 - p) with the final 1 / row_sum.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warp

from ..common.blocks import BlockRanges, kv_head
from ..common.layouts import (
    gmem_tiled_copy,
    reshape_acc_to_frgA,
    reshape_acc_to_mn,
    sequence_bounds,
    sequence_rows,
    sequence_stat,
    smem_layout_atom,
    store_tile_rows,
    transpose_view,
)
from ..common.mask import alibi_head_slope, apply_alibi, apply_mask, apply_softcap, kernel_mod_args
from ..common.philox import DropoutRng, apply_dropout
from ..common.softmax import LOG2_E, OnlineSoftmax
from ..common.tf32 import acc_as_frgA, gemm_split_tf32, tiled_mma_tf32
from .config import Sm80FwdConfig, smem_capacity, targets_sm90


def tiled_mma_sm80(dtype, num_threads: int, atom_m: int) -> cute.TiledMma:
    """m16n8k16 mma.sync over `num_threads // 32` warps, `atom_m` of them stacked along M;
    m16n8k8 TF32 (split TF32) for fp32."""
    warps = num_threads // 32
    if dtype is cutlass.Float32:
        return tiled_mma_tf32(atom_m, warps // atom_m)
    atoms = (atom_m, warps // atom_m, 1)
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        atoms,
        permutation_mnk=(atoms[0] * 16, atoms[1] * 16, 16),
    )


@cute.jit
def gemm_sm80(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_B,
    tCsA: cute.Tensor | None = None,
    smem_thr_copy_A=None,
):
    """acc += A @ B^T with mma.sync, B (and A unless tCsA is None: A already in registers)
    read from smem with ldmatrix just ahead of use.

    B is read in ldmatrix chunks (one chunk = one copy tile along N of one k-step, i.e. 16 rows
    of B feeding two n8 mmas), one k-step of chunks ahead of the mma that consumes them.
    """
    tCrB_view = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCsB, mode=[2])
    num_chunks = cute.size(tCsB, mode=[1])
    mma_per_chunk = cute.size(tCrB, mode=[1]) // num_chunks
    acc_chunks = cute.logical_divide(acc, (None, None, mma_per_chunk))
    tCrB_chunks = cute.logical_divide(tCrB, (None, mma_per_chunk, None))
    lookahead = num_chunks
    total = num_k * num_chunks
    if cutlass.const_expr(tCsA is not None):
        tCrA_view = smem_thr_copy_A.retile(tCrA)
        cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    for i in cutlass.range_constexpr(lookahead):
        cute.copy(smem_thr_copy_B, tCsB[None, i % num_chunks, i // num_chunks],
                  tCrB_view[None, i % num_chunks, i // num_chunks])
    for i in cutlass.range_constexpr(total):
        k, j = i // num_chunks, i % num_chunks
        if cutlass.const_expr(tCsA is not None and j == 0 and k + 1 < num_k):
            cute.copy(smem_thr_copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
        nxt = i + lookahead
        if cutlass.const_expr(nxt < total):
            cute.copy(smem_thr_copy_B, tCsB[None, nxt % num_chunks, nxt // num_chunks],
                      tCrB_view[None, nxt % num_chunks, nxt // num_chunks])
        cute.gemm(tiled_mma, acc_chunks[None, None, (None, j)], tCrA[None, None, k],
                  tCrB_chunks[None, (None, j), k], acc_chunks[None, None, (None, j)])


class FlashAttnFwdSm80:
    def __init__(self, config: Sm80FwdConfig):
        self.cfg = config
        dtype, head_dim, causal = config.dtype, config.head_dim, config.causal
        tile_m, tile_n, num_warps, num_stages = config.tile_m, config.tile_n, config.num_warps, config.num_stages
        self.dtype = dtype
        # fp32 inputs: split TF32 products (kernels/common/tf32.py) read from smem through the
        # MMA's own partitions instead of ldmatrix
        self.fp32 = dtype is cutlass.Float32
        if config.block_accumulator and not self.fp32:
            raise ValueError("block_accumulator sums the split-TF32 products of fp32 inputs; 16-bit P V has none")
        self.block_accumulator = config.block_accumulator
        self.head_dim = head_dim
        # mma k-steps are 16 wide and the swizzled smem rows 32 or 64 elements: pad head_dim
        self.tile_hdim = head_dim if head_dim % 64 == 0 else (head_dim + 31) // 32 * 32
        self.check_hdim = self.tile_hdim != head_dim
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.num_stages = num_stages
        self.window, self.softcap, self.alibi = config.window, config.softcap, config.alibi
        self.dropout = config.dropout
        self.varlen = config.varlen

    @staticmethod
    def smem_bytes(head_dim, tile_m, tile_n, num_stages, dtype=cutlass.BFloat16, **_) -> int:
        tile_hdim = head_dim if head_dim % 64 == 0 else (head_dim + 31) // 32 * 32
        elem = dtype.width // 8
        q = tile_m * tile_hdim * elem
        kv = 2 * num_stages * tile_n * tile_hdim * elem
        return kv + q

    @staticmethod
    def can_implement(dtype, head_dim, causal, tile_m=128, tile_n=64, num_warps=4,
                      num_stages=2, arch: str = "sm_80", block_accumulator: bool = False) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16, cutlass.Float32):
            return False
        if block_accumulator and dtype is not cutlass.Float32:
            return False
        if head_dim % 8 != 0 or not 8 <= head_dim <= 256:
            return False
        if num_stages < 1 or tile_n % 16 != 0 or tile_m % (16 * num_warps) != 0:
            return False
        smem = FlashAttnFwdSm80.smem_bytes(head_dim, tile_m, tile_n, num_stages, dtype)
        return smem <= smem_capacity(arch)

    @staticmethod
    def default_tiles(dtype, head_dim, causal, dropout: bool = False, arch: str = "sm_80",
                      tf32_products: int = 3) -> dict:
        tiles = FlashAttnFwdSm80._tiles(dtype, head_dim, causal, dropout, arch, tf32_products)
        # sm_86 / sm_89 hold 99 KB per CTA: fewer keys per block (then one K/V stage) until it fits
        while FlashAttnFwdSm80.smem_bytes(head_dim, **tiles, dtype=dtype) > smem_capacity(arch):
            if tiles["tile_n"] > 16:
                tiles["tile_n"] //= 2
            elif tiles["num_stages"] > 1:
                tiles["num_stages"] = 1
            else:
                break
        return tiles

    @staticmethod
    def _tiles(dtype, head_dim, causal, dropout: bool, arch: str, tf32_products: int) -> dict:
        if dropout:
            # The Philox rounds need registers the plain tiles use up (249 of 255 at d = 64): half
            # the key tile of the sm_80 tiles (on every target); a quarter at d <= 32, where ptxas
            # aims at 168 registers (the causal kernel spilled 40 bytes with half).
            tiles = FlashAttnFwdSm80._tiles(dtype, head_dim, causal, False, "sm_80", tf32_products)
            return dict(tiles, tile_n=tiles["tile_n"] // (4 if head_dim <= 32 else 2))
        if dtype is cutlass.Float32:
            return FlashAttnFwdSm80._fp32_tiles(head_dim, arch, tf32_products)
        # 4 warps, 32 query rows each: every K/V fragment read from smem feeds two mma rows.
        # The key tile shrinks as head_dim grows so acc_O + acc_S fit in 255 registers.
        if head_dim <= 96:
            return dict(tile_m=128, tile_n=64, num_warps=4, num_stages=2)
        if head_dim <= 128:
            return dict(tile_m=128, tile_n=32, num_warps=4, num_stages=2)
        return dict(tile_m=64, tile_n=64, num_warps=4, num_stages=2)

    @staticmethod
    def _fp32_tiles(head_dim, arch: str, tf32_products: int) -> dict:
        # fp32 tiles hold twice the bytes: Q + two K/V stages stay within sm80's 163 KB.
        # Split TF32 up to d128 sums each key block's P V apart from O (block_accumulator: without
        # it O erred 20x torch's fp32 SDPA at 4k keys, with it 1.4-2.8x). Its second accumulator of
        # O's size is spill-free on 64 x 64 tiles only (128 x 64 at d64 spilled 324-768 bytes,
        # sm_90a's 128 x 32 at d72-d128 1.3-5.2 KB, 64 x 32 at d > 128 1.6-2.8 KB; ptxas,
        # 2026-11-29), which costs 9-31% of the speed on the H200 (docs/kernels/sm80-forward.md).
        # Plain TF32 (one product, ~2^-11 per product) keeps the faster tiles: on sm_90a d72-d128
        # fit 32 query rows per warp, so every K/V fragment feeds two MMA rows (128 x 32: +36-38%
        # over 64 x 64 at d128 on the H200); for sm_80 that tile spills 40-64 bytes at d72, d120, d128.
        if head_dim <= 128 and tf32_products == 3:
            return dict(tile_m=64, tile_n=64, num_warps=4, num_stages=2, block_accumulator=True)
        if head_dim <= 64:
            return dict(tile_m=128, tile_n=64, num_warps=4, num_stages=2)
        if head_dim <= 128:
            if targets_sm90(arch):
                return dict(tile_m=128, tile_n=32, num_warps=4, num_stages=2)
            return dict(tile_m=64, tile_n=64, num_warps=4, num_stages=2)
        return dict(tile_m=64, tile_n=32, num_warps=4, num_stages=1)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        self.launch(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, stream)

    @cute.jit
    def call_with_mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        philox_seed: Int64 | None,
        philox_offset: Int64 | None,
        dropout_threshold: Int32 | None,
        dropout_scale: Float32 | None,
        stream: cuda.CUstream,
    ):
        """The entry point of a kernel with score modifications: None for each the configuration
        leaves out. window_left / window_right: the window's sides, an unbounded side given as a
        bound no row reaches; softcap > 0; mAlibiSlopes: (1 or batch, nheads) float32; dropout:
        the Philox seed and offset, the keep threshold (an unsigned word as int32) and
        1 / (1 - dropout_p) (kernels/common/philox.py)."""
        self.launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, softcap, mAlibiSlopes, stream,
                    dropout_args=(philox_seed, philox_offset, dropout_threshold, dropout_scale))

    @cute.jit
    def call_varlen(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap: Float32 | None,
        mAlibiSlopes: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """The entry point of a packed variable-length batch (config.varlen): mQ, mO (1, total_q,
        nheads, head_dim), mK, mV (1, total_k, nheads_kv, head_dim), mLSE (1, nheads, total_q);
        sequence b holds rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (int32, batch + 1 entries).
        max_seqlen_q (at least every sequence's length) sizes the grid. Score modifications as
        call_with_mods."""
        self.launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, softcap, mAlibiSlopes, stream,
                    mCuSeqlensQ, mCuSeqlensK, max_seqlen_q)

    @cute.jit
    def launch(self, mQ, mK, mV, mO, mLSE, softmax_scale: Float32, window_left, window_right, softcap,
               mAlibiSlopes, stream: cuda.CUstream, mCuSeqlensQ=None, mCuSeqlensK=None, max_seqlen_q=None,
               dropout_args=(None,) * 4):
        if cutlass.const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                                   == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must all have the kernel's dtype")
        sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma = self._setup()

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        if cutlass.const_expr(self.varlen):
            # one CTA column per query block of the longest sequence; shorter ones exit at once
            grid = (cute.ceil_div(max_seqlen_q, self.tile_m), cute.size(mQ.shape[2]), mCuSeqlensQ.shape[0] - 1)
        else:
            num_m_blocks = cute.ceil_div(mQ.shape[1], self.tile_m)
            grid = (num_m_blocks, cute.size(mQ.shape[2]), cute.size(mQ.shape[0]))
        # with softcap, flash-attn 2's parametrization: scores tanh(s * scale / softcap), softmax at scale softcap
        score_scale, mods = kernel_mod_args(self.window, self.softcap, self.alibi, softmax_scale, window_left,
                                            window_right, softcap, mAlibiSlopes, self.dropout, dropout_args)
        softmax_scale_log2 = score_scale * LOG2_E
        self.kernel(
            mQ, mK, mV, mO, mLSE, softmax_scale_log2,
            sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma,
            SharedStorage, mCuSeqlensQ, mCuSeqlensK, **mods,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    def _setup(self):
        """Host-side pieces of the launch (also the decode kernel's, kernels/sm80/decode.py): smem
        layouts, gmem copies, the tiled MMA."""
        dtype = self.dtype
        atom = smem_layout_atom(dtype, self.tile_hdim)
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, self.tile_hdim), (0, 1))
        sKV_layout = cute.tile_to_shape(
            atom, (self.tile_n, self.tile_hdim, self.num_stages), (0, 1, 2)
        )

        # gmem <-> smem: 16-byte vectors, one smem atom row (32 or 64 elements) per group of threads
        row_elems = atom.outer.shape[1]
        gmem_tiled_copy_QKV = gmem_tiled_copy(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, self.num_threads, row_elems
        )
        gmem_tiled_copy_O = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), dtype, self.num_threads, row_elems)
        # warps side by side along M; the N permutation makes one tile 16 wide so each B
        # ldmatrix.x4 feeds two n8 mmas
        tiled_mma = tiled_mma_sm80(dtype, self.num_threads, self.num_warps)
        return sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_tiled_copy_QKV: cute.TiledCopy,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        softcap_pre: Float32 | None = None,
        mAlibiSlopes: cute.Tensor | None = None,
        alibi_scale: Float32 | None = None,
        philox_seed: Int64 | None = None,
        philox_offset: Int64 | None = None,
        dropout_threshold: Int32 | None = None,
        dropout_scale: Float32 | None = None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.causal):
            # heaviest query blocks (most keys) first, for a better tail
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        tile = partial(
            self._attend_tile, mQ, mK, mV, mO, mLSE, softmax_scale_log2, sQ_layout, sKV_layout, gmem_tiled_copy_QKV,
            gmem_tiled_copy_O, tiled_mma, SharedStorage, window_left, window_right, softcap_pre, mAlibiSlopes,
            alibi_scale, (philox_seed, philox_offset, dropout_threshold, dropout_scale), tidx, m_block, head, batch,
        )
        if cutlass.const_expr(self.varlen):
            offset_q, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            offset_k, seqlen_k = sequence_bounds(mCuSeqlensK, batch)
            # the grid covers the longest sequence: blocks past this one's end load nothing
            if m_block * self.tile_m < seqlen_q:
                tile(seqlen_q, seqlen_k, (offset_q, offset_k))
        else:
            tile(mQ.shape[1], mK.shape[1], None)

    @cute.jit
    def _attend_tile(
        self, mQ, mK, mV, mO, mLSE, softmax_scale_log2, sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O,
        tiled_mma, SharedStorage: cutlass.Constexpr, window_left, window_right, softcap_pre, mAlibiSlopes, alibi_scale,
        dropout_args, tidx, m_block, head, batch, seqlen_q, seqlen_k, offsets,
    ):
        """One (tile_m, head_dim) tile of O and its LSE for (m_block, head, batch) of a sequence of
        seqlen_q queries and seqlen_k keys. offsets: None for a dense batch (mQ[batch], ...), else
        (first query row, first key row) of the sequence in the packed tensors."""
        offset_q, offset_k = offsets if cutlass.const_expr(offsets is not None) else (None, None)
        head_kv = kv_head(head, mQ.shape[2], mK.shape[2])

        ranges = BlockRanges(self.tile_m, self.tile_n, self.causal)
        window = (window_left, window_right) if cutlass.const_expr(self.window) else None
        if cutlass.const_expr(self.window):
            n_block_min, n_block_max = ranges.n_block_min_max_window(m_block, seqlen_q, seqlen_k, *window)
            # no key seen: one fully masked iteration on a block that exists, as below
            n_block_min = cutlass.min(n_block_min, cutlass.max(n_block_max - 1, 0))
        else:
            n_block_min, n_block_max = ranges.n_block_min_max(m_block, seqlen_q, seqlen_k)
        alibi_slope = alibi_head_slope(mAlibiSlopes, alibi_scale, batch, head)
        rng = None
        if cutlass.const_expr(self.dropout):
            philox_seed, philox_offset, dropout_threshold, _ = dropout_args
            rng = DropoutRng.create(philox_seed, philox_offset, dropout_threshold, batch * mQ.shape[2] + head)
        # a block whose rows see no key still runs one (fully masked) iteration: out = 0, lse = -inf
        n_block_first = cutlass.max(n_block_max - 1, n_block_min)

        blk_q = (self.tile_m, self.tile_hdim)
        blk_kv = (self.tile_n, self.tile_hdim)
        gQ = cute.local_tile(sequence_rows(mQ, batch, head, offset_q), blk_q, (m_block, 0))
        gK = cute.local_tile(sequence_rows(mK, batch, head_kv, offset_k), blk_kv, (None, 0))
        gV = cute.local_tile(sequence_rows(mV, batch, head_kv, offset_k), blk_kv, (None, 0))

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = transpose_view(sV)  # (head_dim, tile_n, stage): V as the B operand of P @ V

        # ---- gmem -> smem partitions and predicates ----
        gmem_thr_copy = gmem_tiled_copy_QKV.get_slice(tidx)
        tQgQ = gmem_thr_copy.partition_S(gQ)
        tQsQ = gmem_thr_copy.partition_D(sQ)
        tKgK = gmem_thr_copy.partition_S(gK)
        tKsK = gmem_thr_copy.partition_D(sK)
        tVgV = gmem_thr_copy.partition_S(gV)
        tVsV = gmem_thr_copy.partition_D(sV)
        cQ = cute.make_identity_tensor(blk_q)
        cKV = cute.make_identity_tensor(blk_kv)
        tQcQ = gmem_thr_copy.partition_S(cQ)
        t0QcQ = gmem_tiled_copy_QKV.get_slice(0).partition_S(cQ)
        tKVcKV = gmem_thr_copy.partition_S(cKV)
        t0KVcKV = gmem_tiled_copy_QKV.get_slice(0).partition_S(cKV)
        tQpQ = self._predicate_hdim(tQsQ, tQcQ)
        tKVpKV = self._predicate_hdim(tKsK, tKVcKV)

        # ---- MMA partitions ----
        thr_mma = tiled_mma.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.tile_m, self.tile_hdim)), Float32
        )
        acc_O.fill(0.0)

        if cutlass.const_expr(self.fp32):
            # split TF32 reads its operands through the MMA's partitions (32-bit loads)
            tSrQ = tSrK = tOrVt = None
            smem_thr_copy_Q = smem_thr_copy_K = smem_thr_copy_V = None
            tSsQ = thr_mma.partition_A(sQ)
            tSsK = thr_mma.partition_B(sK)
            tOsVt = thr_mma.partition_B(sVt)
        else:
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
            ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
            ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
            smem_thr_copy_Q = cute.make_tiled_copy_A(
                cute.make_copy_atom(ldsm, self.dtype), tiled_mma).get_slice(tidx)
            smem_thr_copy_K = cute.make_tiled_copy_B(
                cute.make_copy_atom(ldsm, self.dtype), tiled_mma).get_slice(tidx)
            smem_thr_copy_V = cute.make_tiled_copy_B(
                cute.make_copy_atom(ldsm_t, self.dtype), tiled_mma).get_slice(tidx)
            tSsQ = smem_thr_copy_Q.partition_S(sQ)
            tSsK = smem_thr_copy_K.partition_S(sK)
            tOsVt = smem_thr_copy_V.partition_S(sVt)

        load_kv = partial(self._load_kv, gmem_tiled_copy_QKV, tKVcKV, t0KVcKV, tKVpKV, seqlen_k)

        # ---- prologue: Q, then K/V of the first num_stages key blocks ----
        # rows past seqlen_q are left unloaded: they only produce rows that are never stored
        q_row_limit = seqlen_q - m_block * self.tile_m - tQcQ[0][0]
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if t0QcQ[0, m, 0][0] < q_row_limit:
                cute.copy(gmem_tiled_copy_QKV, tQgQ[None, m, None], tQsQ[None, m, None],
                          pred=tQpQ[None, m, None] if cutlass.const_expr(self.check_hdim) else None)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.check_hdim):
            self._zero_hdim_padding(tQsQ, tQpQ)
            self._zero_hdim_padding(tKsK, tKVpKV)
            self._zero_hdim_padding(tVsV, tKVpKV)
        load_kv(tKgK, tKsK, n_block_first, 0, True)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.num_stages > 1):
            load_kv(tVgV, tVsV, n_block_first, 0, True)
            cute.arch.cp_async_commit_group()
        for stage in cutlass.range_constexpr(1, self.num_stages):
            if n_block_first - stage >= n_block_min:
                load_kv(tKgK, tKsK, n_block_first - stage, stage, False)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(stage < self.num_stages - 1):
                if n_block_first - stage >= n_block_min:
                    load_kv(tVgV, tVsV, n_block_first - stage, stage, False)
                cute.arch.cp_async_commit_group()

        softmax = OnlineSoftmax.create(
            softmax_scale_log2, cute.size(reshape_acc_to_mn(acc_O), mode=[0])
        )
        softmax.reset()

        # ---- main loop over key blocks, last to first ----
        step = partial(
            self._step,
            n_block_min=n_block_min, m_block=m_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            thr_mma=thr_mma, tiled_mma=tiled_mma, softmax=softmax, acc_O=acc_O,
            tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt,
            smem_thr_copy_Q=smem_thr_copy_Q, smem_thr_copy_K=smem_thr_copy_K,
            smem_thr_copy_V=smem_thr_copy_V,
            load_kv=load_kv, tKgK=tKgK, tKsK=tKsK, tVgV=tVgV, tVsV=tVsV,
            window=window, softcap_pre=softcap_pre, alibi_slope=alibi_slope, rng=rng,
        )

        smem_read = Int32(0)
        smem_write = Int32(self.num_stages - 1)
        step(n_block_first, smem_read, smem_write, True, True, self.causal, self.window)
        smem_read = self._advance(smem_read)
        smem_write = self._advance(smem_write)
        n_block_unmasked_end = n_block_first
        n_block_masked_end = n_block_min
        if cutlass.const_expr(self.window):
            # blocks crossing the right edge, then fully visible ones, then those crossing the left edge
            n_block_right_mask, n_block_left_mask = ranges.n_block_window_masks(m_block, seqlen_q, seqlen_k, *window)
            n_block_unmasked_end = cutlass.max(cutlass.min(n_block_right_mask, n_block_first), n_block_min)
            n_block_masked_end = cutlass.max(cutlass.min(n_block_left_mask, n_block_unmasked_end), n_block_min)
            for i in cutlass.range(n_block_first - n_block_unmasked_end, unroll=1):
                step(n_block_first - 1 - i, smem_read, smem_write, False, False, False, True)
                smem_read = self._advance(smem_read)
                smem_write = self._advance(smem_write)
        if cutlass.const_expr(self.causal):
            n_block_unmasked_end = cutlass.min(
                n_block_first,
                ranges.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, n_block_min),
            )
            for i in cutlass.range(n_block_first - n_block_unmasked_end, unroll=1):
                step(n_block_first - 1 - i, smem_read, smem_write, False, False, True, False)
                smem_read = self._advance(smem_read)
                smem_write = self._advance(smem_write)
        for i in cutlass.range(n_block_unmasked_end - n_block_masked_end, unroll=1):
            step(n_block_unmasked_end - 1 - i, smem_read, smem_write, False, False, False, False)
            smem_read = self._advance(smem_read)
            smem_write = self._advance(smem_write)
        if cutlass.const_expr(self.window):
            for i in cutlass.range(n_block_masked_end - n_block_min, unroll=1):
                step(n_block_masked_end - 1 - i, smem_read, smem_write, False, False, False, True)
                smem_read = self._advance(smem_read)
                smem_write = self._advance(smem_write)

        # ---- epilogue ----
        row_scale = softmax.finalize()
        if cutlass.const_expr(self.dropout):
            # kept probabilities count 1 / (1 - p) times; the LSE keeps every probability
            row_scale.store(row_scale.load() * dropout_args[3])
        softmax.rescale_O(acc_O, row_scale)
        self._store_O_LSE(acc_O, softmax.row_sum, mO, mLSE, sQ, gmem_tiled_copy_O, tiled_mma,
                          thr_mma, tidx, m_block, head, batch, seqlen_q, offset_q)

    @cute.jit
    def _step(
        self, n_block, smem_read, smem_write,
        is_first: cutlass.Constexpr, mask_seqlen: cutlass.Constexpr, mask_causal: cutlass.Constexpr,
        mask_window: cutlass.Constexpr,
        n_block_min, m_block, seqlen_q, seqlen_k, thr_mma, tiled_mma, softmax, acc_O,
        tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt,
        smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V,
        load_kv, tKgK, tKsK, tVgV, tVsV, window, softcap_pre, alibi_slope, rng,
    ):
        stages = self.num_stages

        def wait_and_sync():
            # everything but the newest 2*stages-2 groups has landed, and every warp is done
            # with the buffer we are about to overwrite
            cute.arch.cp_async_wait_group(stages * 2 - 2)
            cute.arch.barrier()

        acc_S = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32
        )
        acc_S.fill(0.0)
        wait_and_sync()  # K[n_block] ready
        n_block_v = n_block - (stages - 1)
        if cutlass.const_expr(stages == 1):
            load_kv(tVgV, tVsV, n_block, 0, is_first)
        else:
            if n_block_v >= n_block_min:
                load_kv(tVgV, tVsV, n_block_v, smem_write, False)
        cute.arch.cp_async_commit_group()

        # S = Q K^T
        tSsK_cur = tSsK[None, None, None, smem_read if cutlass.const_expr(stages > 1) else 0]
        self._gemm_qk(tiled_mma, acc_S, tSrQ, tSrK, tSsK_cur, smem_thr_copy_K, tSsQ, smem_thr_copy_Q)

        next_write = self._advance(smem_write)
        n_block_k = n_block - stages
        if cutlass.const_expr(stages == 1):
            wait_and_sync()  # V[n_block] ready, every warp done with K
            if n_block - 1 >= n_block_min:
                load_kv(tKgK, tKsK, n_block - 1, 0, False)
            cute.arch.cp_async_commit_group()

        # flash-attn 2's order: cap, bias, then mask (tanh(-inf) would be -1)
        if cutlass.const_expr(self.softcap):
            apply_softcap(acc_S, softcap_pre)
        if cutlass.const_expr(self.alibi):
            apply_alibi(acc_S, thr_mma, self.tile_m, self.tile_n, m_block, n_block, seqlen_q, seqlen_k, alibi_slope)
        if cutlass.const_expr(mask_seqlen or mask_causal or mask_window):
            apply_mask(acc_S, thr_mma, self.tile_m, self.tile_n, m_block, n_block,
                       seqlen_q, seqlen_k, mask_seqlen, mask_causal,
                       window=window if cutlass.const_expr(mask_window) else None)
        # a window can leave a row without keys in any block
        row_scale = softmax.online_softmax(acc_S, is_first=is_first,
                                           check_inf=mask_seqlen or mask_causal or self.causal or self.window)
        if cutlass.const_expr(not is_first):
            softmax.rescale_O_if_needed(acc_O, row_scale)
        tOrP, rP = self._p_operand(acc_S)
        if cutlass.const_expr(self.dropout):
            # After the row sums took P: dropped probabilities leave P V only. On the 16-bit P (half
            # the registers of the fp32 one) while the Philox rounds run.
            apply_dropout(acc_S if cutlass.const_expr(self.fp32) else rP, thr_mma, self.tile_m, self.tile_n, m_block,
                          n_block, rng, encode_in_sign=False)

        if cutlass.const_expr(stages > 1):
            wait_and_sync()  # V[n_block] ready, every warp done with K[smem_read]
            if n_block_k >= n_block_min:
                load_kv(tKgK, tKsK, n_block_k, next_write, False)
            cute.arch.cp_async_commit_group()

        # O += P V
        tOsVt_cur = tOsVt[None, None, None, smem_read if cutlass.const_expr(stages > 1) else 0]
        self._gemm_pv(tiled_mma, acc_O, tOrP, tOrVt, tOsVt_cur, smem_thr_copy_V)

    @cute.jit
    def _gemm_qk(self, tiled_mma, acc_S, tSrQ, tSrK, tSsK, smem_thr_copy_K, tSsQ, smem_thr_copy_Q):
        """S = Q K^T on one K stage: TF32 products read from smem for fp32 (split or plain:
        config.tf32_products), ldmatrix + mma.sync for 16-bit inputs."""
        if cutlass.const_expr(self.fp32):
            gemm_split_tf32(tiled_mma, acc_S, tSsK, tCsA=tSsQ, products=self.cfg.tf32_products)
        else:
            gemm_sm80(tiled_mma, acc_S, tSrQ, tSrK, tSsK, smem_thr_copy_K, tSsQ, smem_thr_copy_Q)

    @cute.jit
    def _gemm_pv(self, tiled_mma, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V):
        """O += P V on one V stage, P from registers (_p_operand); as _gemm_qk."""
        if cutlass.const_expr(self.fp32):
            gemm_split_tf32(tiled_mma, acc_O, tOsVt, tCrA=tOrP, fresh_sum=self.block_accumulator,
                            products=self.cfg.tf32_products)
        else:
            gemm_sm80(tiled_mma, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V)

    def _p_operand(self, acc_S):
        """P as the A operand of P V, and its 16-bit copy: fp32 P stays in the S accumulator (split
        per k step of P V), no copy; else P rounded to the input dtype."""
        if cutlass.const_expr(self.fp32):
            return acc_as_frgA(acc_S), None
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        return reshape_acc_to_frgA(rP), rP

    @cute.jit
    def _advance(self, stage):
        if cutlass.const_expr(self.num_stages == 1):
            return stage
        else:
            return stage + 1 if stage < self.num_stages - 1 else 0

    @cute.jit
    def _predicate_hdim(self, tXsX, tXcX):
        # one predicate per 16-byte vector column; rows are handled with branches
        pred = cute.make_rmem_tensor(
            cute.make_layout(
                (tXsX.shape[0][1], cute.size(tXsX, mode=[1]), cute.size(tXsX, mode=[2])),
                stride=(cute.size(tXsX, mode=[2]), 0, 1),
            ),
            cutlass.Boolean,
        )
        for v in cutlass.range_constexpr(pred.shape[0]):
            for k in cutlass.range_constexpr(pred.shape[2]):
                pred[v, 0, k] = tXcX[(0, v), 0, k][1] < self.head_dim
        return pred

    @cute.jit
    def _zero_hdim_padding(self, tXsX, tXpX):
        # padded head-dim columns are never written by the (predicated) copies: zero them once
        # so they contribute exact zeros to Q K^T and P V
        for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            if not tXpX[0, 0, k]:
                if cutlass.const_expr(cute.rank(tXsX) == 4):
                    tXsX[None, None, k, None].fill(0.0)
                else:
                    tXsX[None, None, k].fill(0.0)

    @cute.jit
    def _load_kv(self, gmem_tiled_copy, tXcX, t0XcX, tXpX, seqlen_k, tXgX, tXsX, n_block, stage,
                 need_seqlen_pred: cutlass.Constexpr):
        hdim_pred = tXpX if cutlass.const_expr(self.check_hdim) else None
        dst = tXsX[None, None, None, stage]
        if cutlass.const_expr(need_seqlen_pred):
            row_limit = seqlen_k - n_block * self.tile_n - tXcX[0][0]
            for n in cutlass.range_constexpr(cute.size(dst.shape[1])):
                if t0XcX[0, n, 0][0] < row_limit:
                    cute.copy(gmem_tiled_copy, tXgX[None, n, None, n_block], dst[None, n, None],
                              pred=hdim_pred[None, n, None] if cutlass.const_expr(self.check_hdim) else None)
                else:
                    # rows past seqlen_k meet P = 0: they must be finite (zero), not stale smem
                    dst[None, n, None].fill(0.0)
        else:
            cute.copy(gmem_tiled_copy, tXgX[None, None, None, n_block], dst, pred=hdim_pred)

    @cute.jit
    def _store_O_LSE(self, acc_O, lse, mO, mLSE, sQ, gmem_tiled_copy_O, tiled_mma, thr_mma,
                     tidx, m_block, head, batch, seqlen_q, offset_q):
        # LSE: the quad thread holding column 0 of a row writes it
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdim))
        taccOcO = reshape_acc_to_mn(thr_mma.partition_C(cO))
        gLSE = cute.local_tile(sequence_stat(mLSE, batch, head, offset_q), (self.tile_m,), (m_block,))
        if taccOcO[0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = taccOcO[r, 0][0]
                if row < seqlen_q - m_block * self.tile_m:
                    gLSE[row] = lse[r]

        # O: registers -> smem (reusing sQ) -> 16-byte vector stores
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier()  # every warp is done reading sQ / sV
        sO = sQ
        smem_copy_atom_O = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        cute.arch.barrier()

        gO = cute.local_tile(sequence_rows(mO, batch, head, offset_q), (self.tile_m, self.tile_hdim), (m_block, 0))
        store_tile_rows(gmem_tiled_copy_O, tidx, sO, gO, seqlen_q - m_block * self.tile_m,
                        self._predicate_hdim if cutlass.const_expr(self.check_hdim) else None)
