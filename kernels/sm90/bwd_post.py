"""FlashAttention backward postprocess for Hopper: dQ = softmax_scale * (dQ's fp32 sums), in the
input dtype.

The main kernel (kernels/sm90/bwd.py) adds each query block's dQ to an fp32 workspace
(batch, heads, m_blocks * m_block_size * head_dim) in its accumulator order (`dq_staging_view`).
One CTA per query block rebuilds the main kernel's dQ tiled MMA, so thread t reads back exactly
the elements it would have held there (16-byte loads), scales and converts them into a swizzled
smem tile at their (row, col), from which 16-byte vectors go to dQ with the caller's strides.
Packed batches (`call_varlen`): a sequence's sums start at its padded row packed_stat_offset.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.layouts import (
    VECTOR_BITS, gmem_tiled_copy, packed_stat_offset, rows_from, sequence_bounds, smem_layout_atom,
)
from ..common.stores import stage_acc_in_smem, store_smem_tile
from .bwd import dq_staging_view, dq_swizzle_columns, dq_tiled_mma
from .config import Sm90BwdConfig, Sm90BwdPostConfig


class FlashAttnBwdPostprocessSm90:
    num_threads = Sm90BwdConfig.num_wg_mma * 128

    def __init__(self, config: Sm90BwdPostConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        self.launch(mdQaccum, mdQ, softmax_scale, stream)

    @cute.jit
    def call_varlen(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_seqlen_q: Int32,
                    softmax_scale: Float32, stream: cuda.CUstream):
        """Packed sequences (config.varlen): mdQ (1, total_q, heads, d); sequence b's sums start at
        row packed_stat_offset(cu_seqlens_q[b], b) of mdQaccum (1, heads, rows * d)."""
        self.launch(mdQaccum, mdQ, softmax_scale, stream, (mCuSeqlensQ, max_seqlen_q))

    @cute.jit
    def launch(self, mdQaccum, mdQ, softmax_scale: Float32, stream: cuda.CUstream, varlen_args=(None, None)):
        m, d = self.cfg.m_block_size, self.cfg.head_dim
        atom = smem_layout_atom(self.cfg.dtype, dq_swizzle_columns(self.cfg))
        sdQ_layout = cute.tile_to_shape(atom, (m, d), (0, 1))
        # 16-byte vectors (never split by the swizzle) over row segments wide enough that one pass
        # of the CTA's threads stays within the m rows (d = 96: 32 columns, not the 16 of its atom).
        row_elems = math.gcd(d, 64)
        assert self.num_threads * VECTOR_BITS // self.cfg.dtype.width // row_elems <= m
        s2g = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.cfg.dtype, self.num_threads, row_elems)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.cfg.dtype, cute.cosize(sdQ_layout)], 1024]

        grid = (cute.ceil_div(mdQ.shape[1], m), mdQ.shape[2], mdQ.shape[0])
        mCuSeqlensQ, max_seqlen_q = varlen_args
        if const_expr(self.cfg.varlen):
            grid = (cute.ceil_div(max_seqlen_q, m), mdQ.shape[2], mCuSeqlensQ.shape[0] - 1)
        self.kernel(mdQaccum, mdQ, softmax_scale, dq_tiled_mma(self.cfg), s2g, sdQ_layout, SharedStorage,
                    mCuSeqlensQ).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            use_pdl=True,  # launched while the main kernel's CTAs drain: see griddepcontrol_wait in kernel
        )

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, tiled_mma: cute.TiledMma,
               s2g: cute.TiledCopy, sdQ_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr,
               mCuSeqlensQ: cute.Tensor | None):
        m_block, head, batch = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()  # the main kernel's last dQ sums may still be landing
        if const_expr(self.cfg.varlen):
            offset, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            # the grid covers the longest sequence: blocks past this one's end store nothing
            if m_block * self.cfg.m_block_size < seqlen_q:
                self.block(rows_from(mdQaccum, packed_stat_offset(offset, batch) * self.cfg.head_dim, 2),
                           rows_from(mdQ, offset, 1), softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage,
                           m_block, head, 0, seqlen_q)
        else:
            self.block(mdQaccum, mdQ, softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage, m_block, head, batch,
                       mdQ.shape[1])

    @cute.jit
    def block(self, mdQaccum, mdQ, softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage: cutlass.Constexpr,
              m_block, head, batch, seqlen_q):
        """Query block m_block of (head, batch): its sums scaled, converted and stored up to seqlen_q."""
        m, d = self.cfg.m_block_size, self.cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        sdQ = cutlass.memory.SmemAllocator().allocate(SharedStorage).sdQ.get_tensor(sdQ_layout)
        thr_mma = tiled_mma.get_slice(tidx)
        acc = thr_mma.make_fragment_C(thr_mma.partition_shape_C((m, d)))
        gAcc = cute.local_tile(mdQaccum[batch, head, None], (m * d,), (m_block,))
        tAgAcc = dq_staging_view(gAcc, self.num_threads, tidx)
        acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(tAgAcc.shape))
        cute.autovec_copy(tAgAcc, acc_flat)
        acc.store(acc.load() * softmax_scale)
        stage_acc_in_smem(acc, sdQ, tiled_mma, tidx)
        cute.arch.barrier()
        gdQ = cute.local_tile(mdQ[batch, None, head, None], (m, d), (m_block, 0))
        store_smem_tile(sdQ, gdQ, s2g, seqlen_q - m_block * m, d, tidx)
