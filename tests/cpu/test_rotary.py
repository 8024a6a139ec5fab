"""The rotary embedding of flash_attn_with_kvcache's new tokens (cute_flash/rotary.py) against an
independent formulation: each rotated channel pair as a complex number times e^(i * angle)."""

import pytest
import torch

from cute_flash.rotary import apply_rotary, rotate_new_tokens


def tables(positions: int, rotary_dim: int, dtype):
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * torch.linspace(0.05, 1.3, rotary_dim // 2,
                                                                                  dtype=torch.float64)
    return angles, angles.cos().to(dtype), angles.sin().to(dtype)


def reference(x, angles, positions, rotary_dim, interleaved):
    """x rotated at positions (batch, seqlen), in float64 through complex multiplication."""
    x = x.double()
    half = rotary_dim // 2
    if interleaved:
        pairs = torch.complex(x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2])
    else:
        pairs = torch.complex(x[..., :half], x[..., half:rotary_dim])
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[positions][:, :, None, :]
    if interleaved:
        rotated = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype, rotary_dim", [(torch.float32, 64), (torch.bfloat16, 32), (torch.float16, 48)])
def test_apply_rotary_matches_complex_rotation(dtype, rotary_dim, interleaved):
    x = torch.randn(2, 5, 3, 64).to(dtype)
    angles, cos, sin = tables(40, rotary_dim, torch.float32)
    positions = torch.randint(0, 40, (2, 5))
    out = apply_rotary(x, cos, sin, positions, interleaved)
    expected = reference(x, angles, positions, rotary_dim, interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # the channels past rotary_dim pass unchanged


@pytest.mark.parametrize("causal", [True, False])
def test_new_tokens_rotate_at_their_positions(causal):
    """Keys at cache_seqlens[b] + i; queries likewise when causal, else all at cache_seqlens[b]."""
    q = torch.randn(2, 4, 6, 32)
    k = torch.randn(2, 4, 2, 32)
    angles, cos, sin = tables(64, 32, torch.float32)
    lengths = torch.tensor([0, 37], dtype=torch.int32)
    q_rot, k_rot = rotate_new_tokens(q, k, cos, sin, lengths, causal, interleaved=False)
    steps = torch.arange(4)[None, :]
    key_positions = lengths.long()[:, None] + steps
    query_positions = key_positions if causal else lengths.long()[:, None].expand(-1, 4)
    torch.testing.assert_close(k_rot.double(), reference(k, angles, key_positions, 32, False), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_rot.double(), reference(q, angles, query_positions, 32, False), rtol=1e-5, atol=1e-5)
