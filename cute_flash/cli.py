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


def _capability(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])


def forward_variants(dtypes, head_dims, causals):
    """(dtype name, head dim, causal) of every forward variant selected."""
    return [(dtype, head_dim, causal) for dtype in dtypes for head_dim in head_dims for causal in causals]


def _forward_plan(arch: str, dtype: str, head_dim: int, causal: bool):
    """(label, Plan) of the forward kernel the dispatcher picks on `arch`. Runs in worker
    processes, which rebuild the plan from plain values."""
    import torch

    from . import dispatch

    plan = dispatch.plan_forward(_capability(arch), getattr(torch, dtype), head_dim, causal)
    family = "sm90" if ".sm90." in plan.kernel_cls.__module__ else "sm80"
    return f"fwd/{family}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}", plan


def _pool(jobs: int) -> ProcessPoolExecutor:
    # The DSL's compiler state does not survive fork(); start clean interpreters.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def _variant_selection(args):
    from .validate import SUPPORTED_HEAD_DIMS

    default = SUPPORTED_HEAD_DIMS if args.command == "check" else (32, 64, 96, 128, 192, 256)
    head_dims = _parse_list(args.head_dims, int) if args.head_dims else list(default)
    return _parse_list(args.dtypes), head_dims, [False, True]


def _report_row(arch: str, label: str, expected: tuple[str, ...], kernel, fake_args, smem_fallback):
    from .compile_report import compile_report

    report = compile_report(kernel, fake_args, arch=arch)
    found = {ins: report.ptx.count(ins) for ins in expected}
    # The kernels allocate shared memory dynamically, which ptxas does not see; ask the kernel.
    smem = report.smem_bytes if report.smem_bytes is not None else smem_fallback
    return label, report.seconds, report.registers, smem, report.spill_bytes, found


def _check_one(arch: str, variant, pass_name: str):
    """Report rows for one variant: the forward kernel, or the backward's main kernel (plus, once
    per dtype and head dim, its preprocess and postprocess kernels, which ignore `causal`)."""
    if pass_name == "fwd":
        label, plan = _forward_plan(arch, *variant)
        kernel, fake_args = plan.build()
        smem = plan.kernel_cls.smem_bytes(**dict(plan.init_kwargs))
        return [_report_row(arch, label, KEY_INSTRUCTIONS[label.split("/")[1]], kernel, fake_args, smem)]
    import torch

    from .backward_sm80 import backward_builds
    from .dispatch import CUTLASS_DTYPES

    dtype, head_dim, causal = variant
    pre, main, post = backward_builds(CUTLASS_DTYPES[getattr(torch, dtype)], head_dim, causal, False, False)
    rows = []
    for (key, build), expected in ((main, KEY_INSTRUCTIONS["sm80"]),) + (() if causal else ((pre, ()), (post, ()))):
        kernel, fake_args = build()
        label = f"{key[1].replace('_', '/')}/sm80/{dtype}/d{head_dim}" + (f"/{'causal' if causal else 'full'}" if key[1] == "bwd_main" else "")
        smem = kernel.smem_bytes(**vars(kernel)) if hasattr(kernel, "smem_bytes") else None
        rows.append(_report_row(arch, label, expected, kernel, fake_args, smem))
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
    start = time.perf_counter()
    if pass_name == "fwd":
        label, plan = _forward_plan(arch, *variant)
        plan.compiled()
    else:
        import torch

        from .backward_sm80 import backward_kernels
        from .dispatch import CUTLASS_DTYPES

        dtype, head_dim, causal, gqa = variant
        backward_kernels(CUTLASS_DTYPES[getattr(torch, dtype)], head_dim, causal, False, gqa, arch)
        label = f"bwd/sm80/{dtype}/d{head_dim}/{'causal' if causal else 'full'}{'/gqa' if gqa else ''}"
    return label, time.perf_counter() - start


def cmd_warmup(args) -> int:
    """Fill the disk cache for the chosen variants, several compiles at once."""
    from . import cache, dispatch

    if args.arch is None:
        import torch

        args.arch = dispatch.target_arch_for(torch.cuda.get_device_capability())
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
        from .dispatch import kernel_family, target_arch

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
