"""FlashAttention-2 backward postprocess for sm_80: dQ = softmax_scale * dQaccum in the input dtype.

The main kernel accumulates dQ (w.r.t. the scaled scores) in an fp32 workspace of shape
(batch, nheads, num_m_blocks * m_block_size * head_dim_padded), thread-major per column chunk of
a query block (see kernels/sm80/bwd.py: dq_chunks). One CTA per query block re-creates the main
kernel's dQ tiled MMA, so thread t reads back exactly the accumulator elements it would have held
there, chunk by chunk (coalesced),
scales and converts them, and puts them at their (row, col) of a swizzled smem tile, from which
16-byte vectors go to dQ with the caller's strides (the accumulator layout alone would only
allow 4-byte stores). A packed variable-length batch (config.varlen, `call_varlen`) reads sequence
b's workspace from its padded start (layouts.packed_stat_offset) and writes its rows of the packed dQ.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.common.layouts import (
    dq_accum_row, gmem_tiled_copy, packed_stat_offset, sequence_bounds, sequence_rows, sequence_stat, smem_layout_atom,
)
from cute_flash.kernels.sm80.config import Sm80BwdPostConfig
from cute_flash.kernels.common.stores import stage_acc_in_smem, store_smem_tile
from cute_flash.kernels.sm80.bwd import FlashAttnBwdSm80, dq_accum_offset
from cute_flash.kernels.sm80.fwd import tiled_mma_sm80


class FlashAttnBwdPostprocessSm80:
    num_threads = FlashAttnBwdSm80.num_threads

    def __init__(self, config: Sm80BwdPostConfig):
        self.cfg = config
        dtype, head_dim, m_block_size = config.dtype, config.head_dim, config.m_block_size
        atom_m_dq, dq_chunks = config.atom_m_dq, config.dq_chunks
        assert head_dim % 8 == 0 and head_dim <= 256
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_padded = dq_accum_row(head_dim)
        self.m_block_size = m_block_size
        self.atom_m_dq = atom_m_dq
        self.dq_chunks = dq_chunks
        self.varlen = config.varlen

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        self.launch(mdQaccum, mdQ, softmax_scale, stream)

    @cute.jit
    def call_varlen(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    max_seqlen_q: cutlass.Int32, softmax_scale: Float32, stream: cuda.CUstream):
        """Packed sequences: mdQaccum (1, nheads, (total_q + STAT_ROW_PAD * batch) * head_dim_padded),
        mdQ (1, total_q, nheads, head_dim)."""
        self.launch(mdQaccum, mdQ, softmax_scale, stream, mCuSeqlensQ, max_seqlen_q)

    @cute.jit
    def launch(self, mdQaccum, mdQ, softmax_scale: Float32, stream: cuda.CUstream, mCuSeqlensQ=None,
               max_seqlen_q=None):
        m, d = self.m_block_size, self.head_dim_padded
        atom = smem_layout_atom(self.dtype, d)
        sdQ_layout = cute.tile_to_shape(atom, (m, d), (0, 1))
        tiled_mma = tiled_mma_sm80(self.dtype, self.num_threads, self.atom_m_dq)
        s2g = gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.dtype, self.num_threads, cute.size(atom.outer.shape[1]))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        if cutlass.const_expr(self.varlen):
            grid = (cute.ceil_div(max_seqlen_q, m), mdQ.shape[2], mCuSeqlensQ.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mdQ.shape[1], m), mdQ.shape[2], mdQ.shape[0])
        self.kernel(mdQaccum, mdQ, softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage, mCuSeqlensQ).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, tiled_mma: cute.TiledMma,
               s2g: cute.TiledCopy, sdQ_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr, mCuSeqlensQ: cute.Tensor | None):
        m, d = self.m_block_size, self.head_dim_padded
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        block = partial(self._block, mdQaccum, mdQ, softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage, tidx,
                        m_block, head, batch)
        if cutlass.const_expr(self.varlen):
            offset, seqlen_q = sequence_bounds(mCuSeqlensQ, batch)
            if m_block * m < seqlen_q:  # query blocks past the sequence's end have nothing to write
                block(seqlen_q, (offset, packed_stat_offset(offset, batch) * d))
        else:
            block(mdQ.shape[1], (None, None))

    @cute.jit
    def _block(self, mdQaccum, mdQ, softmax_scale, tiled_mma, s2g, sdQ_layout, SharedStorage: cutlass.Constexpr,
               tidx, m_block, head, batch, seqlen_q, offsets):
        """dQ of one query block of one (sequence, head); offsets (None, None) or the sequence's
        first packed row and first workspace element."""
        m, d = self.m_block_size, self.head_dim_padded
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        gAcc = cute.local_tile(sequence_stat(mdQaccum, batch, head, offsets[1]), (m * d,), (m_block,))
        cols = d // self.dq_chunks
        for chunk in cutlass.range_constexpr(self.dq_chunks):
            acc = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C((m, cols)), Float32)
            first = dq_accum_offset(chunk, cute.size(acc), tidx)
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = gAcc[first + i * self.num_threads] * softmax_scale
            stage_acc_in_smem(acc, cute.local_tile(sdQ, (m, cols), (0, chunk)), tiled_mma, tidx)
        cute.arch.barrier()
        gdQ = cute.local_tile(sequence_rows(mdQ, batch, head, offsets[0]), (m, d), (m_block, 0))
        store_smem_tile(sdQ, gdQ, s2g, seqlen_q - m_block * m, self.head_dim, tidx)
