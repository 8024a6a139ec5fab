"""cute_flash.hf without a GPU: a tiny randomly initialised Llama gives the logits and gradients of
transformers' "sdpa" implementation, with float64 stand-ins for the kernels; every call the
kernels cannot serve goes to "sdpa" (and never to the stand-ins); unsupported options raise."""

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cute_flash  # noqa: E402
from cute_flash import hf  # noqa: E402

from .reference_kernels import install  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    return hf.register()


@pytest.fixture
def kernels(monkeypatch):
    """Stand-in kernels, and every input treated as one the kernels take (CPU, fp32 here)."""
    monkeypatch.setattr(hf, "kernel_support_issue", lambda q, k, v, scale: None)
    monkeypatch.setattr(hf, "_warned", set())
    return install(monkeypatch)


def llama_pair(**overrides):
    """The same tiny random Llama (grouped-query heads) under "sdpa" and under cute-flash."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **overrides)
    torch.manual_seed(0)
    # Separate configs: a model may keep (and set its implementation on) the config it was built from.
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=hf.NAME)
    ours.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and ours.config._attn_implementation == hf.NAME
    return sdpa, ours


def logits_and_grads(model, input_ids, attention_mask=None):
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits.square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(a, b, rtol, atol):
    logits_a, grads_a = a
    logits_b, grads_b = b
    torch.testing.assert_close(logits_a, logits_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=atol, msg=name)


def test_model_without_padding_runs_the_kernels_and_matches_sdpa(kernels):
    sdpa, ours = llama_pair()
    input_ids = torch.randint(0, 97, (2, 11))
    expected = logits_and_grads(sdpa, input_ids)
    got = logits_and_grads(ours, input_ids)
    assert_same(got, expected, rtol=1e-5, atol=1e-5)
    assert len(kernels.forward_calls) == 2 and len(kernels.backward_calls) == 2  # one per layer
    call = kernels.forward_calls[0]
    assert call["causal"] is True and call["q"].shape == (2, 11, 4, 16) and call["k"].shape == (2, 11, 2, 16)
    assert call["softmax_scale"] == pytest.approx(16 ** -0.5)
    ones = torch.ones(2, 11, dtype=torch.long)  # a mask without padding is no mask at all
    assert_same(logits_and_grads(ours, input_ids, ones), expected, rtol=1e-5, atol=1e-5)
    assert len(kernels.forward_calls) == 4


def test_padded_batches_run_sdpa(kernels):
    sdpa, ours = llama_pair()
    input_ids = torch.randint(0, 97, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    expected = logits_and_grads(sdpa, input_ids, mask)
    with pytest.warns(UserWarning, match="attention mask"):
        got = logits_and_grads(ours, input_ids, mask)
    assert_same(got, expected, rtol=0, atol=0)
    assert kernels.forward_calls == [] and kernels.backward_calls == []


def test_generation_with_a_cache_matches_sdpa(kernels):
    """Prefill (causal, no mask) and one-token decoding steps (one query sees every cached key)."""
    sdpa, ours = llama_pair()
    input_ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        expected = sdpa.generate(input_ids, max_new_tokens=5, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        got = ours.generate(input_ids, max_new_tokens=5, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    decode = [c for c in kernels.forward_calls if c["q"].shape[1] == 1]
    assert decode and all(c["causal"] is False and c["k"].shape[1] > 1 for c in decode)


MODULE = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)


def bhsd(b=2, h=4, hkv=2, sq=5, sk=5, d=16, seed=0):
    torch.manual_seed(seed)
    return torch.randn(b, h, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)


def sdpa_attention(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def test_causal_prefill_into_a_longer_cache_is_top_left(kernels):
    """More keys than queries without a mask: SDPA's causal mask starts at the first key."""
    q, k, v = bhsd(sq=5, sk=9)
    out, weights = hf.attention_forward(MODULE, q, k, v, None, scaling=0.25)
    expected, _ = sdpa_attention(MODULE, q, k, v, None, scaling=0.25)
    assert weights is None and out.shape == (2, 5, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert kernels.forward_calls[-1]["k"].shape[1] == 5


@pytest.mark.parametrize("sq, sk, is_causal", [(1, 9, True), (5, 9, False), (6, 6, None)])
def test_kernel_calls_match_sdpa(kernels, sq, sk, is_causal):
    q, k, v = bhsd(sq=sq, sk=sk)
    out, _ = hf.attention_forward(MODULE, q, k, v, None, scaling=0.3, is_causal=is_causal)
    expected, _ = sdpa_attention(MODULE, q, k, v, None, scaling=0.3, is_causal=is_causal)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert len(kernels.forward_calls) == 1


FALLBACKS = [
    ("mask", dict(attention_mask=torch.ones(2, 1, 5, 5, dtype=torch.bool)), "attention mask"),
    ("dropout", dict(dropout=0.1), "dropout"),
    ("position_bias", dict(position_bias=torch.zeros(1, 4, 5, 5)), "position bias"),
    ("more queries than keys", dict(sk=3), "more queries than keys"),
]


@pytest.mark.parametrize("name, case, message", FALLBACKS, ids=[f[0] for f in FALLBACKS])
def test_calls_the_kernels_cannot_serve_run_sdpa(kernels, name, case, message):
    case = dict(case)
    q, k, v = bhsd(sk=case.pop("sk", 5))
    mask = case.pop("attention_mask", None)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=message):
        out, _ = hf.attention_forward(MODULE, q, k, v, mask, scaling=0.3, **case)
    torch.manual_seed(1)
    expected, _ = sdpa_attention(MODULE, q, k, v, mask, scaling=0.3, **case)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert kernels.forward_calls == []


