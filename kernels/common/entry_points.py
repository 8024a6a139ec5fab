"""The backward main kernels' dense entry points, one definition for both families.

The sm80 and the Hopper backward take the same arguments, so one launcher (cute_flash/launchers.py)
serves both; each class defines `launch(...)` (host-side setup and the launch) and its own
`call_varlen`, and takes `__call__` and `call_with_mods` from here.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64


class BackwardEntryPoints:
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        """mLSElog2, mdPsum (batch, heads, rows padded) from the preprocess; mdQaccum (batch, heads,
        m_blocks * m_block_size * head_dim) fp32 zeros; mdK, mdV (batch, seqlen_k, heads_kv, d) in
        the input dtype (fp32 per query head where the launcher sums GQA groups); mdQsemaphore
        (batch, heads, m_blocks) int32 zeros when deterministic."""
        self.launch(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale,
                    None, None, None, None, stream)

    @cute.jit
    def call_with_mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor,
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
        """A kernel with a window, softcap, ALiBi or dropout (config.window / softcap / alibi /
        dropout): their values as the forward's `call_with_mods` takes them (dropout: the forward's
        seed, offset and threshold, which regenerate its mask), None for each the configuration
        leaves out."""
        self.launch(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsemaphore, softmax_scale,
                    window_left, window_right, softcap, mAlibiSlopes, stream,
                    dropout_args=(philox_seed, philox_offset, dropout_threshold, dropout_scale))
