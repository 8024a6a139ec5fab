"""One pass of one method on one shape, inside the CUDA profiler range, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --set full -o out \\
        python -m perf.profile_call --method ours --pass bwd --headdim 128 --seqlen 8192

The pass runs `--warmup` times first (compiles, autotunes, fills caches), then once between
cudaProfilerStart/Stop, so the report holds exactly the kernels of that one call. The shape
follows the paper suite: `--tokens` tokens in total, hidden 2048 (heads = 2048 / headdim).
"""

from __future__ import annotations

import argparse

import torch

from .bench import DTYPES, make_inputs, make_runner
from .methods import METHOD_NAMES, discover_methods
from .suites import Cell


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m perf.profile_call", description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=METHOD_NAMES, default="ours")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fwdbwd"), default="fwd")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)

    (method,) = discover_methods([args.method])
    if not method.available:
        raise SystemExit(f"{method.name}: {method.note}")
    cell = Cell(batch=max(args.tokens // args.seqlen, 1), seqlen_q=args.seqlen, seqlen_k=args.seqlen,
                nheads=args.hidden // args.headdim, nheads_kv=args.hidden // args.headdim,
                headdim=args.headdim, causal=args.causal, passes=(args.pass_,))
    sets = make_inputs(cell, DTYPES[args.dtype], 1, grad=args.pass_ != "fwd")
    run = make_runner(method.fn, args.pass_, sets, args.causal, args.headdim ** -0.5, scope=method.scope)
    for _ in range(args.warmup):
        run(0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run(0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