def test_inputs_without_a_kernel_run_sdpa(monkeypatch):
    """The real support check on the CPU: CPU tensors have no kernel."""
    calls = install(monkeypatch)
    monkeypatch.setattr(hf, "_warned", set())
    q, k, v = bhsd()
    with pytest.warns(UserWarning, match="must be on a CUDA GPU"):
        out, _ = hf.attention_forward(MODULE, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(out, sdpa_attention(MODULE, q, k, v, None, scaling=0.3)[0], rtol=0, atol=0)
    assert calls.forward_calls == []


def test_sinks_raise(kernels):
    q, k, v = bhsd()
    with pytest.raises(cute_flash.UnsupportedArgumentError, match="s_aux"):
        hf.attention_forward(MODULE, q, k, v, None, scaling=0.3, s_aux=torch.zeros(4))
    assert kernels.forward_calls == []


def test_softcap_runs_in_the_kernels_and_never_falls_back(kernels):
    """Gemma 2's softcap reaches the kernels; a call that would need "sdpa" (no softcap) raises."""
    q, k, v = bhsd(sq=6, sk=6)
    out, _ = hf.attention_forward(MODULE, q, k, v, None, scaling=0.3, softcap=2.0)
    ref, _ = cute_flash.reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            softmax_scale=0.3, causal=True, softcap=2.0)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    assert kernels.forward_calls[-1]["softcap"] == 2.0
    with pytest.raises(cute_flash.UnsupportedArgumentError, match="softcap"):
        hf.attention_forward(MODULE, q, k, v, torch.ones(2, 1, 6, 6, dtype=torch.bool), scaling=0.3, softcap=2.0)
    assert len(kernels.forward_calls) == 1


def test_registration_names():
    assert hf.register() == hf.NAME  # again: no error
    with pytest.raises(cute_flash.UnsupportedArgumentError, match="hub"):
        hf.register("cute_flash")
    with pytest.raises(cute_flash.UnsupportedArgumentError, match="already registered"):
        hf.register("sdpa")
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface._global_mapping[hf.NAME] is AttentionMaskInterface._global_mapping["sdpa"]
