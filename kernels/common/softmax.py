"""Online softmax over register accumulators (FlashAttention-2, Algorithm 1 lines 8-12).

Works for any accumulator that `layouts.reshape_acc_to_mn` understands (sm80 mma.sync and sm90
wgmma), where the 4 threads of a quad share each row.

    softmax = OnlineSoftmax.create(scale_log2, num_rows)
        scale_log2 = softmax_scale * log2(e): exp(scale * (s - m)) == exp2(s * scale_log2 - m * scale_log2)
        num_rows   = rows of the tile this thread touches (cute.size(reshape_acc_to_mn(acc_O), mode=[0]))
        softmax.row_max, softmax.row_sum: (num_rows,) Float32 register tensors (raw score units for
        row_max; row_sum is this thread's partial sum until finalize()).

    softmax.reset()
        row_max = -inf, row_sum = 0.

    row_scale = softmax.online_softmax(acc_S, is_first: Constexpr[bool], check_inf: Constexpr[bool])
        In place: acc_S <- exp2(acc_S * scale_log2 - row_max_new * scale_log2); updates row_max and
        row_sum and returns the factor exp2((row_max_old - row_max_new) * scale_log2) per row by
        which the O accumulator must be rescaled (1.0 when is_first). Masked entries must be -inf
        already; check_inf keeps fully masked rows at P = 0 instead of NaN.

    max_scaled, row_scale = softmax.update_row_max(acc_S)
    softmax.exponentiate(acc_S, max_scaled, row_scale)
        online_softmax(acc_S) (not the first block) in two halves, the row maxima and factors, then
        the exponentials and row sums: for kernels that wait on something between them.

    row_max_new, grows = softmax.grown_row_max(acc_S)
    softmax.rescale_if_grown(acc_O, row_max_new, grows)
    max_scaled = softmax.max_scaled()
    softmax.exponentiate(acc_S, max_scaled, None)
        The lazy form of the pair above (FlashAttention-4's Blackwell kernel rescales this way): the
        running max moves only where some row of the warp grew past it by more than
        LAZY_RESCALE_LOG2 (grows, warp-uniform); otherwise the block is exponentiated against the
        old max, and neither the row sums nor O are rescaled (rescale_if_grown moves the maxima and
        rescales both only where grows; O must be stable, its GEMMs waited for). P then reaches at most
        2^LAZY_RESCALE_LOG2, which 16-bit P, the f32 row sums and the f32 O hold within the same
        relative rounding bound as values up to 1, and the normalization at the end is unchanged.
        The rounding of P falls differently when the max is not exactly 1: measured max errors
        0.1-0.5 of torch's own against 0.05-0.4 eager (perf/NOTES.md, 2026-11-24).

    outgrown = softmax.exponentiate_stale(acc_S, block_sum)
    softmax.settle_stale(outgrown, acc_S, acc_O, block_sum, rescore)
        The lazy form without the block's row maxima (kernels/sm90/fwd.py: stale_max): the block is
        exponentiated against the running max at once, and the warp votes on its partial row sums
        instead; a sum over 2^LAZY_RESCALE_LOG2 bounds every P of the row, so where none is, the
        block stands. Otherwise (rare) the row maxima move to the block's: from P where it is
        finite, from the scores again (`rescore()` refills acc_S) where an exponential overflowed.

    softmax.rescale_O(acc_O, row_scale)
        acc_O[row, :] *= row_scale[row].

    softmax.rescale_O_if_needed(acc_O, row_scale)
        The same, skipped when no row of the warp changed its max (row_scale == 1 exactly).

    row_scale = softmax.finalize()
        Reduces row_sum across the quad; returns 1 / row_sum (1.0 for rows that saw no key, whose
        acc_O is 0) and leaves the natural-log LSE in softmax.row_sum (-inf for such rows).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .layouts import reshape_acc_to_mn

LOG2_E = math.log2(math.e)
"""exp(x) == exp2(x * LOG2_E): kernels fold it into the softmax scale."""

QUAD = 4  # threads of an mma.sync / wgmma quad that share one accumulator row

LAZY_RESCALE_LOG2 = 8.0
"""How far (in exp2 units) a row may outgrow its running max before the lazy form moves it."""
_LAZY_RESCALE_BOUND = 2.0 ** LAZY_RESCALE_LOG2


@cute.jit
def _quad_allreduce(val: Float32, op) -> Float32:
    return cute.arch.warp_reduction(val, op, threads_in_group=QUAD)


@dataclass
class OnlineSoftmax:
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        return OnlineSoftmax(scale_log2, row_max, row_sum)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online_softmax(
        self,
        acc_S: cute.Tensor,
        is_first: cutlass.Constexpr[bool] = False,
        check_inf: cutlass.Constexpr[bool] = True,
    ) -> cute.Tensor:
        acc_S_mn = reshape_acc_to_mn(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row_max_prev, row_max_new, max_scaled = self._new_row_max(acc_S_mn, r, is_first, check_inf)
            p_row = self._exp2_row(acc_S_mn, r, max_scaled)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
            else:
                row_scale[r] = self._row_factor(row_max_prev, row_max_new, max_scaled)
            self._accumulate_row(acc_S_mn, r, p_row, row_scale, is_first)
        return row_scale

    @cute.jit
    def update_row_max(self, acc_S: cute.Tensor):
        """online_softmax's first half (any block but the first): row maxima and row factors
        before any exponential, so that a kernel can place a wait between the halves. Returns
        (max_scaled, row_scale); exponentiate(acc_S, max_scaled, row_scale) finishes the block."""
        acc_S_mn = reshape_acc_to_mn(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        max_scaled = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row_max_prev, row_max_new, max_scaled[r] = self._new_row_max(acc_S_mn, r, False, True)
            row_scale[r] = self._row_factor(row_max_prev, row_max_new, max_scaled[r])
        return max_scaled, row_scale

    @cute.jit
    def exponentiate(self, acc_S: cute.Tensor, max_scaled: cute.Tensor, row_scale: cute.Tensor | None) -> None:
        acc_S_mn = reshape_acc_to_mn(acc_S)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            self._accumulate_row(acc_S_mn, r, self._exp2_row(acc_S_mn, r, max_scaled[r]), row_scale, False)

    @cute.jit
    def grown_row_max(self, acc_S: cute.Tensor):
        """Row maxima over the running max and this block, and whether any row of the warp grew
        by more than LAZY_RESCALE_LOG2 (a warp-uniform Boolean). A fully masked row (-inf before
        and after) does not grow; a row's first key (-inf before) always does."""
        acc_S_mn = reshape_acc_to_mn(acc_S)
        row_max_new = cute.make_rmem_tensor_like(self.row_max, Float32)
        grows = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row_max_new[r] = self._block_row_max(acc_S_mn, r, self.row_max[r])
            grows = grows | ((row_max_new[r] - self.row_max[r]) * self.scale_log2 > LAZY_RESCALE_LOG2)
        return row_max_new, cute.arch.vote_any_sync(grows)

    @cute.jit
    def exponentiate_stale(self, acc_S: cute.Tensor, block_sum: cute.Tensor):
        """The lazy form without this block's row maxima: acc_S <- exp2(acc_S * scale_log2 - running
        max * scale_log2) in place, the block's partial row sums into block_sum (row_sum is not
        touched). Returns whether some thread of the warp has a partial sum over
        2^LAZY_RESCALE_LOG2 (warp-uniform); if none has, no P of the warp exceeds that bound and
        the block stands as it is. Rows must have a finite running max."""
        acc_S_mn = reshape_acc_to_mn(acc_S)
        outgrown = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            block_sum[r] = self._exp2_row_against_max(acc_S_mn, r)
            outgrown = outgrown | (block_sum[r] > _LAZY_RESCALE_BOUND)
        return cute.arch.vote_any_sync(outgrown)

    @cute.jit
    def settle_stale(self, outgrown, acc_S: cute.Tensor, acc_O: cute.Tensor, block_sum: cute.Tensor,
                     rescore) -> None:
        """After exponentiate_stale, with O stable: where `outgrown`, the running max of each row of
        the warp moves to the block's and P, the block's sums, the row sums and O are rescaled;
        then the block's sums join the row sums. The block's max comes from P (log2 of its largest
        P, at least 1) unless an exponential of the warp overflowed: then `rescore()` puts the
        block's scores back into acc_S and it is exponentiated anew."""
        if outgrown:
            acc_S_mn = reshape_acc_to_mn(acc_S)
            row_max_new = cute.make_rmem_tensor_like(self.row_max, Float32)
            overflowed = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(cute.size(self.row_max)):
                overflowed = overflowed | (block_sum[r] == Float32.inf)
            if cute.arch.vote_any_sync(overflowed):
                rescore()
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    row_max_new[r] = self._block_row_max(acc_S_mn, r, self.row_max[r])
                self.rescale_O(acc_O, self._move_row_max(row_max_new, False))
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    block_sum[r] = self._exp2_row_against_max(acc_S_mn, r)
            else:
                scale_log2_inv = cute.arch.rcp_approx(self.scale_log2)
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    p_max = self._block_row_max(acc_S_mn, r, Float32(1.0))
                    row_max_new[r] = self.row_max[r] + cute.math.log2(p_max, fastmath=True) * scale_log2_inv
                row_scale = self._move_row_max(row_max_new, False)
                self.rescale_O(acc_O, row_scale)
                for r in cutlass.range_constexpr(cute.size(self.row_max)):
                    acc_S_mn[r, None].store(acc_S_mn[r, None].load() * row_scale[r])
                    block_sum[r] = block_sum[r] * row_scale[r]
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            self.row_sum[r] = self.row_sum[r] + block_sum[r]

    @cute.jit
    def _exp2_row_against_max(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        """Row r of the block exponentiated in place against the running max (finite); returns
        this thread's part of the row's sum."""
        p_row = self._exp2_row(acc_S_mn, r, self.row_max[r] * self.scale_log2)
        acc_S_mn[r, None].store(p_row)
        return p_row.reduce(cute.ReductionOp.ADD, Float32.zero, 0)

    @cute.jit
    def _move_row_max(self, row_max_new: cute.Tensor, check_inf: cutlass.Constexpr[bool]) -> cute.Tensor:
        """The running maxima become row_max_new; the row sums are rescaled here, and the returned
        factors are what O owes."""
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row_scale[r] = self._row_factor(
                self.row_max[r], row_max_new[r], self._scaled(row_max_new[r], check_inf), exact_one=False
            )
            self.row_sum[r] = self.row_sum[r] * row_scale[r]
            self.row_max[r] = row_max_new[r]
        return row_scale

    @cute.jit
    def rescale_if_grown(self, acc_O: cute.Tensor, row_max_new: cute.Tensor, grows) -> None:
        # The branch lives here, not in the kernel: a dynamic `if` whose body calls a method
        # through an attribute of a kernel-side object (c.softmax.f()) rebuilds this object's
        # tensors inside the branch, and their later uses fail IR verification.
        if grows:
            self.rescale_O(acc_O, self._move_row_max(row_max_new, True))

    @cute.jit
    def max_scaled(self) -> cute.Tensor:
        """The running maxima in exp2 units, as exponentiate takes them."""
        max_scaled = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            max_scaled[r] = self._scaled(self.row_max[r], True)
        return max_scaled

    @cute.jit
    def _scaled(self, row_max: Float32, check_inf: cutlass.Constexpr[bool]) -> Float32:
        if cutlass.const_expr(check_inf):
            # A row with every key masked so far: keep P = exp2(-inf) = 0, not exp2(nan).
            row_max = 0.0 if row_max == -Float32.inf else row_max
        return row_max * self.scale_log2

    @cute.jit
    def _new_row_max(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], is_first: cutlass.Constexpr[bool],
                     check_inf: cutlass.Constexpr[bool]):
        if cutlass.const_expr(is_first):
            row_max_new = self._block_row_max(acc_S_mn, r, -Float32.inf)
        else:
            row_max_new = self._block_row_max(acc_S_mn, r, self.row_max[r])
        row_max_prev = self.row_max[r]
        self.row_max[r] = row_max_new
        return row_max_prev, row_max_new, self._scaled(row_max_new, check_inf)

    @cute.jit
    def _block_row_max(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], init: Float32) -> Float32:
        """Max of init and row r of this block, across the quad that holds the row."""
        row_max = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, init, 0)
        return _quad_allreduce(row_max, cute.arch.fmax)

    @cute.jit
    def _exp2_row(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], max_scaled: Float32):
        return cute.math.exp2(acc_S_mn[r, None].load() * self.scale_log2 - max_scaled, fastmath=True)

    @cute.jit
    def _row_factor(self, row_max_prev: Float32, row_max_new: Float32, max_scaled: Float32,
                    exact_one: cutlass.Constexpr[bool] = True) -> Float32:
        factor = cute.math.exp2(row_max_prev * self.scale_log2 - max_scaled, fastmath=True)
        if cutlass.const_expr(exact_one):
            # exactly 1 when the max did not move, so rescale_O can be skipped
            factor = 1.0 if row_max_prev == row_max_new else factor
        return factor

    @cute.jit
    def _accumulate_row(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], p_row, row_scale: cute.Tensor,
                        is_first: cutlass.Constexpr[bool]) -> None:
        if cutlass.const_expr(is_first):
            self.row_sum[r] = p_row.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        elif cutlass.const_expr(row_scale is None):  # lazy rescaling: the row sum is already scaled
            self.row_sum[r] = p_row.reduce(cute.ReductionOp.ADD, self.row_sum[r], 0)
        else:
            self.row_sum[r] = p_row.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
        acc_S_mn[r, None].store(p_row)

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        acc_O_mn = reshape_acc_to_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * row_scale[r])

    @cute.jit
    def rescale_O_if_needed(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        # Long rows rarely see a new max; skip the multiply when no row of the warp moved.
        # The vote keeps the branch warp-uniform.
        moved = row_scale[0] != 1.0
        for r in cutlass.range_constexpr(1, cute.size(row_scale)):
            moved = moved | (row_scale[r] != 1.0)
        if cute.arch.vote_any_sync(moved):
            self.rescale_O(acc_O, row_scale)

    @cute.jit
    def finalize(self) -> cute.Tensor:
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            row_sum = _quad_allreduce(self.row_sum[r], operator.add)
            no_key = row_sum == 0.0 or row_sum != row_sum
            row_scale[r] = cute.arch.rcp_approx(1.0 if no_key else row_sum)
            lse = (
                self.row_max[r] * self.scale_log2 + cute.math.log2(row_sum, fastmath=True)
            ) * math.log(2.0)
            self.row_sum[r] = -Float32.inf if no_key else lse
        return row_scale
