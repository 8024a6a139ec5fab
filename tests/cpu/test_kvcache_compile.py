"""flash_attn_with_kvcache under torch.compile, without a GPU: the operator it becomes there
(`cute_flash::kvcache_attention`, which writes the caches) propagates shapes under fake tensors
and raises shape errors while tracing; a compiled decode step keeps it without a graph break and,
with a float64 stand-in for the kernels, gives the eager step's outputs and cache writes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_flash
from cute_flash import kvcache, reference_attention
from cute_flash.kvcache import flash_attn_with_kvcache

I32 = dict(dtype=torch.int32)


def _stand_in(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits):
    """The kernels' work in float64 on the CPU for a contiguous cache: append, then attend each
    sequence to its keys (bottom-right causal)."""
    lengths = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * q.shape[0]
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b, length in enumerate(lengths):
        if new:
            k_cache[b, length:length + new] = k[b]
            v_cache[b, length:length + new] = v[b]
        out, lse = reference_attention(q[b:b + 1], k_cache[b:b + 1, :length + new], v_cache[b:b + 1, :length + new],
                                       softmax_scale, causal, window_size, softcap)
        outs.append(out.to(q.dtype))
        lses.append(lse.float())
    return torch.cat(outs), torch.cat(lses)


def _decode_inputs(batch=2, seqlen_q=1, heads=(8, 2), head_dim=64, capacity=32):
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads[0], head_dim)
    k_cache = torch.randn(batch, capacity, heads[1], head_dim)
    v_cache = torch.randn(batch, capacity, heads[1], head_dim)
    k = torch.randn(batch, seqlen_q, heads[1], head_dim)
    v = torch.randn(batch, seqlen_q, heads[1], head_dim)
    lengths = torch.tensor([5, 17][:batch], **I32)
    return q, k_cache, v_cache, k, v, lengths


def test_op_shapes_and_rules_under_fake_tensors():
    with FakeTensorMode() as mode:
        q, k_cache, v_cache, k, v, lengths = (mode.from_tensor(t) for t in _decode_inputs(seqlen_q=3))
        out, lse = torch.ops.cute_flash.kvcache_attention(q, k_cache, v_cache, k, v, None, None, lengths, None, None,
                                                          None, None, None, True, -1, -1, 0.0, True, None, 0)
        assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, 3) and lse.dtype == torch.float32
        # a shape rule while tracing: new keys of another head dim
        with pytest.raises(cute_flash.DimensionMismatchError):
            torch.ops.cute_flash.kvcache_attention(q, k_cache, v_cache, k[..., :32], v[..., :32], None, None, lengths,
                                                   None, None, None, None, None, True, -1, -1, 0.0, True, None, 0)


@pytest.mark.parametrize("int_lengths", [False, True])
def test_compiled_decode_step_keeps_the_op_and_writes_the_cache(monkeypatch, int_lengths):
    monkeypatch.setattr(kvcache, "_attend", _stand_in)
    q, k_cache, v_cache, k, v, lengths = _decode_inputs()
    seqlens = 9 if int_lengths else lengths

    def step(q, k_cache, v_cache, k, v, seqlens):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                           window_size=(6, 0), return_softmax_lse=True)
        return out * 2, lse

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # fullgraph: a graph break is an error
    eager_caches = (k_cache.clone(), v_cache.clone())
    out, lse = compiled(q, k_cache, v_cache, k, v, seqlens)
    ref_out, ref_lse = step(q, *eager_caches, k, v, seqlens)
    assert len(graphs) == 1 and "kvcache_attention" in graphs[0]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # the compiled step's append reached the caller's caches
    torch.testing.assert_close(k_cache, eager_caches[0])
    torch.testing.assert_close(v_cache, eager_caches[1])
    assert not torch.equal(k_cache, _decode_inputs()[1])


def test_eager_calls_skip_the_op(monkeypatch):
    monkeypatch.setattr(kvcache, "kvcache_attention", lambda *args: pytest.fail("the op layer ran eagerly"))
    monkeypatch.setattr(kvcache, "_attend", _stand_in)
    q, k_cache, v_cache, k, v, lengths = _decode_inputs()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert out.shape == q.shape
