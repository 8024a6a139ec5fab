"""Compile the kernels of the head-dim sweep (tests/gpu/test_head_dims.py) into the disk cache,
several at once, on the GPU machine before the tests run:

    python -m tests.gpu.warm_sweep [--jobs N]

`cute-flash warmup` compiles both maskings of every head dim it is given; the sweep runs one
masking per head dim (common.sweep_causal), which halves its compiles.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from .common import SWEEP_HEAD_DIMS, sweep_causal


def compile_variant(arch: str, pass_name: str, dtype: str, head_dim: int, causal: bool) -> str:
    from cute_flash.cache import get_or_compile
    from cute_flash.cli import kernel_builds

    for _label, key, build, _instructions in kernel_builds(arch, pass_name, dtype, head_dim, causal):
        get_or_compile(key, build, arch)
    return f"{pass_name}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)

    import torch

    from cute_flash import device

    arch = device.target_arch_for(torch.cuda.get_device_capability())
    variants = [(pass_name, dtype, head_dim, sweep_causal(head_dim))
                for pass_name in ("fwd", "bwd") for dtype in ("float16", "bfloat16") for head_dim in SWEEP_HEAD_DIMS]
    start = time.perf_counter()
    # The DSL's compiler state does not survive fork(): start clean interpreters.
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(compile_variant, arch, *variant) for variant in variants]):
            future.result()
    print(f"{len(variants)} sweep variants ready for {arch} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
