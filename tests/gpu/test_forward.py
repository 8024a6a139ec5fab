"""Forward correctness on the GPU against the float64 reference, both kernel families."""

import pytest
import torch

import cute_flash
from cute_flash import device, dispatch

from cute_flash.reference import causal_allowed

from .common import (
    assert_counters_at_zero,
    assert_forward_accurate,
    clear_sm90_tail_plans,
    expected_forward_family,
    force_kernel_family,
    kernels_used,
    randn,
    record_sm90_tail_plans,
    run_forward,
    served_by,
    sm90_forward_config,
    sm90_walk_plan,
    sm90_walk_plan_is_empty,
)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 64, 96, 128, 192, 256, 72]
SEQLENS = [(1, 1), (7, 7), (113, 203), (517, 33), (1023, 1024)]


@pytest.fixture(params=["sm80", "native"])
def family(request, monkeypatch):
    """Run every case on the sm80 kernels and on the GPU's own family (sm90 on an H100)."""
    force_kernel_family(monkeypatch, request.param == "sm80")
    return request.param


def check_shape(batch, seqlens, nheads, nheads_kv, head_dim, causal, dtype=torch.bfloat16, calls=1):
    """Fresh inputs of this shape; each of `calls` forwards matches the float64 reference."""
    sq, sk = seqlens
    q = randn(batch, sq, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, sk, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    for _ in range(calls):
        out, lse = run_forward(q, k, v, causal)
        assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_matches_reference(family, dtype, head_dim, seqlens, causal):
    sq, sk = seqlens
    q, k, v = randn(2, sq, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype), randn(2, sk, 4, head_dim, dtype=dtype)
    out, lse = run_forward(q, k, v, causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("nheads, nheads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_mqa(family, nheads, nheads_kv, causal, head_dim):
    q = randn(2, 300, nheads, head_dim, dtype=torch.bfloat16)
    k, v = (randn(2, 257, nheads_kv, head_dim, dtype=torch.bfloat16) for _ in range(2))
    out, lse = run_forward(q, k, v, causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_non_contiguous_inputs_and_outputs(family, causal, head_dim):
    q = randn(2, 200, 4, head_dim, dtype=torch.float16, transposed=True)
    k = randn(2, 190, 2, head_dim, dtype=torch.float16, transposed=True)
    v = torch.randn(2, 190, 2, 2 * head_dim, device="cuda", dtype=torch.float16)[..., :head_dim]  # strided rows
    out = torch.full((2, 4, 200, head_dim), float("nan"), device="cuda", dtype=torch.float16).transpose(1, 2)
    lse = torch.full((2, 4, 200), float("nan"), device="cuda")
    with served_by(expected_forward_family(head_dim)):
        cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


def test_misaligned_head_stride_is_copied_not_rejected(family):
    base = torch.randn(1, 64, 2, 64 + 3, device="cuda", dtype=torch.bfloat16)
    q = base[..., 3:]  # 16-byte misaligned base pointer
    k, v = randn(1, 64, 2, 64, dtype=torch.bfloat16), randn(1, 64, 2, 64, dtype=torch.bfloat16)
    with served_by(expected_forward_family(64)):
        out, lse = cute_flash.forward(q, k, v)
    assert_forward_accurate(out, lse, q, k, v, False)


def test_softmax_scale_and_return_lse(family):
    q, k, v = (randn(2, 129, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    with served_by(expected_forward_family(64)):
        out, lse = cute_flash.flash_attn_func(q, k, v, softmax_scale=0.37, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_forward_accurate(out, lse, q, k, v, True, softmax_scale=0.37)


def test_fp32_inputs_raise_typed_error_before_writing():
    q = torch.randn(1, 16, 2, 64, device="cuda")
    out = torch.full_like(q, 3.0)
    with pytest.raises(cute_flash.UnsupportedDtypeError):
        cute_flash.forward(q, q, q, out=out)
    assert torch.all(out == 3.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_long_sequences(family, head_dim, causal):
    """Past 2048 keys (4096 when causal: dispatch.length_class) the sm90 forward launches other
    kernels than for short problems, checked here at an unaligned length on each side."""
    sq, sk = (4095, 4177) if causal else (2047, 2113)
    assert dispatch.length_class(sk, causal) == "long" and dispatch.length_class(sq, causal) != "long"
    check_shape(1, (sq, sk), 2, 2, head_dim, causal)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_mid_causal(family, head_dim):
    """Causal problems with 2049-4096 keys ("mid", dispatch.length_class) run persistent CTAs on
    their own tiles (causal d64, d96 and d128: 192 rows instead of 128), here with more tiles than SMs."""
    assert dispatch.length_class(3500, True) == "mid"
    check_shape(2, (3001, 3500), 8, 4, head_dim, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_short_2k(family, head_dim, causal):
    """Problems with 1025-2048 keys ("short_2k", dispatch.length_class) run the short settings but
    for a few kernels (d96 on 192-row tiles, non-causal d128 with O rescaled after the softmax,
    causal d256 on 80-column blocks), here with more tiles than SMs, GQA and an unaligned key count."""
    assert dispatch.length_class(1999, causal) == "short_2k"
    check_shape(3, (1537, 1999), 8, 2, head_dim, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_dynamic_schedule(family, head_dim, causal):
    """Long problems (and mid causal ones) run persistent CTAs that take their next tile from a
    global counter as they finish one (kernels/sm90/tile_scheduler.py: fetch_unit); here with more tiles than
    SMs and GQA (non-causal: the last round split into pieces), twice in a row: the last fetch of
    each call leaves the counter at zero."""
    assert dispatch.length_class(4600, causal) == "long"
    check_shape(1, (4500, 4600), 8, 2, head_dim, causal, calls=2)
    assert_counters_at_zero()


def test_causal_l2_groups_of_long_heads(family):
    """Causal tiles run longest first across groups of heads whose K/V fit in L2 together
    (kernels/sm90/tile_scheduler.py: tile_coord), also where one head alone has more tiles than there are
    SMs: 128 m_blocks of 128 rows, K/V of 16300 keys (two heads a group), three heads, so that
    the last group has one; MQA, twice in a row."""
    check_shape(1, (16300, 16300), 3, 1, 256, True, calls=2)
    assert_counters_at_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,seqlens", [(64, (1000, 1000)), (64, (4500, 4600)), (96, (4500, 4600)),
                                              (128, (1000, 1000)), (128, (4500, 4600)), (256, (1000, 1000)),
                                              (256, (4500, 4600))], ids=str)
def test_scores_growing_across_blocks(family, head_dim, seqlens, causal, dtype):
    """The kernels visit a row's K/V blocks last to first; here the first key's scores are 5x the
    last's, so each row's running max moves again and again, by more than 2^8 in P (where lazy
    rescaling must rescale O and the row sums: kernels/common/softmax.py) as well as by less."""
    torch.manual_seed(head_dim + seqlens[1] + causal)  # a draw that meets the premise asserted below
    (sq, sk), scale = seqlens, head_dim ** -0.5
    growth = 1 + 4 * torch.arange(sk - 1, -1, -1, device="cuda") / sk
    q = randn(2, sq, 8, head_dim, dtype=dtype)
    k = (randn(2, sk, 2, head_dim, dtype=dtype).float() * growth[None, :, None, None]).to(dtype)
    v = randn(2, sk, 2, head_dim, dtype=dtype)
    # The premise, for the rows that see more than one block of 128 keys: the row max over all
    # keys exceeds the max over the last block seen first by more than 8 in exp2 units.
    scores = torch.einsum("bqhd,bkhd->bhqk", q[:, :, :2].double(), k.double()) * scale * 1.4426950408889634
    if causal:
        scores = scores.masked_fill(~causal_allowed(sq, sk, q.device), float("-inf"))
    row_end = torch.arange(sq, device="cuda") + (sk - sq) + 1 if causal else torch.full((sq,), sk, device="cuda")
    first_block = torch.arange(sk, device="cuda")[None, :] >= (row_end[:, None] - 128)
    first_max = scores.masked_fill(~first_block, float("-inf")).amax(-1)
    rows = row_end > 256
    assert ((scores.amax(-1) - first_max)[..., rows] > 8).float().mean() > 0.5
    out, lse = run_forward(q, k, v, causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_scores_overflowing_running_max(family, head_dim, causal, dtype):
    """The sm90 kernels (all but long d256) exponentiate an unmasked block against the running max
    before they know the block's own (stale_max, kernels/common/softmax.py: exponentiate_stale). Here key 5, in the
    block seen last, scores more than 128 exp2 units above every other key of the even rows, so
    their exponentials overflow to inf and the block must be scored again (kernels/sm90/fwd.py:
    rescore); in the odd rows it leads by 10-40 units, which the rescale from P handles, in the
    same warps. Ragged query count (a partial last tile), GQA; causal, every row sees key 5."""
    torch.manual_seed(head_dim + 31 + causal)  # a draw that meets the premise asserted below
    sq, sk, scale = 4500, 4600, head_dim ** -0.5
    assert dispatch.length_class(sk, causal) == "long"
    row_gain = torch.where(torch.arange(sq, device="cuda") % 2 == 0, 1.0, 0.2)
    q = ((randn(1, sq, 8, head_dim, dtype=dtype).float().abs() + 0.5) * row_gain[None, :, None, None]).to(dtype)
    k = randn(1, sk, 2, head_dim, dtype=dtype)
    k[:, 5] = 125 / scale / (1.3 * head_dim)
    v = randn(1, sk, 2, head_dim, dtype=dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q[:, :, ::4].double(), k.double()) * scale * 1.4426950408889634
    if causal:
        scores = scores.masked_fill(~causal_allowed(sq, sk, q.device), float("-inf"))
    lead = scores[..., 5] - torch.cat([scores[..., :5], scores[..., 6:]], dim=-1).amax(-1)
    assert (lead[..., 0::2] > 128).all() and (lead[..., 1::2] > 8).all() and (lead[..., 1::2] < 128).all()
    out, lse = run_forward(q, k, v, causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 192, 256])
def test_short_dynamic_schedule(family, head_dim, dtype):
    """Short non-causal d128-d256 (up to 1024 keys) also take their tiles from the global counter:
    here with four times more tiles than SMs, GQA and a ragged query count, twice in a row."""
    assert dispatch.length_class(1000, False) == "short"
    check_shape(4, (1000, 1000), 16, 4, head_dim, False, dtype=dtype, calls=2)
    assert_counters_at_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,seqlens", [(192, (1000, 1000)), (192, (500, 512)), (256, (500, 512)),
                                              (256, (333, 449))], ids=lambda v: str(v))
def test_64_column_blocks(family, head_dim, seqlens, causal, dtype):
    """Short d192, and d256 up to 512 keys, run 64-column K/V blocks (length_config): more tiles
    than SMs, GQA, ragged query and key counts (449 keys: a last block of one column), twice in a
    row (non-causal: on the global counter, which each call leaves at zero)."""
    assert dispatch.length_class(seqlens[1], causal) == ("short_512" if seqlens[1] <= 512 else "short")
    check_shape(4, seqlens, 16, 4, head_dim, causal, dtype=dtype, calls=2)
    assert_counters_at_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,seqlens", [(64, (1000, 1000)), (96, (1000, 1000)), (128, (1000, 1000)),
                                              (192, (1000, 1000)), (256, (1000, 1000)), (96, (1800, 2000)),
                                              (256, (1800, 2000))], ids=str)
def test_planned_tail(family, head_dim, seqlens, dtype):
    """Short causal walks end on the host's plan (kernels/sm90/tile_scheduler.py: plan_walk): shapes whose plan
    is not empty (checked on the sm90 kernel's tiles), GQA 4, a partial last tile, twice in a row."""
    batch, nheads = (3, 16) if seqlens[0] == 1000 else (2, 16)
    length = dispatch.length_class(seqlens[1], True)
    assert length in ("short", "short_2k")
    if family == "native" and torch.cuda.get_device_capability()[0] == 9:
        config = sm90_forward_config(dtype, head_dim, True, length)
        assert config.planned_tail
        assert not sm90_walk_plan_is_empty(sm90_walk_plan(*seqlens, batch * nheads, config))
    check_shape(batch, seqlens, nheads, 4, head_dim, True, dtype=dtype, calls=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,causal,seqlens", [(128, False, (1000, 1024)), (128, True, (1000, 1000)),
                                                     (128, True, (1900, 2000)), (64, False, (1000, 1024))], ids=str)
def test_wg_tma_store(family, head_dim, causal, seqlens, dtype):
    """Short d128 and non-causal d64 store each warp group's rows of O by TMA (kernels/sm90/fwd.py:
    epilogue, wg_tma_store): many tiles per CTA, a last tile with a partial and (d64, 192 rows) an
    empty warp group, GQA, into a strided `out` whose rows past seqlen_q (64 guard rows per head)
    must stay untouched, twice in a row."""
    length = dispatch.length_class(seqlens[1], causal)
    if family == "native" and torch.cuda.get_device_capability()[0] == 9:
        assert sm90_forward_config(dtype, head_dim, causal, length).wg_tma_store
    batch, (sq, sk), nheads, guard = 3, seqlens, 16, 64
    q = randn(batch, sq, nheads, head_dim, dtype=dtype)
    k, v = (randn(batch, sk, 4, head_dim, dtype=dtype) for _ in range(2))
    for _ in range(2):
        padded = torch.full((batch, nheads, sq + guard, head_dim), float("nan"), device="cuda", dtype=dtype)
        out = padded[:, :, :sq].transpose(1, 2)
        lse = torch.full((batch, nheads, sq), float("nan"), device="cuda")
        with served_by(expected_forward_family(head_dim)):
            assert cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal)[0] is out
        assert_forward_accurate(out, lse, q, k, v, causal)
        assert torch.isnan(padded[:, :, sq:]).all()


@pytest.mark.parametrize("head_dim,seqlens,nheads", [(256, (1000, 20000), 3), (128, (16390, 16390), 2)])
def test_causal_tile_order_edges(family, head_dim, seqlens, nheads):
    """The long causal tile order (kernels/sm90/tile_scheduler.py: tile_coord, "l2") in its two rarer shapes:
    a last group of heads smaller than the others (L2 holds the K/V of two of the three heads at
    20k keys of d256), and one head at a time once a head has 128 tiles or more."""
    assert dispatch.length_class(seqlens[1], True) == "long"
    check_shape(1, seqlens, nheads, nheads, head_dim, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_short_persistent_walk_over_many_tiles(family, head_dim, causal):
    """Short problems run persistent CTAs that each take several tiles in turn: more tiles than an
    H100 has SMs, so the Q stages, the per-warp-group O stores and the next-tile prefetch all
    rotate at least once (kernels/sm90/config.py: forward_config)."""
    assert dispatch.length_class(1024, causal) == "short"
    check_shape(4, (1000, 1024), 16, 4, head_dim, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,batch,seqlens,nheads,nheads_kv,plan_on_132", [
    (128, 1, (2200, 3001), 64, 64, None),           # 12 x 64 = 768 tiles of 192 rows: 108 left over, no split
    (128, 1, (2300, 3001), 58, 29, (36, 108)),  # 12 x 58 = 696 tiles: the last 36 run as 3 pieces each
    (64, 2, (3000, 2500), 5, 1, (28, 112)),     # 16 x 10 = 160 tiles: the last 28 run as 4 pieces each
    (128, 1, (5000, 6000), 1, 1, (27, 108)),    # fewer tiles than SMs: each one in 4 pieces
    (64, 3, (300, 4100), 2, 2, (12, 48)),        # short query, long keys: 12 tiles, 4 pieces each
    (128, 5, (256, 2500), 9, 3, (60, 120)),     # 2 x 45 = 90 tiles, 60 of work (the second has 64 rows)
    # Stream-K tails: 76 / 92 tiles left over, all 208 / 224 tiles in 132 equal shares of blocks
    (256, 1, (2048, 10300), 13, 1, (208, 336)),
    (128, 1, (3072, 10300), 14, 7, (224, 352)),
    (256, 2, (1024, 10241), 6, 2, (96, 216)),   # 96 tiles for 132 SMs, up to three pieces a tile
])
def test_tail_split(family, monkeypatch, dtype, head_dim, batch, seqlens, nheads, nheads_kv, plan_on_132):
    """Long non-causal problems run persistent CTAs whose last tiles are cut along the keys into
    pieces that merge through a global workspace (kernels/sm90/tile_scheduler.py: tail_plan, TailPlan,
    merge_pieces): equal pieces within the last round, or stream-K shares over the last two. The
    counters are left at zero for the next call. On an H100's 132 SMs the sm90 kernel must have
    planned `plan_on_132`: (tail tiles, pieces)."""
    plans = record_sm90_tail_plans(monkeypatch)
    clear_sm90_tail_plans()
    assert dispatch.length_class(seqlens[1], False) == "long"
    # The second call reuses the counters and the plan the first one left behind.
    check_shape(batch, seqlens, nheads, nheads_kv, head_dim, False, dtype=dtype, calls=2)
    assert_counters_at_zero()
    clear_sm90_tail_plans()
    if family != "sm80" and device.sm_count() == 132:
        assert plans == [plan_on_132]


def test_one_compiled_kernel_serves_every_length(family):
    """Batch and lengths never reach a compile key (dispatch.length_class aside): calls of one
    length class, each looking its kernel up afresh, all get the same compiled kernel."""
    keys = set()
    for sq, sk, b in [(64, 64, 1), (300, 500, 3), (1000, 17, 2)]:
        assert dispatch.length_class(sk, False) == "short_512"
        q = randn(b, sq, 2, 64, dtype=torch.float16)
        k, v = randn(b, sk, 2, 64, dtype=torch.float16), randn(b, sk, 2, 64, dtype=torch.float16)
        with kernels_used() as looked_up:
            out, lse = cute_flash.forward(q, k, v)
        assert_forward_accurate(out, lse, q, k, v, False)
        assert len(looked_up) == 1
        keys.update(looked_up)
    assert len(keys) == 1, keys


def test_forward_memory_is_linear_in_seqlen(family):
    """B=1, H=8, N=16384, D=64 fp16: the only extra device memory is O and LSE, and the tail
    split's workspace, which does not grow with N: at most one (192 x 64) float32 O tile and its
    LSE per SM (kernels/sm90/tile_scheduler.py: tail_split_plan)."""
    q, k, v = (randn(1, 16384, 8, 64, dtype=torch.float16) for _ in range(3))
    cute_flash.forward(q, k, v)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = cute_flash.forward(q, k, v)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    expected = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    workspace = device.sm_count() * 192 * (64 + 1) * 4 if family == "native" else 0
    assert extra <= expected + workspace + 4096, f"extra memory {extra} B > O + LSE + {workspace} B"


@pytest.mark.parametrize("head_dim,causal,seqlen", [(128, True, 512), (64, False, 4096), (256, True, 1000)])
def test_back_to_back_calls_order_their_memory(family, head_dim, causal, seqlen):
    """An sm90 forward may start while the kernel before it in the stream is still ending
    (programmatic dependent launch, kernels/sm90/fwd.py) and must wait for it before it touches memory. Six
    calls queued with nothing between them, on two buffers in turn: each reads as Q what the call
    before it wrote (read after write) and writes where that call read its Q (write after read).
    The result must equal the same chain's with a synchronization after every call."""
    q0 = randn(2, seqlen, 8, head_dim, dtype=torch.bfloat16)
    k, v = (randn(2, seqlen, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    out, lse = run_forward(q0, k, v, causal)
    assert_forward_accurate(out, lse, q0, k, v, causal)

    def chain(synchronize):
        buffers = [q0.clone(), torch.full_like(q0, float("nan"))]
        torch.cuda.synchronize()
        for i in range(6):
            cute_flash.forward(buffers[i % 2], k, v, out=buffers[(i + 1) % 2], causal=causal)
            if synchronize:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return buffers[0]

    serial = chain(True)
    assert not torch.isnan(serial).any() and serial.abs().max() > 0
    assert torch.equal(chain(False), serial)
