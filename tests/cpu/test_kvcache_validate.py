"""flash_attn_with_kvcache: flash-attn 2's signature, and every typed error before anything runs or
is written (the caches are CPU tensors here, so a call that passed every rule would stop at the
device check; value rules are checked through the same functions the API calls)."""

import inspect

import pytest
import torch

import cute_flash
from cute_flash import ErrorCode
from cute_flash.kvcache import flash_attn_with_kvcache
from cute_flash.validate import check_kvcache, kvcache_value_flags, raise_for_kvcache_values

from .typed_errors import expect

FLASH_ATTN_2_SIGNATURE = (
    "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
    "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved",
    "alibi_slopes", "num_splits", "return_softmax_lse",
)


def test_signature_is_flash_attn_2s():
    params = inspect.signature(flash_attn_with_kvcache).parameters
    assert tuple(params) == FLASH_ATTN_2_SIGNATURE
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False)
    assert cute_flash.flash_attn_with_kvcache is flash_attn_with_kvcache
    from cute_flash.flash_attn_interface import flash_attn_with_kvcache as exported
    assert exported is flash_attn_with_kvcache


def inputs(b=2, sq=1, h=8, hkv=2, d=64, cache=64, new=1, dtype=torch.bfloat16, paged=False):
    q = torch.randn(b, sq, h, d).to(dtype)
    if paged:
        kc = torch.zeros(8, 16, hkv, d, dtype=dtype)
    else:
        kc = torch.zeros(b, cache, hkv, d, dtype=dtype)
    k = torch.randn(b, new, hkv, d).to(dtype)
    return q, kc, kc.clone(), k, k.clone()


def call(q, kc, vc, **kw):
    return flash_attn_with_kvcache(q, kc, vc, **kw)


def test_cache_leftpad_shape_and_dtype():
    q, kc, vc, k, v = inputs()
    append = dict(k=k, v=v, cache_seqlens=torch.zeros(2, dtype=torch.int32))
    msg = expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, cache_leftpad=torch.zeros(2), **append)
    assert "cache_leftpad" in msg
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, cache_leftpad=torch.zeros(3, dtype=torch.int32),
           **append)
    # paged caches take it too (flash-attn 2 rejects that pair)
    qp, kp, vp, kn, vn = inputs(paged=True)
    expect(ErrorCode.CUDA_ERROR, RuntimeError, call, qp, kp, vp, k=kn, v=vn,
           cache_seqlens=torch.zeros(2, dtype=torch.int32), block_table=torch.zeros(2, 4, dtype=torch.int32),
           cache_leftpad=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("kw, code, error, fragment", [
    (dict(window_size=(-2, 0)), ErrorCode.INVALID_DIMENSION, ValueError, "window_size"),
    (dict(window_size=(4,)), ErrorCode.INVALID_DIMENSION, ValueError, "window_size"),
    (dict(softcap=-1.0), ErrorCode.INVALID_DIMENSION, ValueError, "softcap"),
    (dict(alibi_slopes=torch.ones(8, dtype=torch.float64)), ErrorCode.UNSUPPORTED_DTYPE, TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(3, 8)), ErrorCode.DIMENSION_MISMATCH, ValueError, "alibi_slopes"),
])
def test_score_modification_errors(kw, code, error, fragment):
    """window_size, softcap and alibi_slopes are taken (the decode kernel's call_with_mods) and
    checked as flash_attn_func checks them, before anything runs."""
    q, kc, vc, k, v = inputs()
    kc_before = kc.clone()
    msg = expect(code, error, call, q, kc, vc, k=k, v=v, cache_seqlens=torch.zeros(2, dtype=torch.int32), **kw)
    assert fragment in msg
    assert torch.equal(kc, kc_before)


def test_score_modifications_pass_every_rule():
    """Valid ones reach the device check (CPU tensors here), the last rule before the kernels."""
    q, kc, vc, k, v = inputs()
    for kw in (dict(window_size=(16, 0)), dict(softcap=30.0), dict(alibi_slopes=torch.ones(2, 8)),
               dict(window_size=(100, 3), softcap=5.0, alibi_slopes=torch.ones(8), causal=True)):
        expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q, kc, vc, k=k, v=v,
               cache_seqlens=torch.zeros(2, dtype=torch.int32), **kw)


