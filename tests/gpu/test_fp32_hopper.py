"""fp32 on the Hopper forward (kernels/sm90/fwd_tf32.py: split TF32 on wgmma, head dims 64 and 128)
against the float64 reference: out within the design's bar (max abs error < 1e-3 on randn inputs)
and within 10x of torch's fp32 memory-efficient SDPA (TF32 off) on the same inputs; LSE within
1e-4. Ragged and unequal lengths, causal (bottom-right aligned, rows that see no key), grouped-query
heads, NaN-poisoned outputs. On an sm_90 GPU the calls must be served by the Hopper forward (run_forward
checks the family); elsewhere the same checks hold the sm80 split-TF32 forward. Run with -s to see
both errors per case."""

import pytest
import torch

from cute_flash import reference_attention

from ..cpu.test_compile_sm90_fwd_tf32 import CANDIDATES as CPU_CANDIDATES
from .common import FP32_OUT_TOLERANCE, randn, run_forward

pytestmark = pytest.mark.gpu

PEER_FACTOR = 10.0
PEER_FLOOR = 1e-6  # errors at the fp32 rounding of the output itself (a single key) are not compared
LSE_TOLERANCE = 1e-4

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
SHAPES = [
    (2, 1, 1, 4, 4),
    (1, 1, 203, 4, 4),
    (2, 17, 17, 4, 4),
    (1, 113, 203, 4, 4),
    (1, 203, 113, 4, 4),  # causal: the first 90 rows see no key
    (2, 1000, 1000, 8, 2),  # GQA 8:2
    (1, 4096, 4096, 2, 2),
]


def _max_err(got, exact, rows=None) -> float:
    diff = (got.double() - exact.double()).abs()
    if rows is not None:
        diff = diff[rows]
    return diff.max().item() if diff.numel() else 0.0


def _sdpa_efficient(q, k, v, causal):
    """torch's fp32 memory-efficient SDPA (TF32 off) on (B, S, H, D) tensors, with flash's
    bottom-right causal alignment; rows that see no key are not compared."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    mask = None
    if causal:  # torch's own bottom-right causal bias, which the efficient kernel takes natively
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[1], k.shape[1])
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_forward_against_float64_and_sdpa(shape, head_dim, causal):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=torch.float32)
    k, v = (randn(batch, seqlen_k, nheads_kv, head_dim, dtype=torch.float32) for _ in range(2))
    out, lse = run_forward(q, k, v, causal)  # into NaN-poisoned out and lse
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    finite = torch.isfinite(ref_lse)  # (b, h, sq): rows that see a key
    assert torch.equal(torch.isfinite(lse), finite), "rows without keys must have LSE -inf, the others finite"
    assert not torch.isnan(out).any(), "out has NaN (an unwritten or poisoned element)"
    assert torch.equal(out[~finite.transpose(1, 2)], torch.zeros_like(out[~finite.transpose(1, 2)])), \
        "rows without keys must be 0"
    ours = _max_err(out, ref_out)
    lse_err = _max_err(lse, ref_lse, finite)
    rows = finite.transpose(1, 2)  # (b, sq, h)
    theirs = _max_err(_sdpa_efficient(q, k, v, causal), ref_out, rows)
    print(f"fp32 {shape} d{head_dim} {'causal' if causal else 'full'}: out {ours:.2e} (sdpa efficient "
          f"{theirs:.2e}), lse {lse_err:.2e}")
    assert ours < FP32_OUT_TOLERANCE
    assert ours <= PEER_FACTOR * max(theirs, PEER_FLOOR), f"{ours:.2e} vs torch's {theirs:.2e}"
    assert lse_err < LSE_TOLERANCE


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_forward_large_entries_and_strided_inputs(head_dim):
    """q three times larger (scaled scores of std ~3, softmax weights far from uniform) and k, v as
    (B, H, S, D) transposed views, which the prepass reads through their strides."""
    q = randn(2, 300, 4, head_dim, dtype=torch.float32) * 3
    k, v = (randn(2, 257, 4, head_dim, dtype=torch.float32, transposed=True) for _ in range(2))
    out, lse = run_forward(q, k, v, causal=False)
    ref_out, ref_lse = reference_attention(q, k, v)
    assert _max_err(out, ref_out) < FP32_OUT_TOLERANCE
    assert _max_err(lse, ref_lse) < LSE_TOLERANCE * (1 + ref_lse.abs().max().item())


# The configurations compiled as candidates beside the dispatched ones (the CPU compile test's
# list), run directly: each must meet the same bar before dispatch may pick it.
CANDIDATE_CASES = [(d, changes, causal) for d, causal, changes in CPU_CANDIDATES]  # (head_dim, changes, causal)


@pytest.mark.parametrize("shape", [(1, 113, 203, 4, 4), (1, 203, 113, 4, 4), (2, 1000, 1000, 8, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("head_dim,changes,causal", CANDIDATE_CASES,
                         ids=[f"d{d}-{'causal' if c else 'full'}-" + "-".join(f"{k}={v}" for k, v in ch.items())
                              for d, ch, c in CANDIDATE_CASES])
def test_fp32_candidate_configs(head_dim, changes, shape, causal):
    import dataclasses

    from cute_flash import dispatch, launchers
    from cute_flash.kernels.sm90.config import tf32_forward_config
    from cute_flash.kernels.sm90.fwd_tf32 import FlashAttnFwdSm90Tf32

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper fp32 forward's candidates run on sm_90 only")
    config = dataclasses.replace(tf32_forward_config(head_dim, causal), **changes)
    launch = launchers.forward_launcher(dispatch.Plan(FlashAttnFwdSm90Tf32, config,
                                                      dispatch.fake_tf32_forward_args(head_dim), "sm_90a"))
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=torch.float32)
    k, v = (randn(batch, seqlen_k, nheads_kv, head_dim, dtype=torch.float32) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, nheads, seqlen_q), float("nan"), device=q.device)
    launch(q, k, v, out, lse, head_dim ** -0.5)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert not torch.isnan(out).any()
    ours = _max_err(out, ref_out)
    print(f"fp32 candidate {config}: {shape} out {ours:.2e}")
    assert ours < FP32_OUT_TOLERANCE
    assert _max_err(lse, ref_lse, finite) < LSE_TOLERANCE
