"""Layout helpers shared by the attention kernels of every architecture.

Signatures (all pure layout algebra, usable inside @cute.jit / @cute.kernel code):

    smem_layout_atom(dtype, k_dim) -> cute.ComposedLayout
        A swizzled (rows, k_block) smem atom for a row-major tile whose rows hold `k_dim` 16-bit
        elements; k_block is 64 elements (128 B rows) when k_dim allows, else 32 (64 B rows).
        The swizzle makes both the 16 B cp.async writes and the ldmatrix reads bank-conflict free.
        32-bit elements (fp32, split TF32) take (8, 32) atoms of 128 B rows.

    reshape_acc_to_mn(acc) -> cute.Tensor
        View an MMA accumulator fragment as (rows, cols) of this thread: the sm80 mma.sync layout
        ((2, 2), MMA_M, MMA_N) becomes ((2, MMA_M), (2, MMA_N)); the sm90 wgmma layout
        ((2, 2, V), MMA_M, MMA_N) becomes ((2, MMA_M), (2, V, MMA_N)). Row r of the view is one
        row of the tile, shared with the 3 other threads of the quad.

    tScS_mn, t0ScS_mn = acc_coordinates(thr_mma, tile)
        The tile coordinates of this thread's and of thread 0's accumulator elements, as
        reshape_acc_to_mn views them (masks, biases and dropout index elements with them).

    reshape_acc_to_frgA(acc) -> cute.Tensor
        View an sm80 accumulator fragment ((2, 2), MMA_M, MMA_N) as the A operand of a
        m16n8k16 mma: ((2, 2, 2), MMA_M, MMA_N / 2). Used to feed P = softmax(S) (converted to
        16 bits) straight from registers into the P @ V gemm.

    transpose_view(s) -> cute.Tensor
        A smem tile (rows, cols, ...) of any rank viewed as (cols, rows, ...); used to read V (and,
        in the backward, K, Q, dO, P, dS) as a transposed operand with the transposing ldmatrix.

    gmem_tiled_copy(op, dtype, num_threads, row_elems) -> cute.TiledCopy
        Threads moving 16-byte vectors between global and shared memory: `row_elems / 8` threads
        cover one smem-atom row, the rest stack along rows. `op` is e.g. cp.async (loads) or
        CopyUniversalOp (stores).

    store_tile_rows(s2g, tidx, sX, gX, rows_left, col_pred=None)
        A staged smem tile -> its gmem tile gX in the 16-byte vectors of `s2g` (a gmem_tiled_copy
        with CopyUniversalOp), skipping rows at or past `rows_left`: one branch per row of vectors,
        the row compared through thread 0's compile-time coordinates. `col_pred(tXgX, tXcX)`, when
        given, returns the column predicate of a padded head dim.

    sequence_rows(mX, batch, head, offset) -> cute.Tensor
        The (seqlen, head_dim) rows of one sequence and head of a (batch, seqlen, heads, head_dim)
        tensor: mX[batch, :, head, :] for a dense batch (offset None), or the packed tensor
        (1, total, heads, head_dim) from row `offset` (a runtime cu_seqlens entry) on.

    offset, seqlen = sequence_bounds(mCuSeqlens, batch)
        Sequence `batch`'s first packed row and length, read from its cu_seqlens (int32, device).

    rows_from(mX, offset, mode) -> cute.Tensor
        mX (any rank, TMA coordinate tensors too) with mode `mode` starting at row `offset`: a
        packed sequence seen from its first row (the Hopper forward's varlen views); mX itself
        for a dense batch (offset None).

    sequence_stat(mX, batch, head, offset) -> cute.Tensor
        The same for a (batch, heads, seqlen) row statistic (LSE), packed (1, heads, total).

    dq_accum_row(head_dim) -> int
        Elements per row of the backward's fp32 dQ workspace (the head dim padded to 32).

    packed_stat_offset(cu_seqlen, batch) -> Int32
        Where sequence `batch` (first packed row cu_seqlen) starts in a packed, row-padded
        workspace (the backward's LSE, D and dQ accumulator of a varlen batch): a multiple of
        STAT_ROW_PAD with room for the sequence rounded up to STAT_ROW_PAD rows before the next
        one starts; a batch of `total` rows needs total + STAT_ROW_PAD * batch rows.

    round_up(x, multiple) -> int
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

VECTOR_BITS = 128


def sequence_rows(mX: cute.Tensor, batch, head, offset) -> cute.Tensor:
    if offset is None:
        return mX[batch, None, head, None]
    return cute.domain_offset((offset, 0), mX[0, None, head, None])


def sequence_bounds(mCuSeqlens: cute.Tensor, batch):
    offset = mCuSeqlens[batch]
    return offset, mCuSeqlens[batch + 1] - offset


def rows_from(mX: cute.Tensor, offset, mode: int) -> cute.Tensor:
    if offset is None:
        return mX
    return cute.domain_offset(tuple(offset if i == mode else 0 for i in range(cute.rank(mX))), mX)


def sequence_stat(mX: cute.Tensor, batch, head, offset) -> cute.Tensor:
    if offset is None:
        return mX[batch, head, None]
    return cute.domain_offset((offset,), mX[0, head, None])


STAT_ROW_PAD = 128
"""Row statistics and the dQ workspace are padded to a multiple of every backward m_block size."""


def packed_stat_offset(cu_seqlen, batch):
    return (cu_seqlen + STAT_ROW_PAD * batch) // STAT_ROW_PAD * STAT_ROW_PAD


def dq_accum_row(head_dim: int) -> int:
    """Elements per row of the backward's fp32 dQ workspace: the head dim padded to a multiple of
    32 (the sm80 main kernel's dQ tiles; the preprocess zeroes, the postprocess reads such rows)."""
    return round_up(head_dim, 32)


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def gmem_tiled_copy(op, dtype: type[cutlass.Numeric], num_threads: int, row_elems: int) -> cute.TiledCopy:
    vec = VECTOR_BITS // dtype.width
    threads_per_row = row_elems // vec
    thr_layout = cute.make_layout((num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(op, dtype, num_bits_per_copy=VECTOR_BITS), thr_layout, cute.make_layout((1, vec))
    )


def smem_layout_atom(dtype: type[cutlass.Numeric], k_dim: int) -> cute.ComposedLayout:
    if dtype.width == 32:
        assert k_dim % 32 == 0, f"k_dim {k_dim} must be a multiple of 32"
        # 128 B rows of 32 elements; 16 B vectors (2 bits of 4 elements) XOR-ed with 3 row bits.
        # Besides the 16 B cp.async writes, the scalar MMA-fragment reads of split TF32
        # (kernels/common/tf32.py) are conflict-free: 8 rows x 2 neighbouring words (K-major) and
        # 4 rows x 8 neighbouring words (MN-major) both land on 32 distinct banks.
        return cute.make_composed_layout(
            cute.make_swizzle(3, 2, 3), 0, cute.make_layout((8, 32), stride=(32, 1))
        )
    assert dtype.width == 16, "smem_layout_atom takes 16- or 32-bit elements"
    k_block = next((width for width in (64, 32, 16) if k_dim % width == 0), None)
    assert k_block is not None, f"k_dim {k_dim} must be a multiple of 16"
    # 16 B vectors (3 bits) are the unit; swizzle as many row bits as the row has 16 B chunks.
    swizzle_bits = {64: 3, 32: 2, 16: 1}[k_block]
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, 3, 3),
        0,
        cute.make_layout((8, k_block), stride=(k_block, 1)),
    )


