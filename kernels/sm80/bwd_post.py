"""FlashAttention-2 backward postprocess for sm_80: dQ = softmax_scale * dQaccum in the input dtype.

The main kernel accumulates dQ (w.r.t. the scaled scores) in an fp32 workspace of shape
(batch, nheads, num_m_blocks * m_block_size * head_dim_padded), thread-major per query block
(see kernels/sm80/bwd.py). One CTA per query block re-creates the main kernel's dQ tiled MMA,
so thread t reads back exactly the accumulator elements it would have held there (coalesced),
scales and converts them, and stores them at their (row, col) with the caller's strides.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.common.layouts import round_up
from cute_flash.kernels.sm80.bwd import FlashAttnBwdSm80, store_acc, tiled_mma_sm80


class FlashAttnBwdPostprocessSm80:
    num_threads = FlashAttnBwdSm80.num_threads

    def __init__(self, dtype, head_dim: int, m_block_size: int, atom_m_dq: int):
        assert head_dim % 8 == 0 and head_dim <= 256
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_padded = round_up(head_dim, 32)
        self.m_block_size = m_block_size
        self.atom_m_dq = atom_m_dq

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
        grid = (cute.ceil_div(mdQ.shape[1], self.m_block_size), mdQ.shape[2], mdQ.shape[0])
        tiled_mma = tiled_mma_sm80(self.dtype, self.num_threads, self.atom_m_dq)
        self.kernel(mdQaccum, mdQ, softmax_scale, tiled_mma).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, tiled_mma: cute.TiledMma):
        m, d = self.m_block_size, self.head_dim_padded
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        acc = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C((m, d)), Float32)
        gAcc = cute.local_tile(mdQaccum[batch, head, None], (m * d,), (m_block,))
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = gAcc[i * self.num_threads + tidx] * softmax_scale
        gdQ = cute.local_tile(mdQ[batch, None, head, None], (m, d), (m_block, 0))
        store_acc(acc, gdQ, tiled_mma, mdQ.shape[1] - m_block * m, self.head_dim, tidx)
