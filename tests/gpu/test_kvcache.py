"""flash_attn_with_kvcache on the GPU: every sequence's output against the float64 reference on its
own gathered cache after the append (the yardstick of tests/gpu/common.py), the append read back
from the cache, and the rest of the cache untouched."""

import pytest
import torch

import cute_flash
from cute_flash.kvcache import flash_attn_with_kvcache

from .common import assert_forward_accurate, randn

pytestmark = pytest.mark.gpu

HEADS = [(32, 8), (8, 1), (4, 4)]  # GQA 4:1, MQA 8:1, MHA


def _lengths(batch, seqlen_new, capacity, longest=None):
    """Ragged cache lengths before the append, from 0 up to the capacity (one sequence at the top)."""
    top = capacity - seqlen_new if longest is None else longest
    lengths = torch.randint(0, top + 1, (batch,), dtype=torch.int32)
    lengths[0] = top
    if batch > 1:
        lengths[1] = min(1, top)
    if batch > 2:
        lengths[2] = top // 2
    return lengths


class Cache:
    """A contiguous or paged cache filled with random keys, and its sequences' keys gathered back."""

    def __init__(self, batch, nheads_kv, head_dim, capacity, dtype, page_size=0, lengths=None, seqlen_new=0,
                 spare_entries=0):
        self.page_size = page_size
        if page_size == 0:
            entries = batch + spare_entries
            self.k = randn(entries, capacity, nheads_kv, head_dim, dtype=dtype)
            self.v = randn(entries, capacity, nheads_kv, head_dim, dtype=dtype)
            self.batch_idx = torch.randperm(entries, device="cuda")[:batch].to(torch.int32) if spare_entries else None
            self.block_table = None
            return
        pages_per_seq = -(-capacity // page_size)
        needed = [-(-(int(n) + seqlen_new) // page_size) for n in lengths]
        num_pages = sum(needed) + 3
        self.k = randn(num_pages, page_size, nheads_kv, head_dim, dtype=dtype)
        self.v = randn(num_pages, page_size, nheads_kv, head_dim, dtype=dtype)
        pool = torch.randperm(num_pages).tolist()
        table = torch.full((batch, pages_per_seq), -1, dtype=torch.int32)  # unused entries: out of range
        for b, count in enumerate(needed):
            for i in range(count):
                table[b, i] = pool.pop()
        # a shared prefix page: sequences 0 and 2 read the same first page when neither appends into it
        if batch > 2 and min(int(lengths[0]), int(lengths[2])) >= page_size:
            table[2, 0] = table[0, 0]
        self.block_table = table.cuda()
        self.batch_idx = None

    def sequence(self, cache, b, length):
        """Keys 0..length-1 of sequence b: (1, length, nheads_kv, head_dim)."""
        if self.page_size == 0:
            entry = b if self.batch_idx is None else int(self.batch_idx[b])
            return cache[entry, :length][None]
        pages = self.block_table[b, : -(-length // self.page_size)].long()
        return cache[pages].flatten(0, 1)[:length][None]

    def slots(self, b, start, count):
        """(entries, rows) in the cache of positions start..start+count-1 of sequence b."""
        pos = torch.arange(start, start + count, device="cuda")
        if self.page_size == 0:
            entry = b if self.batch_idx is None else int(self.batch_idx[b])
            return torch.full_like(pos, entry), pos
        return self.block_table[b].long()[pos // self.page_size], pos % self.page_size


def check_call(batch, seqlen_q, heads, head_dim, capacity, causal, dtype=torch.bfloat16, page_size=0,
               seqlen_new=None, num_splits=0, spare_entries=0, lengths=None, int_lengths=False, leftpad=None, **mods):
    """One call against the float64 reference per sequence, the cache checked outside the append.
    `leftpad`: per-sequence cache_leftpad (the reference sees keys from there on); `mods`: window_size,
    softcap, alibi_slopes ((nheads,) or (batch, nheads)) as the call takes them."""
    nheads, nheads_kv = heads
    seqlen_new = seqlen_q if seqlen_new is None else seqlen_new
    if lengths is None:
        lengths = _lengths(batch, seqlen_new, capacity)
    cache = Cache(batch, nheads_kv, head_dim, capacity, dtype, page_size, lengths, seqlen_new, spare_entries)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_new, nheads_kv, head_dim, dtype=dtype) if seqlen_new else None
    v = randn(batch, seqlen_new, nheads_kv, head_dim, dtype=dtype) if seqlen_new else None
    k_before, v_before = cache.k.clone(), cache.v.clone()
    cache_seqlens = int(lengths[0]) if int_lengths else lengths.cuda()
    out, lse = flash_attn_with_kvcache(
        q, cache.k, cache.v, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache.batch_idx,
        block_table=cache.block_table, causal=causal, num_splits=num_splits, return_softmax_lse=True,
        cache_leftpad=None if leftpad is None else leftpad.cuda(), **mods)
    torch.cuda.synchronize()
    written_k, written_v = k_before.clone(), v_before.clone()
    for b in range(batch):
        n = int(lengths[0]) if int_lengths else int(lengths[b])
        if seqlen_new:
            entries, rows = cache.slots(b, n, seqlen_new)
            assert torch.equal(cache.k[entries, rows], k[b]), f"appended keys of sequence {b} not in the cache"
            assert torch.equal(cache.v[entries, rows], v[b]), f"appended values of sequence {b} not in the cache"
            written_k[entries, rows], written_v[entries, rows] = k[b], v[b]
        start = 0 if leftpad is None else int(leftpad[b])
        if n + seqlen_new == start:  # no key at all: out 0, lse -inf, as the other kernels
            assert torch.all(out[b] == 0) and torch.all(torch.isneginf(lse[b]))
            continue
        keys = cache.sequence(cache.k, b, n + seqlen_new)[:, start:]
        values = cache.sequence(cache.v, b, n + seqlen_new)[:, start:]
        seq_mods = dict(mods)
        if seq_mods.get("alibi_slopes") is not None and seq_mods["alibi_slopes"].dim() == 2:
            seq_mods["alibi_slopes"] = seq_mods["alibi_slopes"][b : b + 1]
        assert_forward_accurate(out[b : b + 1], lse[b : b + 1], q[b : b + 1], keys, values, causal, **seq_mods)
    assert torch.equal(cache.k, written_k) and torch.equal(cache.v, written_v), "the cache changed outside the append"


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("seqlen_q", [1, 4, 16, 200])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_contiguous(seqlen_q, heads, causal):
    check_call(3, seqlen_q, heads, 128, 1000, causal)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("seqlen_q", [1, 4, 16, 200])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged(page_size, seqlen_q, heads, causal):
    check_call(3, seqlen_q, heads, 128, 1200, causal, page_size=page_size)


def _slopes(batch, nheads, per_batch):
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], device="cuda")
    return base * torch.rand(batch, 1, device="cuda").add(0.5) if per_batch else base


# (mods, causal): windows (causal ones, one-sided, two-sided, a left side shorter than the query
# block), softcap, ALiBi with (nheads,) and (batch, nheads) slopes, all three.
MODS = [
    (dict(window_size=(64, 0)), False), (dict(window_size=(100, 8)), False), (dict(window_size=(3, 2)), True),
    (dict(softcap=30.0), True), (dict(alibi_slopes=False), False), (dict(alibi_slopes=True), True),
    (dict(window_size=(300, 0), softcap=20.0, alibi_slopes=True), False),
]


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("seqlen_q", [1, 16])
@pytest.mark.parametrize("mods, causal", MODS, ids=str)
def test_score_modifications(mods, causal, seqlen_q, heads, page_size):
    """window_size, softcap and alibi_slopes as flash_attn_func takes them, on each sequence's keys
    (bottom-right aligned), with packed query heads (ALiBi's slope is per packed row's head)."""
    mods = dict(mods)
    if "alibi_slopes" in mods:
        mods["alibi_slopes"] = _slopes(3, heads[0], mods["alibi_slopes"])
    check_call(3, seqlen_q, heads, 128, 1000, causal, page_size=page_size, **mods)


def test_window_on_a_long_cache_reads_only_its_blocks():
    """A 1000-key window at the end of up to 128k keys (the splits start at the window's first
    block): ragged lengths, the heuristic's split count and 7 explicit splits."""
    for seqlen_q, heads, causal, num_splits in ((1, (32, 8), False, 0), (4, (8, 1), True, 7)):
        lengths = torch.tensor([131072 - seqlen_q, 1, 5000], dtype=torch.int32)  # the first fills the cache
        check_call(3, seqlen_q, heads, 128, 131072, causal, lengths=lengths, num_splits=num_splits,
                   window_size=(1000, 0))


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("mods, causal", [({}, False), ({}, True), (dict(window_size=(50, 0), softcap=10.0), False)],
                         ids=str)
def test_cache_leftpad(mods, causal, page_size):
    """cache_leftpad[b]: sequence b's keys are cache positions leftpad[b] .. cache_seqlens[b] + new - 1
    (the append stays at cache_seqlens[b]); left padding equal to the old keys leaves only the new ones."""
    lengths = torch.tensor([700, 1, 300, 40], dtype=torch.int32)
    leftpad = torch.tensor([13, 1, 299, 0], dtype=torch.int32)
    check_call(4, 4, (16, 4), 128, 1000, causal, page_size=page_size, lengths=lengths, leftpad=leftpad, **mods)
    check_call(4, 1, (8, 1), 64, 1000, causal, page_size=page_size, lengths=lengths, leftpad=leftpad, num_splits=3,
               **mods)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_splits_explicit(num_splits):
    check_call(2, 1, (32, 8), 128, 3000, True, num_splits=num_splits)


def test_long_ragged_cache_split():
    """One sequence at 128k keys, others short: the heuristic splits the keys."""
    lengths = torch.tensor([131072 - 1, 1, 5000], dtype=torch.int32)
    check_call(3, 1, (32, 8), 128, 131072, False, lengths=lengths)


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("mods, causal", [({}, False), ({}, True), (dict(softcap=10.0, window_size=(3000, 0)), True)],
                         ids=str)
def test_one_row_tile_takes_the_deep_cta(mods, causal, page_size):
    """Batch 1, one KV head, one token: the whole call is one row tile, which takes the deep CTA
    (dispatch.decode_is_deep) on sm_80 / sm_90."""
    from cute_flash import dispatch

    assert dispatch.decode_is_deep(1, 8, 1, 1, 128)
    check_call(1, 1, (8, 1), 128, 40000, causal, page_size=page_size, **mods)


@pytest.mark.parametrize("page_size", [0, 256])
@pytest.mark.parametrize("heads, seqlen_q", [((32, 8), 1), ((32, 8), 8), ((8, 1), 4)], ids=str)
def test_few_row_tiles_take_the_narrow_tile(heads, seqlen_q, page_size):
    """Fewer row tiles than SMs, each (sequence, KV head)'s rows in 32: dispatch.DECODE_NARROW_TILE,
    with the split merge over many splits."""
    from cute_flash import dispatch

    assert dispatch.decode_is_narrow(5, *heads, seqlen_q, torch.cuda.get_device_properties(0).multi_processor_count)
    check_call(5, seqlen_q, heads, 128, 20000, True, page_size=page_size)
    check_call(5, seqlen_q, heads, 128, 3000, False, page_size=page_size, softcap=15.0, window_size=(700, 0))


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("heads, seqlen_q", [((32, 8), 1), ((8, 1), 16), ((4, 4), 4)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_cache(heads, seqlen_q, causal, page_size):
    """fp32 q and cache (split TF32) against the float64 reference, the yardstick's fp32 bound."""
    check_call(3, seqlen_q, heads, 128, 900, causal, dtype=torch.float32, page_size=page_size)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_fp32_cache_with_modifications_and_long_splits(head_dim):
    """fp32 with window / softcap / ALiBi, and a batch-1 one-KV-head call on a long cache (the deep
    CTA, 128 splits merged in fp32)."""
    check_call(2, 2, (8, 2), head_dim, 700, True, dtype=torch.float32, window_size=(200, 0), softcap=20.0,
               alibi_slopes=_slopes(2, 8, False))
    check_call(1, 1, (8, 1), head_dim, 40000, False, dtype=torch.float32)


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("heads, seqlen_q, head_dim", [((8, 1), 1, 128), ((8, 2), 4, 64), ((16, 4), 1, 128)], ids=str)
def test_many_row_tiles_take_warps_along_keys(heads, seqlen_q, head_dim, page_size):
    """Row tiles that fill the SMs, each (sequence, KV head)'s rows in 16: dispatch.DECODE_KEYS_TILE
    (each warp its slice of the keys, the warps' states merged in shared memory)."""
    from cute_flash import dispatch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-sms // heads[1])
    assert dispatch.decode_warps_along_keys(batch, *heads, seqlen_q, head_dim, sms)
    check_call(batch, seqlen_q, heads, head_dim, 700, True, page_size=page_size)
    check_call(batch, seqlen_q, heads, head_dim, 500, False, page_size=page_size, softcap=15.0, window_size=(90, 0),
               alibi_slopes=_slopes(batch, heads[0], True))


@pytest.mark.parametrize("heads, seqlen_q, head_dim", [((8, 1), 1, 128), ((16, 1), 1, 64), ((4, 1), 3, 128)], ids=str)
def test_one_tile_calls_take_warps_along_keys_on_deep_stages(heads, seqlen_q, head_dim):
    """Batch 1, one KV head, its rows in 16: DECODE_KEYS_TILE on the deep CTA's stages, split long."""
    from cute_flash import dispatch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert dispatch.decode_is_deep(1, *heads, seqlen_q, head_dim)
    assert dispatch.decode_warps_along_keys(1, *heads, seqlen_q, head_dim, sms)
    tile = dispatch.plan_decode((9, 0), torch.bfloat16, head_dim, True, deep=True, warps_along_keys=True)
    splits = dispatch.decode_splits(1, 1, 1, 40000, tile.tile_n, sms, tile.ctas_per_sm)
    assert dispatch.decode_merge_shape(seqlen_q * heads[0], splits) == dispatch.DECODE_WIDE_MERGE
    check_call(1, seqlen_q, heads, head_dim, 40000, True)  # the wide merge
    check_call(1, seqlen_q, heads, head_dim, 3000, False, page_size=16, softcap=15.0, window_size=(900, 0),
               alibi_slopes=_slopes(1, heads[0], True))


@pytest.mark.parametrize("batch, seqlen_q, heads, capacity", [(16, 8, (8, 1), 3000), (30, 7, (5, 1), 2500)], ids=str)
def test_many_rows_split_few_ways_merge_a_warp_per_row(batch, seqlen_q, heads, capacity):
    """512 query rows or more split a few ways: dispatch.DECODE_ROWS_MERGE (8 rows per merge CTA);
    1,050 rows leave the last CTA 6 spare warps, which must write nothing."""
    from cute_flash import dispatch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = dispatch.plan_decode((9, 0), torch.bfloat16, 128, True)
    m_blocks = -(-seqlen_q * heads[0] // heads[1] // plan.tile_m)
    splits = dispatch.decode_splits(batch, heads[1], m_blocks, capacity, plan.tile_n, sms, plan.ctas_per_sm)
    assert dispatch.decode_merge_shape(batch * seqlen_q * heads[0], splits) == dispatch.DECODE_ROWS_MERGE
    check_call(batch, seqlen_q, heads, 128, capacity, True)
    check_call(batch, seqlen_q, heads, 128, capacity, False, page_size=16, softcap=10.0)


def test_fp32_cache_follows_torchs_tf32_precision():
    """torch.set_float32_matmul_precision("high"): plain TF32 in the decode kernel, within TF32's
    error order against float64 and coarser than split TF32's on the same call."""
    lengths = torch.tensor([700, 311], dtype=torch.int32)
    cache = Cache(2, 2, 128, 800, torch.float32, lengths=lengths)
    q = randn(2, 1, 8, 128, dtype=torch.float32)
    outs = {}
    saved = torch.get_float32_matmul_precision()
    try:
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            outs[precision] = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lengths.cuda())
    finally:
        torch.set_float32_matmul_precision(saved)
    errors = {}
    for precision, out in outs.items():
        errors[precision] = max(
            (out[b : b + 1].double() - cute_flash.reference_attention(
                q[b : b + 1], cache.sequence(cache.k, b, int(n)), cache.sequence(cache.v, b, int(n)))[0]).abs().max().item()
            for b, n in enumerate(lengths))
    assert errors["highest"] < 1e-4 and errors["high"] < 1e-2 and errors["high"] > 4 * errors["highest"], errors


def test_fp16_head_dim_64_odd_page():
    check_call(4, 4, (8, 2), 64, 700, True, dtype=torch.float16, page_size=48)


def test_cache_batch_idx_and_no_append():
    check_call(3, 4, (8, 2), 128, 600, True, seqlen_new=0, spare_entries=2)
    check_call(2, 1, (8, 2), 128, 600, False, spare_entries=1)


def test_int_lengths_and_full_cache():
    check_call(2, 1, (8, 2), 128, 513, True, int_lengths=True)
    # cache_seqlens None: every sequence is the whole cache
    q = randn(2, 2, 8, 128, dtype=torch.bfloat16)
    kc, vc = randn(2, 300, 2, 128, dtype=torch.bfloat16), randn(2, 300, 2, 128, dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True)
    assert_forward_accurate(out, lse, q, kc, vc, True)
    assert flash_attn_with_kvcache(q, kc, vc).shape == q.shape


def test_empty_cache_rows_see_nothing():
    """A sequence with no keys at all, and causal rows that see none (3 queries on 1 key)."""
    lengths = torch.tensor([0, 7, 1], dtype=torch.int32)
    check_call(3, 3, (8, 2), 128, 64, True, seqlen_new=0, lengths=lengths)
    check_call(3, 3, (8, 2), 128, 64, True, seqlen_new=0, lengths=lengths, num_splits=4)


def test_value_errors_write_nothing():
    cache = Cache(2, 2, 64, 64, torch.bfloat16, page_size=16, lengths=torch.tensor([20, 20]), seqlen_new=1)
    q = randn(2, 1, 4, 64, dtype=torch.bfloat16)
    k = randn(2, 1, 2, 64, dtype=torch.bfloat16)
    before = cache.k.clone()
    table = cache.block_table.clone()
    table[1, 1] = cache.k.shape[0]  # one past the last page, in a page sequence 1 uses
    with pytest.raises(cute_flash.InvalidDimensionError, match="block_table"):
        flash_attn_with_kvcache(q, cache.k, cache.v, k, k, cache_seqlens=torch.tensor([20, 20], dtype=torch.int32,
                                device="cuda"), block_table=table)
    with pytest.raises(cute_flash.InvalidDimensionError, match="exceeds"):
        flash_attn_with_kvcache(q, cache.k, cache.v, k, k, cache_seqlens=torch.tensor([20, 64], dtype=torch.int32,
                                device="cuda"), block_table=cache.block_table)
    assert torch.equal(cache.k, before)


def test_cuda_graph_replays_new_lengths():
    """Lengths live on the device: a captured step replays with the lengths of the moment."""
    batch, heads, hd, capacity = 2, (8, 2), 128, 512
    cache = Cache(batch, heads[1], hd, capacity, torch.bfloat16)
    q = randn(batch, 1, heads[0], hd, dtype=torch.bfloat16)
    lengths = torch.tensor([100, 30], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lengths)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lengths, num_splits=2)
    for new in ([100, 30], [400, 3]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for b in range(batch):
            n = new[b]
            ref = flash_attn_with_kvcache(q[b : b + 1], cache.k[b : b + 1, :n].contiguous(),
                                          cache.v[b : b + 1, :n].contiguous())
            assert torch.allclose(out[b], ref[0], atol=2e-2, rtol=0), f"replay with lengths {new}"


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [0, 16])
def test_rotary_new_keys_and_queries(page_size, causal, interleaved):
    """rotary_cos / rotary_sin: the appended keys land in the cache rotated at cache_seqlens[b] + i,
    the queries attend rotated at the same positions when causal, else all at cache_seqlens[b] (the
    rotation itself is checked against complex multiplication in tests/cpu/test_rotary.py)."""
    from cute_flash.rotary import apply_rotary

    batch, seqlen, (nheads, nheads_kv), hd, capacity = 3, 4, (8, 2), 128, 600
    lengths = _lengths(batch, seqlen, capacity)
    cache = Cache(batch, nheads_kv, hd, capacity, torch.bfloat16, page_size, lengths, seqlen)
    angles = torch.arange(2 * capacity, device="cuda", dtype=torch.float64)[:, None] / 10000 ** torch.linspace(
        0, 1, 32, device="cuda", dtype=torch.float64)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)  # rotary_dim 64 of 128
    q, k, v = (randn(batch, seqlen, h, hd, dtype=torch.bfloat16) for h in (nheads, nheads_kv, nheads_kv))
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=lengths.cuda(), block_table=cache.block_table, causal=causal,
                                       rotary_interleaved=interleaved, return_softmax_lse=True)
    for b in range(batch):
        n = int(lengths[b])
        keys_at = torch.arange(n, n + seqlen, device="cuda")[None]
        queries_at = keys_at if causal else torch.full_like(keys_at, n)
        k_rot = apply_rotary(k[b : b + 1], cos, sin, keys_at, interleaved)
        q_rot = apply_rotary(q[b : b + 1], cos, sin, queries_at, interleaved)
        entries, rows = cache.slots(b, n, seqlen)
        assert torch.equal(cache.k[entries, rows], k_rot[0]) and torch.equal(cache.v[entries, rows], v[b])
        keys, values = cache.sequence(cache.k, b, n + seqlen), cache.sequence(cache.v, b, n + seqlen)
        assert_forward_accurate(out[b : b + 1], lse[b : b + 1], q_rot, keys, values, causal)
