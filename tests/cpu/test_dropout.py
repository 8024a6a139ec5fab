"""Dropout without a GPU: the torch Philox4x32-10 against Random123's known answers, the keep mask's
element -> counter mapping against a brute-force one, flash_attn_func's autograd path (on the float64
reference kernels) against autograd of the reference with the same mask, validation, and the sm80
dropout kernels compiling without spills."""

import pytest
import torch

import cute_flash
from cute_flash import dispatch
from cute_flash.dropout import dropout_keep_mask, draw_rng_state, kernel_dropout_args, keep_threshold, philox4x32_10
from cute_flash.errors import ErrorCode
from cute_flash.flash_attn_interface import flash_attn_func, flash_attn_varlen_qkvpacked_func
from cute_flash.reference import reference_attention

from .reference_kernels import install
from .typed_errors import expect

# Random123's kat_vectors for philox4x32_10: (counter, key, result)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expected


def test_keep_mask_maps_each_element_to_its_counter_and_word():
    batch, nheads, sq, sk, p = 2, 3, 37, 29, 0.3
    # a seed past 2^63 (stored as its int64 bits), an offset past 2^63 whose streams carry into the high word
    seed, offset = 0x9234_5678_9ABC_DEF0, 2**63 + 2**32 - 2
    keep = dropout_keep_mask(batch, nheads, sq, sk, p, torch.tensor([seed - 2**64, offset - 2**64]))
    threshold = keep_threshold(p)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 36, 28), (0, 1, 8, 3), (1, 0, 17, 10), (1, 2, 24, 27)]:
        stream = (offset + b * nheads + h) % 2**64
        counter = (j // 2, (i // 16) * 8 + i % 8, stream & 0xFFFFFFFF, stream >> 32)
        words = philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32))
        word = int(words[2 * (i % 16 // 8) + j % 2])
        assert bool(keep[b, h, i, j]) == (word >= threshold), (b, h, i, j)
    assert abs(keep.double().mean().item() - (1 - p)) < 4 * (p * (1 - p) / keep.numel()) ** 0.5


def test_generator_draw_keeps_a_seed_past_2_63_and_advances_the_offset(monkeypatch):
    """draw_rng_state on a stand-in for torch's CUDA generator (no GPU here)."""

    class Generator:
        offset = 12

        def initial_seed(self):
            return 2**64 - 5

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            self.offset = offset

    generator = Generator()
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,), raising=False)
    state = draw_rng_state(torch.device("cuda", 0), 3, 3)
    assert state.tolist() == [-5, 12] and generator.offset == 24  # 9 streams, rounded up to 12


def test_kernel_arguments_are_the_bits_of_seed_offset_and_threshold():
    seed, offset, threshold, scale = kernel_dropout_args(0.75, torch.tensor([-1, 8]))
    assert (seed, offset, threshold & 0xFFFFFFFF, scale) == (-1, 8, 3 << 30, 4.0)
    assert keep_threshold(0.0) == 0


def test_dropout_forward_and_backward_match_the_reference_with_the_same_mask(monkeypatch):
    """flash_attn_func's autograd path with dropout (the reference kernels stand in for the GPU
    ones, the generator's draw for torch's CUDA generator) against autograd of reference_attention
    with the mask the kernels would draw."""
    kernels = install(monkeypatch)
    states = iter([torch.tensor([7, 0]), torch.tensor([7, 4])])
    monkeypatch.setattr(cute_flash.autograd, "draw_rng_state", lambda device, batch, nheads: next(states))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 16, requires_grad=True) for n, h in ((19, 4), (23, 2), (23, 2)))
    dout = torch.randn(2, 19, 4, 16)
    for causal in (False, True):
        out = flash_attn_func(q, k, v, 0.25, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        rng_state = kernels.forward_calls[-1]["rng_state"]
        assert kernels.backward_calls[-1]["rng_state"] is rng_state  # the backward regenerates that mask
        keep = dropout_keep_mask(2, 4, 19, 23, 0.25, rng_state)
        ref, _ = reference_attention(q, k, v, causal=causal, dropout_p=0.25, dropout_keep=keep)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
        torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-5, atol=1e-5)


def test_dropout_rejections_come_before_any_kernel(monkeypatch):
    kernels = install(monkeypatch)
    q = torch.randn(1, 8, 2, 16)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, flash_attn_func, q, q, q, 1.0)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, flash_attn_func, q, q, q, 0.1,
           return_attn_probs=True)
    qkv = torch.randn(8, 3, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, flash_attn_varlen_qkvpacked_func,
           qkv, cu, 8, 0.1)
    assert kernels.forward_calls == []


def test_varlen_dropout_has_no_plan():
    with pytest.raises(ValueError, match="variable-length"):
        dispatch.plan_forward((8, 0), torch.float16, 64, False, family="sm80", varlen=True, dropout=True)


