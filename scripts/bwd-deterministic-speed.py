"""Backward TFLOP/s with and without deterministic=True, and their ratio (bf16, 16k tokens,
hidden 2048 as in the paper suite; triton's do_bench, best of two). Run on the GPU:

    python scripts/bwd-deterministic-speed.py [--cells 64:8192:0,128:8192:1,...]

Set CUTE_FLASH_KERNEL_ARCH=sm80 to time the sm80 backward instead of the Hopper one.
"""

import argparse

import torch
import triton

import cute_flash

DEFAULT_CELLS = "64:8192:0,64:8192:1,96:8192:0,96:8192:1,128:8192:0,128:8192:1,128:2048:0"


def measure(head_dim: int, seqlen: int, causal: bool) -> tuple[float, float]:
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = cute_flash.forward(q, k, v, causal=causal)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    rates = []
    for deterministic in (False, True):
        def call():
            cute_flash.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=causal,
                                deterministic=deterministic)
        ms = min(triton.testing.do_bench(call, warmup=50, rep=300) for _ in range(2))
        rates.append(flops / ms / 1e9)
    return rates[0], rates[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="head_dim:seqlen:causal(0/1), comma-separated")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; hd seqlen causal  bwd TF/s  deterministic TF/s  ratio")
    for cell in args.cells.split(","):
        head_dim, seqlen, causal = (int(x) for x in cell.split(":"))
        plain, ordered = measure(head_dim, seqlen, bool(causal))
        print(f"{head_dim:3d} {seqlen:6d} {str(bool(causal)):5s} {plain:8.1f} {ordered:8.1f} {ordered / plain:6.3f}",
              flush=True)


if __name__ == "__main__":
    main()
