"""The Hopper fp32 forward's prepass: the K-major B operands its TF32 wgmma reads.

TF32 wgmma reads B from shared memory K-major only, and TMA cannot transpose 32-bit data, so the
PV GEMM's B operand (V, with the keys as its K dimension) cannot come from V as it lies in memory,
keys strided by heads * head_dim. This elementwise pass writes, per call, from fp32 K and V:

    K_lo   (batch, seqlen_k, heads_kv, head_dim)    K - trunc13(K): the low part of split TF32
    V^T    (batch, heads_kv, head_dim, seqlen_k_pad) V transposed, keys contiguous (raw fp32: the
                                                   tensor cores truncate it to its TF32 "hi" part)
    V^T_lo (batch, heads_kv, head_dim, seqlen_k_pad) V^T - trunc13(V^T)

seqlen_k_pad rounds seqlen_k up to a multiple of 8; the pad columns are zero (a masked P of 0
times them must stay 0). Within each group of 8 keys, V^T's column 8g + j holds key
8g + key_of_column(j): the TF32 A fragment of a thread holds k = t and t + 4 of each k8 step,
while the S accumulator gives that thread columns 2t and 2t + 1; with this order P's registers
are the PV GEMM's A operand as they stand (fwd_tf32.py: acc_as_frgA).

A CTA transposes PREP_KEYS keys of one (batch, kv head) through shared memory: reads along
head_dim, writes along keys, both coalesced.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .warpgroup_tf32 import tf32_lo

PREP_KEYS = 64
PREP_THREADS = 256
KEY_GROUP = 8


def key_of_column(j: int) -> int:
    """The key (within its group of 8) that column j of V^T holds: 2j for j < 4, 2(j - 4) + 1 after."""
    return 2 * (j % 4) + j // 4


def padded_seqlen_k(seqlen_k: int) -> int:
    return (seqlen_k + KEY_GROUP - 1) // KEY_GROUP * KEY_GROUP


class Tf32Prepass:
    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mKlo: cute.Tensor, mVt: cute.Tensor, mVtlo: cute.Tensor,
               stream: cuda.CUstream):
        num_key_blocks = cute.ceil_div(mVt.shape[3], PREP_KEYS)
        self.kernel(mK, mV, mKlo, mVt, mVtlo).launch(
            grid=[num_key_blocks, mK.shape[2], mK.shape[0]], block=[PREP_THREADS, 1, 1], stream=stream,
        )

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mKlo: cute.Tensor, mVt: cute.Tensor, mVtlo: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        key_block, head, batch = cute.arch.block_idx()
        d = self.head_dim
        seqlen_k = mK.shape[1]
        seqlen_k_pad = mVt.shape[3]
        smem = cutlass.memory.SmemAllocator()
        # One word of padding per row: the column reads of the second phase hit distinct banks.
        sV = smem.allocate_tensor(Float32, cute.make_layout((PREP_KEYS, d), stride=(d + 1, 1)), 16)
        first_key = key_block * PREP_KEYS
        # Phase 1, along head_dim: K_lo straight out, V into smem (zero past seqlen_k).
        for i in cutlass.range(tidx, PREP_KEYS * d, PREP_THREADS, unroll=4):
            key = i // d
            col = i - key * d
            s = first_key + key
            v = Float32(0.0)
            if s < seqlen_k:
                mKlo[batch, s, head, col] = tf32_lo(mK[batch, s, head, col])
                v = mV[batch, s, head, col]
            sV[key, col] = v
        cute.arch.sync_threads()
        # Phase 2, along keys: V^T and V^T_lo, keys permuted within each group of 8.
        for i in cutlass.range(tidx, PREP_KEYS * d, PREP_THREADS, unroll=4):
            col = i // PREP_KEYS
            j = i - col * PREP_KEYS
            s = first_key + j
            if s < seqlen_k_pad:
                j8 = j % KEY_GROUP
                key = j - j8 + 2 * (j8 % 4) + j8 // 4
                v = sV[key, col]
                mVt[batch, head, col, s] = v
                mVtlo[batch, head, col, s] = tf32_lo(v)