def test_cache_shapes_and_dtypes():
    q, kc, vc, k, v = inputs()
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q[0], kc, vc)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc[:, :32])
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc[..., :32], vc[..., :32])
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q[:, :, :7], kc, vc)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc.half(), vc.half())
    # fp32 q and caches pass every rule (split TF32 in the decode kernel): they reach the device check
    expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q.float(), kc.float(), vc.float())
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q.float(), kc, vc)
    expect(ErrorCode.UNSUPPORTED_HEAD_DIM, ValueError, call, q[..., :60], kc[..., :60], vc[..., :60])
    # a contiguous cache with fewer entries than sequences needs cache_batch_idx
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc[:1], vc[:1])


def test_grid_limit():
    q = torch.zeros(65536, 1, 2, 8, dtype=torch.bfloat16)
    kc = torch.zeros(65536, 16, 1, 8, dtype=torch.bfloat16)
    msg = expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, kc)
    assert "grid" in msg


def test_new_keys():
    q, kc, vc, k, v = inputs()
    expect(ErrorCode.NULL_POINTER, TypeError, call, q, kc, vc, k=k, cache_seqlens=3)
    expect(ErrorCode.NULL_POINTER, TypeError, call, q, kc, vc, k=k, v=v)  # where to append?
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, k=k[:, :, :1], v=v[:, :, :1], cache_seqlens=3)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, k=k, v=torch.cat([v, v], 1), cache_seqlens=3)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, k=k.half(), v=v.half(), cache_seqlens=3)
    # cache too small for the append (an int length is checked on the host)
    msg = expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, k=k, v=v, cache_seqlens=64)
    assert "does not fit" in msg


def test_cache_seqlens_dtype_and_length():
    q, kc, vc, k, v = inputs()
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, cache_seqlens=torch.tensor([1, 2]))
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc,
           cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32))
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, cache_seqlens=2.0)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, cache_seqlens=True)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, cache_seqlens=-1)


def test_block_table_rules():
    q, kc, vc, k, v = inputs(paged=True)
    table = torch.zeros(2, 4, dtype=torch.int32)
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, block_table=table.long())
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, block_table=table[:1])
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, block_table=table[:, :0])
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, call, q, kc, vc, block_table=table,
           cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    # block sizes: multiples of 16 only
    msg = expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, call, q, kc[:, :8], vc[:, :8],
                 block_table=table)
    assert "multiple of 16" in msg
    # capacity is max_blocks * block_size = 64 keys
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, k=k, v=v, cache_seqlens=64, block_table=table)


def test_num_splits_and_flags():
    q, kc, vc, _, _ = inputs()
    for bad in (-1, 257, 1.5, True):
        expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, num_splits=bad)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, rotary_interleaved="yes")
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, causal=2)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, return_softmax_lse=None)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, softmax_scale=-1.0)


def test_cpu_tensors_rejected_before_anything_is_written():
    q, kc, vc, k, v = inputs()
    expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q, kc, vc, k=k, v=v, cache_seqlens=3)
    assert torch.all(kc == 0) and torch.all(vc == 0)


def _value_error(problem, **tensors):
    flags = kvcache_value_flags(problem, tensors.get("cache_seqlens"), tensors.get("cache_batch_idx"),
                                tensors.get("block_table"), torch.device("cpu"), tensors.get("cache_leftpad"))
    assert flags is not None
    try:
        raise_for_kvcache_values(flags.tolist(), problem)
    except cute_flash.InvalidDimensionError as error:
        return str(error)
    return None


def _problem(paged=False, **kw):
    q, kc, vc, k, v = inputs(paged=paged)
    table = torch.zeros(2, 4, dtype=torch.int32) if paged else None
    return check_kvcache(q, kc, vc, k, v, kw.get("cache_seqlens", torch.zeros(2, dtype=torch.int32)),
                         kw.get("cache_batch_idx"), None, table, (-1, -1), 0.0, True, None, 0)[0]


