"""Calling the C library from Python through ctypes, as any language with a C FFI would: forward
and backward of bf16 attention on [B, H, N, D] torch tensors, checked against float64 autograd.
Only torch is needed besides the library (no cute_flash import).

    cute-flash export --arch sm_90a --dtypes bf16 --head-dims 64 -o build/cute-flash-c
    python examples/ctypes_example.py build/cute-flash-c/libcute_flash.so

Exit status 0 when every result is within its error bound.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

POINTER, INT, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIZES = [INT] * 4 + [FLOAT, INT, POINTER]  # batch, heads, seq_len, head_dim, scale, causal, stream


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name in ("cuflash_error_string", "cuflash_last_error_message", "cuflash_build_info"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.cuflash_attention_forward_bf16.argtypes = [POINTER] * 5 + SIZES
    lib.cuflash_attention_backward_bf16.argtypes = [POINTER] * 9 + SIZES
    return lib


def check(lib: ctypes.CDLL, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"cute-flash error {code}: {lib.cuflash_error_string(code).decode()} "
                           f"({lib.cuflash_last_error_message().decode()})")


def reference(q, k, v, scale: float, causal: bool):
    """Attention of [B, H, N, D] tensors in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def main(path: str, batch: int = 2, heads: int = 4, seq_len: int = 300, head_dim: int = 64, causal: bool = True) -> int:
    lib = load(path)
    print(lib.cuflash_build_info().decode(), end="")
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, dq, dk, dv = (torch.empty(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(shape[:3], device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim)
    # The library queues its work on the stream it is given: torch's current one here.
    stream = torch.cuda.current_stream().cuda_stream
    sizes = (batch, heads, seq_len, head_dim, scale, int(causal), stream)
    check(lib, lib.cuflash_attention_forward_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                  lse.data_ptr(), *sizes))
    check(lib, lib.cuflash_attention_backward_bf16(dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                   out.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                                   dv.data_ptr(), *sizes))

    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = reference(*inputs, scale, causal)
    want_grads = torch.autograd.grad(want_out, inputs, dout.double())
    # bf16 outputs carry a relative rounding of 2^-8; the gradients also go through bf16 P and dS.
    results = [("O", relative_error(out, want_out), 1e-2), ("L", (lse - want_lse).abs().max().item(), 1e-3)]
    results += [(name, relative_error(got, want), 3e-2) for name, got, want in zip(("dQ", "dK", "dV"), (dq, dk, dv),
                                                                                  want_grads)]
    for name, error, bound in results:
        print(f"{name}: max error {error:.2e} (bound {bound:.0e})")
    failed = [name for name, error, bound in results if not error < bound]
    print("FAILED: " + ", ".join(failed) if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} path/to/libcute_flash.so")
    sys.exit(main(sys.argv[1]))
