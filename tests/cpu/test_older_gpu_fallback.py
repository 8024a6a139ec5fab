"""GPUs older than sm_80: flash_attn_func runs torch's SDPA there, with cute-flash's semantics and one
warning; the choice follows the GPU's compute capability (faked here: this machine has no GPU)."""

import warnings

import pytest
import torch

import cute_flash
from cute_flash import device as devices
from cute_flash import fallback, reference_attention

T4 = "Tesla T4 (sm_75)"


@pytest.fixture
def t4(monkeypatch):
    """Device 0 is a T4, and nothing has warned yet."""
    monkeypatch.setattr(devices, "capability", lambda index: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
    monkeypatch.setattr(fallback, "_warned", set())


def test_the_choice_follows_the_compute_capability(t4, monkeypatch):
    assert fallback.older_gpu(torch.device("cuda", 0)) == T4
    assert fallback.older_gpu(torch.device("cpu")) is None
    monkeypatch.setattr(devices, "capability", lambda index: (8, 0))
    assert fallback.older_gpu(torch.device("cuda", 0)) is None


@pytest.fixture
def runs_on_t4(t4, monkeypatch):
    """flash_attn_func sees a T4 under its (CPU) tensors."""
    monkeypatch.setattr(fallback, "older_gpu", lambda device: T4)


CASES = [  # (seqlen_q, seqlen_k, nheads, nheads_kv, causal)
    (7, 7, 4, 2, True),
    (9, 5, 2, 2, True),   # the first 4 rows see no key: zeros
    (5, 9, 2, 1, True),   # bottom-right alignment
    (6, 6, 2, 2, False),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_kv, causal", CASES)
def test_flash_attn_func_falls_back_to_sdpa_with_cute_flash_semantics(runs_on_t4, seqlen_q, seqlen_k, nheads,
                                                                       nheads_kv, causal):
    torch.manual_seed(0)
    q = torch.randn(2, seqlen_q, nheads, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, seqlen_k, nheads_kv, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with pytest.warns(RuntimeWarning, match=r"Tesla T4 \(sm_75\) is older than sm_80.*flash_attn_func runs torch's"):
        out = cute_flash.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert (out.double() - ref).abs().max() < 3e-2
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all() and (got.double() - want).abs().max() < 5e-2
    if causal and seqlen_q > seqlen_k:
        assert torch.equal(out[:, : seqlen_q - seqlen_k], torch.zeros_like(out[:, : seqlen_q - seqlen_k]))


def test_the_warning_comes_once(runs_on_t4):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
    with pytest.warns(RuntimeWarning):
        cute_flash.flash_attn_func(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cute_flash.flash_attn_func(q, q, q)


def test_what_the_fallback_cannot_give_is_a_typed_error(runs_on_t4):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
    with pytest.warns(RuntimeWarning), pytest.raises(cute_flash.UnsupportedArgumentError, match="no lse"):
        cute_flash.flash_attn_func(q, q, q, return_lse=True)
    with pytest.raises(cute_flash.UnsupportedDtypeError):
        cute_flash.flash_attn_func(q.double(), q.double(), q.double())


def test_sdpa_routing_says_once_that_torch_keeps_the_older_gpu(t4, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.warns(RuntimeWarning, match=r"Tesla T4 \(sm_75\).*scaled_dot_product_attention keeps torch's own"):
        fallback.warn_if_current_gpu_is_older(fallback.SDPA_FALLBACK)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fallback.warn_if_current_gpu_is_older(fallback.SDPA_FALLBACK)