def test_value_rules():
    i32 = dict(dtype=torch.int32)
    contiguous = _problem()
    assert _value_error(contiguous, cache_seqlens=torch.tensor([0, 63], **i32)) is None
    assert "negative" in _value_error(contiguous, cache_seqlens=torch.tensor([-1, 3], **i32))
    assert "exceeds" in _value_error(contiguous, cache_seqlens=torch.tensor([0, 64], **i32))
    assert "cache_batch_idx" in _value_error(contiguous, cache_seqlens=torch.tensor([0, 1], **i32),
                                             cache_batch_idx=torch.tensor([0, 2], **i32))
    assert "cache_batch_idx" in _value_error(contiguous, cache_seqlens=torch.tensor([0, 1], **i32),
                                             cache_batch_idx=torch.tensor([-1, 0], **i32))
    paged = _problem(paged=True)  # 8 pages of 16 keys; 4 pages per sequence
    lengths = torch.tensor([15, 40], **i32)  # + 1 new key: sequence 0 uses 1 page, sequence 1 uses 3
    table = torch.tensor([[7, -1, 99, 99], [0, 1, 2, 99]], **i32)  # unused entries may hold anything
    assert _value_error(paged, cache_seqlens=lengths, block_table=table) is None
    bad = table.clone()
    bad[1, 2] = 8
    assert "block_table" in _value_error(paged, cache_seqlens=lengths, block_table=bad)
    bad[1, 2] = -3
    assert "block_table" in _value_error(paged, cache_seqlens=lengths, block_table=bad)
    bad = table.clone()
    bad[0, 1] = 8  # sequence 0 reaches its second page only one key later
    assert _value_error(paged, cache_seqlens=lengths, block_table=bad) is None
    assert "block_table" in _value_error(paged, cache_seqlens=lengths + 1, block_table=bad)
    # cache_leftpad: from 0 to the sequence's old keys (equal: only the appended keys are seen)
    five_nine = torch.tensor([5, 9], **i32)
    assert _value_error(contiguous, cache_seqlens=five_nine, cache_leftpad=torch.tensor([5, 0], **i32)) is None
    for pads in ([6, 0], [0, -1]):
        error = _value_error(contiguous, cache_seqlens=five_nine, cache_leftpad=torch.tensor(pads, **i32))
        assert "cache_leftpad" in error


def test_rotary_arguments():
    """rotary_cos / rotary_sin are honoured (cute_flash/rotary.py); what they cannot mean is refused
    before anything is written."""
    q, kc, vc, k, v = inputs()  # head dim 64, a cache of 64 keys
    table = torch.ones(64, 16)
    append = dict(k=k, v=v, cache_seqlens=3)
    expect(ErrorCode.NULL_POINTER, TypeError, call, q, kc, vc, rotary_cos=table, **append)
    msg = expect(ErrorCode.NULL_POINTER, TypeError, call, q, kc, vc, rotary_cos=table, rotary_sin=table)
    assert "appended keys" in msg
    expect(ErrorCode.UNSUPPORTED_DTYPE, TypeError, call, q, kc, vc, rotary_cos=table.int(), rotary_sin=table.int(),
           **append)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, rotary_cos=table[0], rotary_sin=table[0], **append)
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, rotary_cos=table, rotary_sin=table[:, :8],
           **append)
    wide = torch.ones(64, 40)  # rotary_dim 80 > head dim 64
    expect(ErrorCode.DIMENSION_MISMATCH, ValueError, call, q, kc, vc, rotary_cos=wide, rotary_sin=wide, **append)
    short = torch.ones(63, 16)  # positions up to 63 in a cache of 64
    msg = expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q, kc, vc, rotary_cos=short, rotary_sin=short, **append)
    assert "positions" in msg
    # A causal query block longer than the append reaches past the cache's last position.
    q3 = torch.randn(2, 3, 8, 64).to(torch.bfloat16)
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q3, kc, vc, rotary_cos=table, rotary_sin=table, causal=True,
           **append)
    # So does a windowed one (flash-attn 2 rotates "local" queries by position too), not one whose
    # window sides reach past the cache (no window: its queries all sit at cache_seqlens).
    expect(ErrorCode.INVALID_DIMENSION, ValueError, call, q3, kc, vc, rotary_cos=table, rotary_sin=table,
           window_size=(16, -1), **append)
    expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q3, kc, vc, rotary_cos=table, rotary_sin=table,
           window_size=(64, -1), **append)
    # Every rule passed: the call stops at the device check, nothing written.
    expect(ErrorCode.CUDA_ERROR, RuntimeError, call, q, kc, vc, rotary_cos=table, rotary_sin=table, **append)
    assert torch.all(kc == 0) and torch.all(vc == 0)
