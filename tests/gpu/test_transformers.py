"""A small randomly initialised Llama (grouped-query heads) under attn_implementation from
cute_flash.hf against the same weights under "sdpa": logits and every parameter gradient, in bf16,
both within the error of bf16 "sdpa" against an fp32 model; padded batches run "sdpa" itself."""

import copy

import pytest
import torch
import torch.nn.functional as F

from cute_flash import hf
from cute_flash.errors import MissingDependencyError

from .kernel_spy import count_kernel_calls

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

VOCAB = 1000


@pytest.fixture(scope="module")
def name():
    try:
        return hf.register()
    except MissingDependencyError as error:
        pytest.skip(str(error))


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setattr(hf, "_warned", set())
    return count_kernel_calls(monkeypatch)


def models(name):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    built = {}
    torch.manual_seed(0)
    for key, implementation, dtype in (("fp32", "sdpa", torch.float32), ("sdpa", "sdpa", torch.bfloat16),
                                        ("ours", name, torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
        if built:
            model.load_state_dict(built["fp32"].state_dict())
        built[key] = model.to(device="cuda", dtype=dtype).eval()
        assert model.config._attn_implementation == implementation
    return built


def run(model, input_ids, attention_mask=None):
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    labels = input_ids.roll(-1, dims=1)
    F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)).backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def relative(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_matches_sdpa_without_padding(name, spy):
    built = models(name)
    input_ids = torch.randint(0, VOCAB, (2, 160), device="cuda")
    exact = run(built["fp32"], input_ids)
    sdpa = run(built["sdpa"], input_ids)
    spy.update(forward=0, backward=0)
    ours = run(built["ours"], input_ids)
    assert spy == {"forward": 2, "backward": 2}, "one forward and one backward per layer through cute-flash"
    sdpa_err = (sdpa[0] - exact[0]).abs().max().item()
    ours_err = (ours[0] - exact[0]).abs().max().item()
    assert ours_err <= 2 * sdpa_err + 1e-3, f"logits: ours {ours_err:.3e}, sdpa {sdpa_err:.3e}"
    for param in exact[1]:
        sdpa_rel, ours_rel = relative(sdpa[1][param], exact[1][param]), relative(ours[1][param], exact[1][param])
        assert ours_rel <= 2 * sdpa_rel + 1e-3, f"{param}: ours {ours_rel:.3e}, sdpa {sdpa_rel:.3e}"


def test_padded_batch_runs_sdpa(name, spy):
    built = models(name)
    input_ids = torch.randint(0, VOCAB, (2, 160), device="cuda")
    mask = torch.ones(2, 160, dtype=torch.long, device="cuda")
    mask[0, :37] = 0  # left padding
    mask[1, 150:] = 0  # right padding
    sdpa = run(built["sdpa"], input_ids, mask)
    spy.update(forward=0, backward=0)
    with pytest.warns(UserWarning, match="attention mask"):
        ours = run(built["ours"], input_ids, mask)
    assert spy == {"forward": 0, "backward": 0}
    assert torch.equal(ours[0], sdpa[0])
    for param in sdpa[1]:
        assert relative(ours[1][param], sdpa[1][param]) <= 1e-2, param