# (pass, dtype, head dim, causal, deterministic, gqa, mods, capability)
VARIANTS = [
    ("fwd", torch.bfloat16, 64, False, False, False, dispatch.NO_MODS, (8, 0)),
    ("fwd", torch.bfloat16, 32, True, False, False, dispatch.NO_MODS, (8, 0)),
    ("fwd", torch.float16, 128, True, False, False, dispatch.NO_MODS, (9, 0)),
    ("fwd", torch.float32, 64, False, False, False, dispatch.NO_MODS, (8, 0)),
    ("fwd", torch.bfloat16, 64, False, False, False, (True, True, True), (8, 0)),
    ("bwd", torch.bfloat16, 64, False, False, False, dispatch.NO_MODS, (8, 0)),
    ("bwd", torch.float16, 64, True, True, True, dispatch.NO_MODS, (9, 0)),
    # d128 on sm_80 reads P back from smem: the signed P waits in dS's tile
    ("bwd", torch.bfloat16, 128, False, False, False, dispatch.NO_MODS, (8, 0)),
    ("bwd", torch.bfloat16, 128, True, False, False, (False, True, False), (8, 0)),
    ("bwd", torch.float16, 256, False, False, False, dispatch.NO_MODS, (8, 0)),
    ("bwd", torch.float32, 64, True, False, False, dispatch.NO_MODS, (8, 0)),
    ("fwd", torch.bfloat16, 256, True, False, False, (False, True, True), (8, 0)),
    # the H100 runs fp32 and the head dims the Hopper backward does not take on them, for sm_90a
    ("bwd", torch.float32, 128, False, False, True, dispatch.NO_MODS, (9, 0)),
    ("bwd", torch.bfloat16, 72, False, False, True, dispatch.NO_MODS, (9, 0)),
    # the Hopper backward: every head dim it takes dropout at, modifications, deterministic
    ("bwd", torch.float16, 64, False, False, False, (True, True, True), (9, 0)),
    ("bwd", torch.bfloat16, 96, True, True, False, dispatch.NO_MODS, (9, 0)),
    ("bwd", torch.bfloat16, 128, True, False, True, dispatch.NO_MODS, (9, 0)),
    ("bwd", torch.float16, 128, False, True, False, (True, True, False), (9, 0)),
    ("bwd", torch.float16, 192, True, False, False, dispatch.NO_MODS, (9, 0)),
    ("bwd", torch.bfloat16, 256, False, True, False, (False, True, True), (9, 0)),
    # the Hopper forward: three- and two-group tiles, a window with dropout; hd 192 stays sm80
    ("fwd", torch.bfloat16, 64, False, False, False, dispatch.NO_MODS, (9, 0)),
    ("fwd", torch.float16, 64, True, False, False, dispatch.NO_MODS, (9, 0)),
    ("fwd", torch.bfloat16, 96, True, False, False, dispatch.NO_MODS, (9, 0)),
    ("fwd", torch.bfloat16, 128, False, False, False, (True, False, False), (9, 0)),
    ("fwd", torch.float16, 192, False, False, False, dispatch.NO_MODS, (9, 0)),
    ("fwd", torch.bfloat16, 64, False, False, False, (False, False, True), (9, 0)),
]


def _id(v):
    return f"{v[0]}-{str(v[1])[6:]}-d{v[2]}-{'causal' if v[3] else 'full'}{'-det' if v[4] else ''}" \
           f"{'-gqa' if v[5] else ''}{'-mods' if v[6] != dispatch.NO_MODS else ''}-sm{v[7][0]}0"


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_dropout_kernels_compile_without_spills(variant):
    from cute_flash.compile_report import compile_report

    pass_name, dtype, head_dim, causal, deterministic, gqa, mods, capability = variant
    if pass_name == "fwd":
        plan = dispatch.plan_forward(capability, dtype, head_dim, causal, num_sms=132, mods=mods, dropout=True)
    else:
        plan = dispatch.plan_backward(capability, dtype, head_dim, causal, deterministic, gqa, mods=mods,
                                      dropout=True).main
    hopper_forward = (pass_name == "fwd" and capability == (9, 0) and dtype != torch.float32 and head_dim <= 128
                      and not mods[2])
    hopper_backward = (pass_name == "bwd" and capability == (9, 0) and dtype != torch.float32
                       and head_dim in (64, 96, 128, 192, 256))
    assert plan.family == ("sm90" if hopper_forward or hopper_backward else "sm80") and plan.entry == "call_with_mods"
    assert plan.config.dropout
    kernel, args = plan.build()
    report = compile_report(kernel, args, arch=plan.arch)
    assert "mul.hi.u32" in report.ptx  # the Philox rounds
    # S^T's Philox words are traded between lanes 4 apart (philox.apply_dropout_transposed)
    assert "shfl.sync.bfly" in report.ptx or not hopper_backward
    assert report.spill_bytes == 0, f"{report.registers} registers, {report.spill_bytes} B spilled"


def test_hopper_backward_dropout_dispatch():
    """On sm_90 a dropout backward runs the Hopper kernel (its call_with_mods takes the dropout
    values after the four score modifications; at head dim 128 on 64 keys per CTA, where 128
    spill); fp32 and the other head dims keep the sm80 kernel."""
    for head_dim in (64, 96, 128, 192, 256, 72):
        plan = dispatch.plan_backward((9, 0), torch.bfloat16, head_dim, False, dropout=True).main
        hopper = head_dim in (64, 96, 128, 192, 256)
        assert not hopper or plan.config.n_block_size == (64 if head_dim >= 128 else 128)
        assert plan.family == ("sm90" if hopper else "sm80") and plan.entry == "call_with_mods"
        assert plan.config.dropout and len(plan.fake_args) == 12 + 4 + 4  # the main arguments, mods, dropout
    assert dispatch.plan_backward((9, 0), torch.float32, 64, False, dropout=True).main.family == "sm80"
    assert dispatch.plan_backward((9, 0), torch.bfloat16, 64, False).main.config.m_block_size == 128
    assert dispatch.plan_backward((9, 0), torch.bfloat16, 64, False, dropout=True).main.config.m_block_size == 64