def acc_coordinates(thr_mma, tile) -> tuple[cute.Tensor, cute.Tensor]:
    """(tScS_mn, t0ScS_mn): the (row, col) tile coordinates of this thread's and of thread 0's
    accumulator elements in (rows, cols) form. Thread 0's are compile-time values, and a thread's
    are thread 0's plus its own offset (tScS_mn[0]), so per-element comparisons can be against
    immediates."""
    cS = cute.make_identity_tensor(tile)
    return (reshape_acc_to_mn(thr_mma.partition_C(cS)), reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS)))


def reshape_acc_to_mn(acc: cute.Tensor) -> cute.Tensor:
    layout = acc.layout
    shape, stride = layout.shape, layout.stride
    v_shape, v_stride = shape[0], stride[0]
    if cutlass.const_expr(len(v_shape) == 2):
        cols_shape = (v_shape[0], shape[2])
        cols_stride = (v_stride[0], stride[2])
    else:
        cols_shape = (v_shape[0], v_shape[2], shape[2])
        cols_stride = (v_stride[0], v_stride[2], stride[2])
    mn = cute.make_layout(
        ((v_shape[1], shape[1]), cols_shape),
        stride=((v_stride[1], stride[1]), cols_stride),
    )
    return cute.make_tensor(acc.iterator, mn)


def reshape_acc_to_frgA(acc: cute.Tensor) -> cute.Tensor:
    # Two neighbouring n8 accumulator tiles hold exactly the k16 slice an A fragment needs.
    divided = cute.logical_divide(acc.layout, (None, None, 2))
    frg = cute.make_layout(
        ((divided.shape[0], divided.shape[2][0]), divided.shape[1], divided.shape[2][1]),
        stride=((divided.stride[0], divided.stride[2][0]), divided.stride[1], divided.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, frg)


def transpose_view(s: cute.Tensor) -> cute.Tensor:
    modes = [1, 0] + list(range(2, cute.rank(s.layout)))
    return cute.make_tensor(s.iterator, cute.select(s.layout, mode=modes))


@cute.jit
def store_tile_rows(s2g: cute.TiledCopy, tidx, sX: cute.Tensor, gX: cute.Tensor, rows_left,
                    col_pred: cutlass.Constexpr = None):
    """See the module docstring. The caller makes sure sX is written and no thread still writes it."""
    thr = s2g.get_slice(tidx)
    tXsX = thr.partition_S(sX)
    tXgX = thr.partition_D(gX)
    tXrX = cute.make_rmem_tensor_like(tXsX, sX.element_type)
    cute.autovec_copy(tXsX, tXrX)
    cX = cute.make_identity_tensor(gX.shape)
    tXcX = thr.partition_S(cX)
    t0XcX = s2g.get_slice(0).partition_S(cX)
    row_limit = rows_left - tXcX[0][0]
    if cutlass.const_expr(col_pred is not None):
        tXpX = col_pred(tXgX, tXcX)
    for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
        if t0XcX[0, m, 0][0] < row_limit:
            if cutlass.const_expr(col_pred is not None):
                cute.copy(s2g, tXrX[None, m, None], tXgX[None, m, None], pred=tXpX[None, m, None])
            else:
                cute.copy(s2g, tXrX[None, m, None], tXgX[None, m, None])
