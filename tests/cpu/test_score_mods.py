"""Sliding windows, softcap and ALiBi without a GPU: the float64 reference against the definition,
the window's block ranges against a brute-force mask, and the window's normalization."""

import itertools
import math

import pytest
import torch

import cute_flash
from cute_flash import reference_attention
from cute_flash.kernels.common.blocks import BlockRanges
from cute_flash.validate import score_mods


def naive(q, k, v, scale, causal, window, softcap, slopes):
    """flash-attn 2's documented rules, one score at a time."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        kh = hi // (h // hkv)
        diag = i + sk - sq
        keys = [j for j in range(sk) if (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)]
        if not keys:
            continue
        scores = []
        for j in keys:
            s = float((q[bi, i, hi].double() * k[bi, j, kh].double()).sum()) * scale
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s -= float(slopes.reshape(-1, h)[min(bi, slopes.reshape(-1, h).shape[0] - 1), hi]) * abs(diag - j)
            scores.append(s)
        s = torch.tensor(scores, dtype=torch.float64)
        lse[bi, hi, i] = torch.logsumexp(s, 0)
        p = torch.exp(s - lse[bi, hi, i])
        out[bi, i, hi] = sum(p[n] * v[bi, j, kh].double() for n, j in enumerate(keys))
    return out, lse


CASES = [
    # (sq, sk, causal, window, softcap, alibi shape)
    (5, 7, False, (0, 0), 0.0, None),
    (7, 5, False, (2, 1), 0.0, None),
    (6, 6, True, (3, -1), 0.0, None),
    (6, 9, False, (-1, 2), 0.0, None),
    (4, 4, False, (-1, -1), 1.5, None),
    (5, 8, True, (-1, -1), 0.0, "heads"),
    (8, 5, False, (-1, -1), 0.0, "batch"),
    (6, 7, True, (2, -1), 2.0, "batch"),
]


@pytest.mark.parametrize("sq, sk, causal, window, softcap, alibi", CASES, ids=str)
def test_reference_matches_definition(sq, sk, causal, window, softcap, alibi):
    torch.manual_seed(sq * 10 + sk)
    q, k, v = torch.randn(2, sq, 4, 8), torch.randn(2, sk, 2, 8), torch.randn(2, sk, 2, 8)
    slopes = {None: None, "heads": torch.rand(4), "batch": torch.rand(2, 4)}[alibi]
    out, lse = reference_attention(q, k, v, softmax_scale=0.4, causal=causal, window_size=window, softcap=softcap,
                                   alibi_slopes=slopes)
    ref_out, ref_lse = naive(q, k, v, 0.4, causal, window, softcap, slopes)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_reference_rejects_bad_mods():
    q = torch.randn(1, 3, 2, 8)
    for kwargs, error in (({"window_size": (-2, 0)}, cute_flash.InvalidDimensionError),
                          ({"softcap": -1.0}, cute_flash.InvalidDimensionError),
                          ({"alibi_slopes": torch.zeros(3)}, cute_flash.DimensionMismatchError),
                          ({"alibi_slopes": torch.zeros(2, dtype=torch.float16)}, cute_flash.UnsupportedDtypeError)):
        with pytest.raises(error):
            reference_attention(q, q, q, **kwargs)


def visible(sq, sk, left, right):
    return [[(i + sk - sq - left <= j <= i + sk - sq + right) for j in range(sk)] for i in range(sq)]


WINDOW_SHAPES = [(1, 1), (5, 300), (300, 5), (129, 257), (257, 129), (200, 200)]
WINDOWS = [(0, 0), (17, 0), (128, 128), (-1, 64), (64, -1), (3, 70), (300, 2)]


@pytest.mark.parametrize("tile_m, tile_n", [(128, 64), (64, 128), (128, 32)])
@pytest.mark.parametrize("sq, sk", WINDOW_SHAPES)
def test_window_block_ranges_match_brute_force(sq, sk, tile_m, tile_n):
    """Every visible key lies in a visited block, every block outside the masked ranges is fully
    visible (for the forward's query rows below seqlen_q), and the backward visits the same
    (query block, key block) pairs, in turn order from the forward's first key block."""
    ranges = BlockRanges(tile_m, tile_n, False)
    num_m, num_n = -(-sq // tile_m), -(-sk // tile_n)
    unbounded = sq + sk
    for window in WINDOWS:
        left, right = (unbounded if side < 0 else side for side in window)
        seen = visible(sq, sk, left, right)
        pairs_fwd = set()
        for m in range(num_m):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            n_min, n_max = ranges.n_block_min_max_window(m, sq, sk, left, right)
            right_mask, left_mask = ranges.n_block_window_masks(m, sq, sk, left, right)
            for n in range(num_n):
                keys = range(n * tile_n, min((n + 1) * tile_n, sk))
                any_seen = any(seen[i][j] for i in rows for j in keys)
                if any_seen:
                    assert n_min <= n < n_max, (window, m, n)
                if n_min <= n < n_max:
                    pairs_fwd.add((m, n))
                    full_block = len(keys) == tile_n
                    if full_block and left_mask <= n < right_mask:
                        assert all(seen[i][j] for i in rows for j in keys), (window, m, n)
        pairs_bwd = set()
        for n in range(num_n):
            m_min, m_max = ranges.m_block_min_max_window(n, sq, sk, left, right)
            right_mask, left_mask = ranges.m_block_window_masks(n, sq, sk, left, right)
            keys = range(n * tile_n, min((n + 1) * tile_n, sk))
            for m in range(num_m):
                rows = range(m * tile_m, min((m + 1) * tile_m, sq))
                if any(seen[i][j] for i in rows for j in keys):
                    assert m_min <= m < m_max, (window, m, n)
                if m_min <= m < m_max:
                    pairs_bwd.add((m, n))
                    if right_mask <= m < left_mask:
                        # every row (padded ones included) sees every key (padded ones included)
                        assert all(i + sk - sq - left <= j <= i + sk - sq + right
                                   for i in range(m * tile_m, (m + 1) * tile_m)
                                   for j in range(n * tile_n, (n + 1) * tile_n)), (window, m, n)
        # the deterministic dQ order (dq_turn_descending): the key blocks visiting query block m
        # are exactly [n_min, n_max), so their turns run 0, 1, ... from the highest
        for m in range(num_m):
            visitors = sorted(n for (mm, n) in pairs_bwd if mm == m)
            if visitors:
                n_min, n_max = ranges.n_block_min_max_window(m, sq, sk, left, right)
                assert visitors == list(range(n_min, n_max)), (window, m, visitors)
                turns = [ranges.dq_turn_descending(n, m, sq, sk, (left, right)) for n in reversed(visitors)]
                assert turns == list(range(len(visitors))), (window, m, turns)
        assert {p for p in pairs_fwd if any(seen[i][j] for i in range(p[0] * tile_m, min((p[0] + 1) * tile_m, sq))
                                           for j in range(p[1] * tile_n, min((p[1] + 1) * tile_n, sk)))} <= pairs_bwd


@pytest.mark.parametrize("tile_m, tile_n", [(64, 128), (128, 128), (64, 64)])
def test_causal_deterministic_turns(tile_m, tile_n):
    """The causal deterministic order (descending, Sm90BwdConfig.shortest_walk_first): the key
    blocks whose walk (m_block_min_max) visits query block m are exactly [0, n_block_max(m)), so
    the turns n_block_max - 1 - n are 0, 1, ... with no gap, and block n waits only for n + 1."""
    ranges = BlockRanges(tile_m, tile_n, True)
    n_range, m_range = BlockRanges.n_block_min_max.__wrapped__, BlockRanges.m_block_min_max.__wrapped__
    for sq, sk in [(1, 1), (7, 300), (300, 7), (129, 257), (1000, 1000), (517, 2049)]:
        num_m, num_n = -(-sq // tile_m), -(-sk // tile_n)
        walks = [tuple(int(x) for x in m_range(ranges, n, sq, sk)) for n in range(num_n)]
        for m in range(num_m):
            _, n_max = (int(x) for x in n_range(ranges, m, sq, sk))
            visitors = [n for n in range(num_n) if walks[n][0] <= m < walks[n][1]]
            assert visitors == list(range(n_max)), (sq, sk, m, visitors, n_max)


@pytest.mark.parametrize("sq, sk", [(1, 1), (4, 9), (9, 4), (16, 16)])
def test_window_normalization_is_exact(sq, sk):
    """score_mods turns sides that bound no row into unbounded ones and causal windows into the
    causal kernel's problem; the visible keys never change."""
    from cute_flash.reference import visible_keys

    sides = (-1, 0, 1, 3, sq - 2, sq - 1, sq, sk - 2, sk - 1, sk, 40)
    for causal, left, right in itertools.product((False, True), sides, sides):
        if left < -1 or right < -1:
            continue
        mods = score_mods(causal, (left, right), 0.0, None, sq, sk)
        want = visible_keys(sq, sk, causal, (left, right))
        got = visible_keys(sq, sk, mods.causal, mods.window or (-1, -1))
        assert torch.equal(got, want), (causal, left, right, mods)
        assert not (mods.causal and mods.window is not None)
    assert score_mods(True, (-1, -1), 0.0, None, 8, 8) == (True, None, 0.0, None)
    assert score_mods(False, (-1, 0), 0.0, None, 8, 8).causal


def test_kernel_arguments_of_the_modifications():
    """What the kernels receive at run time: nothing for a plain call; the window's sides with an
    unbounded one as seqlen_q + seqlen_k; the cap; (1 or batch, nheads) slopes; None for the rest."""
    from cute_flash import api
    from cute_flash.validate import Problem

    problem = Problem(2, 100, 300, 4, 2, 64, torch.float16, torch.device("cpu"))
    mods, args = api._score_mods(problem, False, (-1, -1), 0.0, None)
    assert args == () and mods.flags == (False, False, False)
    mods, args = api._score_mods(problem, True, (-1, -1), 0.0, None)
    assert args == () and mods.causal
    mods, args = api._score_mods(problem, False, (50, -1), 0.0, None)
    assert args == (50, 400, None, None) and not mods.causal
    mods, args = api._score_mods(problem, True, (50, 7), 30, None)
    assert args == (50, 0, 30.0, None) and mods.flags == (True, True, False)
    slopes = torch.rand(4)
    mods, args = api._score_mods(problem, False, [-1, -1], 0.0, slopes)
    assert args[:3] == (None, None, None) and args[3].shape == (1, 4) and torch.equal(args[3][0], slopes)
    with pytest.raises(cute_flash.DimensionMismatchError):
        api._score_mods(problem, False, (-1, -1), 0.0, torch.rand(3, 4))
    with pytest.raises(cute_flash.InvalidDimensionError):
        api._score_mods(problem, False, (-3, 1), 0.0, None)


def forward_walk(ranges, m, sq, sk, left, right):
    """The key blocks the sm80 forward visits for query block m with a window, in order, each with
    whether it is masked (kernels/sm80/fwd.py: kernel, the same integer steps)."""
    n_min, n_max = ranges.n_block_min_max_window(m, sq, sk, left, right)
    n_min = min(n_min, max(n_max - 1, 0))
    first = max(n_max - 1, n_min)
    right_mask, left_mask = ranges.n_block_window_masks(m, sq, sk, left, right)
    unmasked_end = max(min(right_mask, first), n_min)
    masked_end = max(min(left_mask, unmasked_end), n_min)
    walk = [(first, True)]
    walk += [(n, True) for n in range(first - 1, unmasked_end - 1, -1)]
    walk += [(n, False) for n in range(unmasked_end - 1, masked_end - 1, -1)]
    walk += [(n, True) for n in range(masked_end - 1, n_min - 1, -1)]
    return walk


@pytest.mark.parametrize("tile_m, tile_n", [(128, 64), (128, 32), (64, 64)])
@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 300), (300, 5), (129, 257), (700, 700), (1000, 64)])
def test_forward_walk_visits_every_visible_block_once_and_masks_every_edge(sq, sk, tile_m, tile_n):
    ranges = BlockRanges(tile_m, tile_n, False)
    num_n = -(-sk // tile_n)
    for window in WINDOWS + [(0, -1), (5, 5)]:
        left, right = (sq + sk if side < 0 else side for side in window)
        seen = visible(sq, sk, left, right)
        for m in range(-(-sq // tile_m)):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            walk = forward_walk(ranges, m, sq, sk, left, right)
            blocks = [n for n, _ in walk]
            assert blocks == sorted(set(blocks), reverse=True) and 0 <= blocks[-1] and blocks[0] < num_n
            for n in range(num_n):
                keys = range(n * tile_n, min((n + 1) * tile_n, sk))
                if any(seen[i][j] for i in rows for j in keys):
                    assert n in blocks, (window, m, n)
            for n, masked in walk:
                if not masked:
                    keys = range(n * tile_n, (n + 1) * tile_n)
                    assert keys.stop <= sk and all(seen[i][j] for i in rows for j in keys), (window, m, n)


def hopper_forward_walks(tile_m, tile_n, m, sq, sk, left, right):
    """The key blocks each consumer warp group of the Hopper forward visits for query block m with
    a window, in order, each with whether it is masked, and the blocks the producer loads
    (kernels/sm90/tile_scheduler.py: unit_work; kernels/sm90/fwd.py: wg_n_block_max,
    wg_window_blocks, mainloop; the same integer steps)."""
    ranges = BlockRanges(tile_m, tile_n, False)
    n_min, n_max = ranges.n_block_min_max_window(m, sq, sk, left, right)
    n_max = max(n_max, 1)
    n_min = min(n_min, n_max - 1)
    loaded = list(range(n_max - 1, n_min - 1, -1))
    walks = []
    for wg in range(tile_m // 64):
        wg_max = n_max if m * tile_m + wg * 64 < sq else n_min
        own_min, own_max = BlockRanges(64, tile_n, False).n_block_min_max_window(
            m * (tile_m // 64) + wg, sq, sk, left, right)
        wg_min, wg_max = max(n_min, own_min), min(wg_max, own_max)
        if wg_min >= wg_max:
            wg_min = wg_max = n_min
        walk = []
        if wg_max > wg_min:
            right_mask, left_mask = ranges.n_block_window_masks(m, sq, sk, left, right)
            unmasked = max(min(right_mask, wg_max - 1), wg_min)
            left_end = max(min(left_mask, unmasked), wg_min)
            walk = [(wg_max - 1, True)] + [(n, True) for n in range(wg_max - 2, unmasked - 1, -1)]
            walk += [(n, False) for n in range(unmasked - 1, left_end - 1, -1)]
            walk += [(n, True) for n in range(left_end - 1, wg_min - 1, -1)]
        walks.append(walk)
    return loaded, walks


@pytest.mark.parametrize("tile_m, tile_n", [(128, 128), (192, 80), (192, 128), (128, 112), (192, 96), (128, 64)])
@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 300), (300, 5), (129, 257), (700, 700), (1000, 64), (640, 77)])
def test_hopper_forward_walk_visits_every_visible_block_and_masks_every_edge(sq, sk, tile_m, tile_n):
    """Per warp group of 64 rows: every key its rows see lies in a block it visits, a block it
    visits unmasked is fully visible to its rows, and it visits a run of the blocks the producer
    loads in the producer's order (the others it passes before and after, pass_blocks). Every
    tile loads at least one block (a tile whose rows see no key runs one fully masked block)."""
    num_n = -(-sk // tile_n)
    for window in WINDOWS + [(0, -1), (5, 5), (1024, 0)]:
        left, right = (sq + sk if side < 0 else side for side in window)
        seen = visible(sq, sk, left, right)
        for m in range(-(-sq // tile_m)):
            loaded, walks = hopper_forward_walks(tile_m, tile_n, m, sq, sk, left, right)
            assert loaded and 0 <= loaded[-1] and loaded[0] < num_n, (window, m, loaded)
            for wg, walk in enumerate(walks):
                rows = range(m * tile_m + wg * 64, min(m * tile_m + (wg + 1) * 64, sq))
                blocks = [n for n, _ in walk]
                first = loaded.index(blocks[0]) if blocks else 0
                assert blocks == loaded[first:first + len(blocks)], (window, m, wg, blocks, loaded)
                for n in range(num_n):
                    keys = range(n * tile_n, min((n + 1) * tile_n, sk))
                    if any(seen[i][j] for i in rows for j in keys):
                        assert n in blocks, (window, m, wg, n)
                for n, masked in walk:
                    if not masked:
                        keys = range(n * tile_n, (n + 1) * tile_n)
                        assert keys.stop <= sk and all(seen[i][j] for i in rows for j in keys), (window, m, wg, n)
