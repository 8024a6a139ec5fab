"""`cute-flash` command line: info, check, warmup, bench, dashboard."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

KEY_INSTRUCTIONS = {
    "sm80": ("mma.sync", "ldmatrix", "cp.async"),
    "sm90": ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg"),
}


def _parse_list(text: str, kind=str):
    return [kind(x) for x in text.split(",") if x]


def forward_variants(dtypes, head_dims, causals):
    """(dtype name, head dim, causal) of every forward variant selected."""
    return [(dtype, head_dim, causal) for dtype in dtypes for head_dim in head_dims for causal in causals]


def kernel_builds(arch: str, pass_name: str, dtype: str, head_dim: int, causal: bool, gqa: bool = False):
    """(label, cache key, build, key instructions) of every kernel one variant runs on `arch`, as
    dispatch plans it: the forward kernel of each length class, or the backward's preprocess, main
    and postprocess kernels. Runs in worker processes, which rebuild everything from these plain
    values."""
    import torch

    from . import dispatch
    from .device import capability_of

    capability, torch_dtype = capability_of(arch), getattr(torch, dtype)
    if pass_name == "fwd":
        builds = {}
        # A kernel may launch differently per length class; the first class that launches a
        # kernel names it: long (unlabelled), then the others in dispatch's order.
        for length in sorted(dispatch.length_classes(causal), key=lambda name: name != "long"):
            plan = dispatch.plan_forward(capability, torch_dtype, head_dim, causal, length)
            label = (f"fwd/{plan.family}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}"
                     f"{'' if length == 'long' else '/' + length}")
            builds.setdefault(plan.key, (label, plan.key, plan.build, KEY_INSTRUCTIONS[plan.family]))
        return list(builds.values())
    backward = dispatch.plan_backward(capability, torch_dtype, head_dim, causal, gqa=gqa)
    builds = []
    for kind, plan in (("pre", backward.pre), ("main", backward.main), ("post", backward.post)):
        variant = f"/{'causal' if causal else 'full'}{'/gqa' if gqa else ''}" if kind == "main" else ""
        builds.append((f"bwd/{kind}/{plan.family}/{dtype}/d{head_dim}{variant}", plan.key, plan.build,
                       KEY_INSTRUCTIONS[plan.family] if kind == "main" else ()))
    return builds


def _pool(jobs: int) -> ProcessPoolExecutor:
    # The DSL's compiler state does not survive fork(); start clean interpreters.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def _variant_selection(args):
    from .validate import SUPPORTED_HEAD_DIMS

    default = SUPPORTED_HEAD_DIMS if args.command == "check" else (32, 64, 96, 128, 192, 256)
    head_dims = _parse_list(args.head_dims, int) if args.head_dims else list(default)
    return _parse_list(args.dtypes), head_dims, [False, True]


def _check_one(arch: str, variant, pass_name: str):
    """Report rows for one variant; the backward's preprocess and postprocess kernels ignore
    `causal`, so they are reported with the non-causal variant only."""
    from .compile_report import compile_report

    rows = []
    for label, _key, build, expected in kernel_builds(arch, pass_name, *variant):
        if pass_name == "bwd" and variant[2] and "/main/" not in label:
            continue
        kernel, fake_args = build()
        report = compile_report(kernel, fake_args, arch=arch)
        found = {ins: report.ptx.count(ins) for ins in expected}
        # The kernels allocate shared memory dynamically, which ptxas does not see; ask the kernel.
        smem = report.smem_bytes
        if smem is None and hasattr(kernel, "smem_bytes"):
            smem = kernel.smem_bytes(**vars(kernel))
        rows.append((label, report.seconds, report.registers, smem, report.spill_bytes, found))
    return rows


def cmd_check(args) -> int:
    """Compile every variant for an architecture and report resources and key instructions."""
    dtypes, head_dims, causals = _variant_selection(args)
    jobs = [(variant, p) for p in args.passes.split(",") for variant in forward_variants(dtypes, head_dims, causals)]
    print(f"{'variant':34} {'compile s':>9} {'regs':>5} {'smem B':>8} {'spill B':>8}  key instructions (count in PTX)")
    failures = rows = 0
    with _pool(args.jobs) as pool:
        futures = [pool.submit(_check_one, args.arch, variant, p) for variant, p in jobs]
        for future in as_completed(futures):
            for label, seconds, regs, smem, spill, found in future.result():
                bad = spill > 0 or not all(found[i] for i in found if i != "setmaxnreg")
                failures += bad
                rows += 1
                ins = " ".join(f"{k}={v}" for k, v in found.items())
                print(f"{label:34} {seconds:9.1f} {regs:5d} {smem if smem is not None else '-':>8} {spill:8d}  {ins}{'  <-- FAIL' if bad else ''}", flush=True)
    print(f"{rows} kernels, {failures} with spills or missing instructions")
    return 1 if failures else 0


def _warm_one(arch: str, variant, pass_name: str):
    from .cache import get_or_compile

    start = time.perf_counter()
    builds = kernel_builds(arch, pass_name, *variant)
    for _label, key, build, _expected in builds:
        get_or_compile(key, build, arch)
    main_label = next(label for label, _key, _build, expected in builds if expected)
    return main_label, time.perf_counter() - start


def cmd_warmup(args) -> int:
    """Fill the disk cache for the chosen variants, several compiles at once."""
    from . import cache, device

    if args.arch is None:
        import torch

        args.arch = device.target_arch_for(torch.cuda.get_device_capability())
    if not cache.disk_enabled():
        print("the disk cache is off (CUTE_FLASH_CACHE=0): nothing to warm", file=sys.stderr)
        return 1
    dtypes, head_dims, causals = _variant_selection(args)
    jobs = []
    if "fwd" in args.passes:
        jobs += [(variant, "fwd") for variant in forward_variants(dtypes, head_dims, causals)]
    if "bwd" in args.passes:
        gqas = (False, True) if args.gqa else (False,)
        jobs += [((d, h, c, g), "bwd") for d, h, c in forward_variants(dtypes, head_dims, causals) for g in gqas]
    start = time.perf_counter()
    with _pool(args.jobs) as pool:
        for future in as_completed([pool.submit(_warm_one, args.arch, variant, p) for variant, p in jobs]):
            label, seconds = future.result()
            print(f"{label:34} {seconds:6.1f} s", flush=True)
    print(f"{len(jobs)} variants ready in {cache.cache_root() / cache.namespace()} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_info(args) -> int:
    import cutlass
    import torch

    from . import __version__, cache

    print(f"cute-flash {__version__}, nvidia-cutlass-dsl {cutlass.__version__}, torch {torch.__version__}")
    if torch.cuda.is_available():
        from .device import kernel_family, target_arch

        cap = torch.cuda.get_device_capability()
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), compile target {target_arch()}, kernel family {kernel_family(cap)}")
    else:
        print("GPU: none visible (kernels can still be compiled: cute-flash check --arch sm_80)")
    folder = cache.cache_root() / cache.namespace()
    entries = list(folder.glob("*.o")) if folder.exists() else []
    state = "on" if cache.disk_enabled() else "off (CUTE_FLASH_CACHE=0)"
    print(f"disk cache: {state}, {folder}, {len(entries)} compiled kernels")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("bench", "dashboard"):
        from .perf import bench, dashboard

        return (bench if argv[0] == "bench" else dashboard).main(argv[1:])
    parser = argparse.ArgumentParser(prog="cute-flash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, compile target and cache")
    for name, helptext in (("check", "compile every variant, report registers/smem/spills/instructions"),
                           ("warmup", "compile variants into the disk cache in parallel")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--arch", default="sm_80" if name == "check" else None, help="sm_80, sm_86, sm_90a, ... (warmup: this GPU's)")
        p.add_argument("--dtypes", default="float16,bfloat16")
        p.add_argument("--head-dims", default="", help="comma list; default: check every multiple of 8 up to 256, "
                       "warmup 32,64,96,128,192,256")
        p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
        p.add_argument("--passes", default="fwd,bwd" if name == "warmup" else "fwd",
                       help="fwd, bwd or both (the backward kernels are the sm80 family's)")
        if name == "warmup":
            p.add_argument("--gqa", action="store_true", help="also the grouped-query backward variants")
    sub.add_parser("bench", help="run a benchmark suite (see cute-flash bench --help)")
    sub.add_parser("dashboard", help="render perf/results into plots (see cute-flash dashboard --help)")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check, "warmup": cmd_warmup}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
