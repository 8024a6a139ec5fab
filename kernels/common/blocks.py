"""Which tiles of the score matrix a CTA visits, and which of them need masking.

Causal attention is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.

    ranges = BlockRanges(tile_m, tile_n, causal)          # all compile time

    n_block_min, n_block_max = ranges.n_block_min_max(m_block, seqlen_q, seqlen_k)
        Key blocks [n_block_min, n_block_max) hold every key some query of m_block sees.
        n_block_max may be 0 (every row of the block sees no key: out = 0, lse = -inf).

    n_block_end = ranges.n_block_end(row_end, seqlen_q, seqlen_k)
        Causal: key blocks [0, n_block_end) hold every key that query rows below row_end see.

    n_block_min_causal_mask = ranges.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, n_block_min)
        Key blocks n >= this value cross the causal diagonal of m_block and need the causal mask;
        blocks below it are fully visible. (Only the last block, n_block_max - 1, can also cross
        seqlen_k; forward kernels mask it with mask_seqlen.)

    m_block_min, m_block_max = ranges.m_block_min_max(n_block, seqlen_q, seqlen_k)
        Backward mirror: query blocks [m_block_min, m_block_max) that see some key of n_block.

    m_block_max_causal_mask = ranges.m_block_max_causal_mask(n_block, seqlen_q, seqlen_k, m_block_min)
        Backward mirror: query blocks m < this value cross the diagonal of n_block and need the
        causal mask; blocks from it on see the whole key block.

    turn = ranges.dq_turn_descending(n_block, m_block, seqlen_q, seqlen_k, window=None)
        Deterministic backward, causal or windowed (BlockRanges.dq_turns_descend): n_block's turn to
        add m_block's dQ (0 first).

    head_kv = kv_head(head, num_heads, num_heads_kv)
        The K/V head that query head `head` reads (GQA / MQA: consecutive query heads share one).

Sliding windows (flash-attn 2's rule): query i sees key j iff
i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, with `left` and `right`
runtime values (an unbounded side is passed as a bound no row reaches, e.g. seqlen_q + seqlen_k).
The window methods are straight-line arithmetic on non-negative values, so they also run on
Python ints (the CPU tests check them against a brute-force mask):

    n_block_min, n_block_max = ranges.n_block_min_max_window(m_block, seqlen_q, seqlen_k, left, right)
        Key blocks [n_block_min, n_block_max) hold every key some query of m_block sees; blocks
        outside are never loaded. n_block_min may reach n_block_max (no key seen).

    n_block_right_mask, n_block_left_mask = ranges.n_block_window_masks(m_block, seqlen_q, seqlen_k, left, right)
        Key blocks n >= n_block_right_mask cross the window's right edge for some row of m_block,
        blocks n < n_block_left_mask its left edge; blocks between are fully visible.

    m_block_min, m_block_max = ranges.m_block_min_max_window(n_block, seqlen_q, seqlen_k, left, right)
        Backward mirror. A query block m is visited by exactly the key blocks
        [n_block_min, n_block_max) of n_block_min_max_window(m) (the deterministic dQ order's turns).

    m_block_right_mask, m_block_left_mask = ranges.m_block_window_masks(n_block, seqlen_q, seqlen_k, left, right)
        Backward mirror: query blocks m < m_block_right_mask or m >= m_block_left_mask need the mask.

    n_block_min, n_block_end = split_block_range(m_block, split, num_splits, seqlen_q, seqlen_k, group,
                                                 tile_m, tile_n, causal, window=None)
        Decode (packed rows r = q_idx * group + h): key blocks [n_block_min, n_block_end) of split
        `split`; the splits cut the blocks the tile's rows see (within the window's sides, if one)
        into equal runs (empty past the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class BlockRanges:
    tile_m: int
    tile_n: int
    causal: bool

    @cute.jit
    def n_block_min_max(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        n_block_max = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.causal):
            last_row_end = (m_block + 1) * self.tile_m
            n_block_max = cutlass.min(n_block_max, self.n_block_end(last_row_end, seqlen_q, seqlen_k))
        return Int32(0), n_block_max

    def n_block_end(self, row_end: Int32, seqlen_q: Int32, seqlen_k: Int32):
        # causal: query row i sees keys up to i + seqlen_k - seqlen_q (straight-line arithmetic,
        # so it also runs on Python ints, as the CPU tests do)
        n_idx_end = cutlass.max(cutlass.min(row_end, seqlen_q) + seqlen_k - seqlen_q, 0)
        return cute.ceil_div(n_idx_end, self.tile_n)

    @cute.jit
    def n_block_min_causal_mask(
        self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, n_block_min: Int32
    ):
        # the first query row of the block sees keys j < m_block * tile_m + 1 + seqlen_k - seqlen_q
        n_idx_first_row_end = m_block * self.tile_m + 1 + seqlen_k - seqlen_q
        return cutlass.max(n_block_min, cutlass.max(n_idx_first_row_end, 0) // self.tile_n)

    @cute.jit
    def m_block_min_max(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        m_block_max = cute.ceil_div(seqlen_q, self.tile_m)
        m_block_min = Int32(0)
        if cutlass.const_expr(self.causal):
            # the first key of the block is seen from query rows >= n_block*tile_n - (seqlen_k - seqlen_q)
            m_idx_first = n_block * self.tile_n + seqlen_q - seqlen_k
            m_block_min = cutlass.max(m_idx_first, 0) // self.tile_m
        return m_block_min, m_block_max

    @cute.jit
    def m_block_max_causal_mask(
        self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, m_block_min: Int32
    ):
        # the last key of the block is seen from query rows >= (n_block+1)*tile_n - 1 - (seqlen_k - seqlen_q)
        m_idx_all_see = (n_block + 1) * self.tile_n - 1 + seqlen_q - seqlen_k
        return cutlass.max(m_block_min, cute.ceil_div(cutlass.max(m_idx_all_see, 0), self.tile_m))

    @staticmethod
    def dq_turns_descend(deterministic: bool, causal: bool, window: bool) -> bool:
        """Whether a deterministic backward adds dQ in descending key-block order (and runs its grid
        from the last key block, so a CTA waits only for CTAs started before it): with causal or
        window masks, where a key block's walk starts at its diagonal and the last key block of a
        query block reaches it first. In ascending order every CTA waited for key block 0, whose
        walk is the longest."""
        return deterministic and (causal or window)

    def dq_turn_descending(self, n_block, m_block, seqlen_q, seqlen_k, window=None):
        """The deterministic backward's dQ order with a causal mask or a window: the key blocks
        that add query block m_block's dQ are exactly [n_block_min, n_block_max) of it
        (tests/cpu/test_score_mods.py), and they take turns from the last, whose walk reaches
        m_block first, so the turns run 0, 1, ... without a gap."""
        if window is not None:
            _, n_block_max = self.n_block_min_max_window(m_block, seqlen_q, seqlen_k, *window)
        else:
            _, n_block_max = self.n_block_min_max(m_block, seqlen_q, seqlen_k)
        return n_block_max - 1 - n_block

    # ---- sliding windows -------------------------------------------------------------------
    def n_block_min_max_window(self, m_block, seqlen_q, seqlen_k, left, right):
        offset = seqlen_k - seqlen_q
        row_first = m_block * self.tile_m
        row_last = cutlass.min((m_block + 1) * self.tile_m, seqlen_q) - 1
        n_block_max = cutlass.min(cute.ceil_div(seqlen_k, self.tile_n),
                                  cute.ceil_div(cutlass.max(row_last + offset + right + 1, 0), self.tile_n))
        n_block_min = cutlass.max(row_first + offset - left, 0) // self.tile_n
        return n_block_min, n_block_max

    def n_block_window_masks(self, m_block, seqlen_q, seqlen_k, left, right):
        offset = seqlen_k - seqlen_q
        row_first = m_block * self.tile_m
        row_last = cutlass.min((m_block + 1) * self.tile_m, seqlen_q) - 1
        # the block's last key is visible from its first row: (n + 1) * tile_n - 1 <= row_first + offset + right
        n_block_right_mask = cutlass.max(row_first + offset + right + 1, 0) // self.tile_n
        # the block's first key is visible from its last row: n * tile_n >= row_last + offset - left
        n_block_left_mask = cute.ceil_div(cutlass.max(row_last + offset - left, 0), self.tile_n)
        return n_block_right_mask, n_block_left_mask

    def m_block_min_max_window(self, n_block, seqlen_q, seqlen_k, left, right):
        offset = seqlen_k - seqlen_q
        key_first = n_block * self.tile_n
        key_last = (n_block + 1) * self.tile_n - 1
        # rows i >= key_first - offset - right see the block's first key; rows i <= key_last - offset + left its last
        m_block_min = cutlass.max(key_first - offset - right, 0) // self.tile_m
        m_block_max = cutlass.min(cute.ceil_div(seqlen_q, self.tile_m),
                                  cute.ceil_div(cutlass.max(key_last - offset + left + 1, 0), self.tile_m))
        return m_block_min, m_block_max

    def m_block_window_masks(self, n_block, seqlen_q, seqlen_k, left, right):
        offset = seqlen_k - seqlen_q
        key_first = n_block * self.tile_n
        key_last = (n_block + 1) * self.tile_n - 1
        # every row of block m sees key_last: m * tile_m >= key_last - offset - right
        m_block_right_mask = cute.ceil_div(cutlass.max(key_last - offset - right, 0), self.tile_m)
        # some row of block m is past key_first's reach: (m + 1) * tile_m - 1 > key_first - offset + left
        m_block_left_mask = cutlass.max(key_first - offset + left + 1, 0) // self.tile_m
        return m_block_right_mask, m_block_left_mask


def kv_head(head, num_heads, num_heads_kv):
    return head // (num_heads // num_heads_kv)


def split_block_range(m_block, split, num_splits, seqlen_q, seqlen_k, group, tile_m: int, tile_n: int, causal: bool,
                      window=None):
    # straight-line arithmetic, so it also runs on Python ints (the CPU tests do)
    n_block_max = cute.ceil_div(seqlen_k, tile_n)
    # the tile's last packed row belongs to the latest query position it holds
    last_q = cutlass.min(seqlen_q - 1, ((m_block + 1) * tile_m - 1) // group)
    if causal:
        keys_seen = cutlass.max(last_q + 1 + seqlen_k - seqlen_q, 0)
        n_block_max = cutlass.min(n_block_max, cute.ceil_div(keys_seen, tile_n))
    if window is None:
        blocks_per_split = cute.ceil_div(n_block_max, num_splits)
        n_block_min = cutlass.min(split * blocks_per_split, n_block_max)
    else:
        # keys up to the last query's right side, from the first query's left side
        left, right = window
        first_q = m_block * tile_m // group
        keys_seen = cutlass.max(last_q + 1 + seqlen_k - seqlen_q + right, 0)
        n_block_max = cutlass.min(n_block_max, cute.ceil_div(keys_seen, tile_n))
        n_block_first = cutlass.min(cutlass.max(first_q + seqlen_k - seqlen_q - left, 0) // tile_n, n_block_max)
        blocks_per_split = cute.ceil_div(n_block_max - n_block_first, num_splits)
        n_block_min = cutlass.min(n_block_first + split * blocks_per_split, n_block_max)
    return n_block_min, cutlass.min(n_block_min + blocks_per_split, n_block_max)
