"""The float64 reference against a direct, loop-based evaluation of the definition."""

import math

import pytest
import torch

from cute_flash import reference_attention


def naive(q, k, v, scale, causal):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = torch.stack([(q[bi, i, hi].double() * k[bi, j, kh].double()).sum() * scale for j in keys])
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.exp(s - lse[bi, hi, i])
                out[bi, i, hi] = sum(p[n] * v[bi, j, kh].double() for n, j in enumerate(keys))
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, h, hkv", [(5, 7, 4, 2), (7, 3, 2, 1), (1, 1, 1, 1), (6, 6, 3, 3)])
def test_matches_definition(sq, sk, h, hkv, causal):
    torch.manual_seed(sq * 100 + sk)
    q, k, v = torch.randn(2, sq, h, 8), torch.randn(2, sk, hkv, 8), torch.randn(2, sk, hkv, 8)
    out, lse = reference_attention(q, k, v, softmax_scale=0.3, causal=causal)
    ref_out, ref_lse = naive(q, k, v, 0.3, causal)
    assert out.dtype == torch.float64 and out.shape == q.shape and lse.shape == (2, h, sq)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_rows_without_keys_and_gradients_are_finite():
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = reference_attention(q, k, v, causal=True)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isneginf(lse[..., :3]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :3] == 0)


def test_default_scale_and_gradcheck():
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = reference_attention(q, k, v)
    out2, _ = reference_attention(q, k, v, softmax_scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, out2)
    assert torch.autograd.gradcheck(lambda a, b, c: reference_attention(a, b, c, causal=True)[0], (q, k, v))
