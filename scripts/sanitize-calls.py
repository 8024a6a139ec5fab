#!/usr/bin/env python3
"""One small call of each kernel family dispatch can pick, for compute-sanitizer
(scripts/sanitize.sh runs it under memcheck, racecheck and synccheck):

  sm90 forward   a short causal problem (persistent walk, planned tail) and a long non-causal one
                 with fewer tiles than SMs (dynamic schedule, tiles split along the keys)
  sm80 forward   the short causal problem with CUTE_FLASH_KERNEL_ARCH=sm80
  backward       preprocess, main and postprocess kernels, grouped query heads, d64: the native
                 family's (the sm90 backward on Hopper) and the sm80 family's

On a GPU without sm90 kernels the sm90 lines run the sm80 family. Each call's outputs are checked
for unwritten NaN poison. With --expect-warm the script fails if any kernel had to be compiled:
under the sanitizer it should watch kernels, not the compiler.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import cute_flash
from cute_flash import cache


def randn(batch, seqlen, nheads, head_dim, dtype=torch.bfloat16):
    return torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=dtype)


def checked(name, *tensors):
    torch.cuda.synchronize()
    for t in tensors:
        if not torch.isfinite(t).all():
            raise SystemExit(f"{name}: output not fully written")
    print(f"{name}: ok", flush=True)


def forward(name, q, k, v, causal):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    cute_flash.forward(q, k, v, out=out, lse=lse, causal=causal)
    checked(name, out, lse)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-warm", action="store_true", help="fail if a kernel was compiled")
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    os.environ.pop("CUTE_FLASH_KERNEL_ARCH", None)
    q, k, v = randn(1, 300, 2, 128), randn(1, 300, 1, 128), randn(1, 300, 1, 128)
    forward("forward, native family, short causal d128", q, k, v, causal=True)
    long_k, long_v = randn(1, 2200, 2, 128), randn(1, 2200, 2, 128)
    forward("forward, native family, long non-causal d128", q, long_k, long_v, causal=False)

    os.environ["CUTE_FLASH_KERNEL_ARCH"] = "sm80"
    forward("forward, sm80 family, short causal d128", q, k, v, causal=True)
    del os.environ["CUTE_FLASH_KERNEL_ARCH"]

    q, k, v, dout = randn(1, 300, 4, 64), randn(1, 257, 2, 64), randn(1, 257, 2, 64), randn(1, 300, 4, 64)
    out, lse = cute_flash.forward(q, k, v, causal=True)
    for family in ("native", "sm80"):
        if family == "sm80":
            os.environ["CUTE_FLASH_KERNEL_ARCH"] = "sm80"
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        cute_flash.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], causal=True)
        checked(f"backward, {family} family, causal d64 GQA 4:2", *grads)
    del os.environ["CUTE_FLASH_KERNEL_ARCH"]

    if args.expect_warm and cache.stats["compiled"]:
        print(f"{cache.stats['compiled']} kernels were compiled in this run: warm the cache first", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
