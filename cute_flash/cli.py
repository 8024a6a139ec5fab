"""`cute-flash` command line: info, check, warmup, layouts, export, bench, dashboard."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from . import __version__

KEY_INSTRUCTIONS = {
    "sm80": ("mma.sync", "ldmatrix", "cp.async"),
    "sm90": ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg"),
}
# fp32 (split TF32): TF32 MMAs fed by 32-bit loads, no ldmatrix
FP32_KEY_INSTRUCTIONS = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32", "cp.async")
# fp32 on the Hopper forward: TF32 wgmma on TMA-loaded fp32 tiles
SM90_FP32_KEY_INSTRUCTIONS = ("wgmma.mma_async.sync.aligned.m64n", ".f32.tf32.tf32", "cp.async.bulk.tensor", "setmaxnreg")


def _key_instructions(family: str, dtype: str) -> tuple[str, ...]:
    if dtype == "float32":
        return SM90_FP32_KEY_INSTRUCTIONS if family == "sm90" else FP32_KEY_INSTRUCTIONS
    return KEY_INSTRUCTIONS[family]


def _parse_list(text: str, kind=str):
    return [kind(x) for x in text.split(",") if x]


def forward_variants(dtypes, head_dims, causals):
    """(dtype name, head dim, causal) of every forward variant selected."""
    return [(dtype, head_dim, causal) for dtype in dtypes for head_dim in head_dims for causal in causals]


def kernel_builds(arch: str, pass_name: str, dtype: str, head_dim: int, causal: bool, gqa: bool = False):
    """(label, cache key, build, key instructions) of every kernel one variant runs on `arch`, as
    dispatch plans it: the forward kernel of each length class, the backward's preprocess, main
    and postprocess kernels, or flash_attn_with_kvcache's decode kernel in each CTA shape dispatch
    picks by call shape (contiguous cache, no score modifications) and the split merge. Runs in
    worker processes, which rebuild everything from these plain values."""
    import torch

    from . import dispatch
    from .device import capability_of

    capability, torch_dtype = capability_of(arch), getattr(torch, dtype)
    if pass_name == "decode":
        builds = {}
        for shape in ("default", "deep", "narrow", "keys", "deep-keys"):
            plan = dispatch.plan_decode(capability, torch_dtype, head_dim, causal, deep=shape.startswith("deep"),
                                        narrow=shape == "narrow", warps_along_keys=shape.endswith("keys"),
                                        tf32_products=dispatch.tf32_products_for(torch_dtype))
            label = f"decode/{dtype}/d{head_dim}/{'causal' if causal else 'full'}/{shape}"
            builds.setdefault(plan.main.key, (label, plan.main.key, plan.main.build, _key_instructions("sm80", dtype)))
        for (warps, rows), combine in plan.combines.items():
            label = f"decode/combine/{dtype}/d{head_dim}/" + (f"{warps}-warps" if rows == 1 else f"{rows}-rows")
            builds[combine.key] = (label, combine.key, combine.build, ())
        return list(builds.values())
    if pass_name == "fwd":
        builds = {}
        # A kernel may launch differently per length class; the first class that launches a
        # kernel names it: long (unlabelled), then the others in dispatch's order.
        for length in sorted(dispatch.length_classes(causal), key=lambda name: name != "long"):
            plan = dispatch.plan_forward(capability, torch_dtype, head_dim, causal, length)
            label = (f"fwd/{plan.family}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}"
                     f"{'' if length == 'long' else '/' + length}")
            builds.setdefault(plan.key, (label, plan.key, plan.build, _key_instructions(plan.family, dtype)))
        return list(builds.values())
    backward = dispatch.plan_backward(capability, torch_dtype, head_dim, causal, gqa=gqa)
    builds = []
    for kind, plan in (("pre", backward.pre), ("main", backward.main), ("post", backward.post)):
        variant = f"/{'causal' if causal else 'full'}{'/gqa' if gqa else ''}" if kind == "main" else ""
        builds.append((f"bwd/{kind}/{plan.family}/{dtype}/d{head_dim}{variant}", plan.key, plan.build,
                       _key_instructions(plan.family, dtype) if kind == "main" else ()))
    return builds


def _pool(jobs: int) -> ProcessPoolExecutor:
    # The DSL's compiler state does not survive fork(); start clean interpreters.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


# ----------------------------------------------------------------------------- arguments


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, `prog: error: message`, with exit
    status 2: the usage text argparse prints first buries the line that says what is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A command line that cannot run as given, found after parsing (no GPU to default to)."""


# Every command takes any of these for an element type.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                   "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
# The names result files use.
SHORT_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
KERNEL_PASSES = ("fwd", "bwd", "decode")


def dtype_arg(text: str) -> str:
    """torch's name of an element type given in any of DTYPE_SPELLINGS (an argparse type)."""
    spelling = text.strip().lower()
    if spelling in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[spelling]
    raise argparse.ArgumentTypeError(f"{text!r} is not an element type: use bf16 (bfloat16), fp16 (float16, half) "
                                     "or fp32 (float32)")


def short_dtype_arg(text: str) -> str:
    """bf16 or fp16 from any of DTYPE_SPELLINGS (an argparse type)."""
    return SHORT_DTYPE_NAMES[dtype_arg(text)]


def head_dim_arg(text: str) -> int:
    """A head dim the kernels compute (an argparse type)."""
    from .validate import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a head dim (a whole number)") from None
    if value <= 0 or value % HEAD_DIM_MULTIPLE or value > MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"head dim {value} is not supported: cute-flash computes multiples "
                                         f"of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}")
    return value


def pass_arg(text: str) -> str:
    if text not in KERNEL_PASSES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pass: use fwd, bwd, decode or a comma list of them")
    return text


def export_pass_arg(text: str) -> str:
    """pass_arg for the C library, which holds the forward and the backward (an argparse type)."""
    if pass_arg(text) == "decode":
        raise argparse.ArgumentTypeError("the C library holds the forward and the backward: use fwd, bwd or fwd,bwd "
                                         "(flash_attn_with_kvcache's decode kernels have no C entry point)")
    return text


def jobs_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes (1 or more)")
    return value


def comma_list(parse_one):
    """An argparse type for a comma-separated list of `parse_one` values, repeats dropped."""

    def parse(text: str) -> list:
        values = list(dict.fromkeys(_parse_list(text.replace(" ", ""), parse_one)))
        if not values:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return values

    return parse


def compile_targets() -> list[str]:
    """The DSL's compile targets that cute-flash can build for: sm_80 and newer, plain or
    arch-specific ('a'), except plain sm_90, which lacks the wgmma the Hopper kernels use."""
    from cutlass.base_dsl.enums import Arch

    return [a.name for a in Arch if a.major >= 8 and a.suffix in ("", "a") and a.name != "sm_90"]


def arch_arg(text: str) -> str:
    """A compile target from compile_targets() (an argparse type); a near miss such as sm90 or
    sm_90 gets a suggestion, a GPU older than Ampere a reason."""
    targets = compile_targets()
    if text in targets:
        return text
    match = re.fullmatch(r"(?:sm|compute)?_?(\d+?)(\d)([a-z]?)", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU target; use one of {', '.join(targets)}")
    major, minor, suffix = int(match[1]), int(match[2]), match[3]
    if major < 8:
        raise argparse.ArgumentTypeError(f"the CuTe DSL cannot target sm_{major}{minor}: cute-flash needs an "
                                         "Ampere (sm_80) or newer GPU")
    near = [t for t in targets if t.removesuffix("a") == f"sm_{major}{minor}"]
    if not near:
        raise argparse.ArgumentTypeError(f"{text!r} is not a target the CuTe DSL knows; use one of {', '.join(targets)}")
    same = f"sm_{major}{minor}{suffix}"
    why = " (the Hopper kernels use wgmma, which only the sm_90a target has)" if major == 9 else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a target name: did you mean {same if same in near else near[-1]}?{why}")


def _variant_selection(args):
    from .validate import SUPPORTED_HEAD_DIMS

    default = SUPPORTED_HEAD_DIMS if args.command == "check" else (32, 64, 96, 128, 192, 256)
    return args.dtypes, args.head_dims or list(default)


# ----------------------------------------------------------------------------- compiling


def _check_one(arch: str, variant, pass_name: str):
    """Report rows for one variant; the backward's preprocess and postprocess kernels ignore
    `causal`, so they are reported with the non-causal variant only."""
    from .compile_report import compile_report

    rows = []
    for label, _key, build, expected in kernel_builds(arch, pass_name, *variant):
        if pass_name == "bwd" and variant[2] and "/main/" not in label:
            continue
        if pass_name == "decode" and variant[2] and "/combine/" in label:
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


class Progress:
    """How many of `total` compile jobs have finished and the seconds since the start, on stderr:
    one line rewritten in place on a terminal, a line per finished job elsewhere (logs)."""

    def __init__(self, command: str, total: int):
        self.command, self.total, self.done = command, total, 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def advance(self, label: str) -> None:
        self.done += 1
        line = f"{self.command}: {self.done}/{self.total} done, {self.elapsed():.0f} s elapsed ({label})"
        sys.stderr.write("\r\033[K" + line if self.tty else line + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        """Take the progress line off a terminal before other output goes there."""
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _task_label(variant, pass_: str) -> str:
    dtype, head_dim, causal, *gqa = variant
    return f"{pass_}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}{'/gqa' if any(gqa) else ''}"


def _finished(jobs: int, work, arch: str, tasks: list):
    """Run `work(arch, variant, pass)` for every (variant, pass) task in `jobs` worker processes;
    yield (task index, its result or the exception it raised) as each finishes."""
    with _pool(jobs) as pool:
        futures = {pool.submit(work, arch, variant, p): i for i, (variant, p) in enumerate(tasks)}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result()
            except Exception as exc:  # noqa: BLE001 (one broken variant must not hide the others)
                yield futures[future], exc


def cmd_check(args) -> int:
    """Compile every variant for an architecture and report resources and key instructions,
    in the order the variants are listed (dtype, head dim, causal)."""
    dtypes, head_dims = _variant_selection(args)
    tasks = [(variant, p) for p in args.passes for variant in forward_variants(dtypes, head_dims, (False, True))]
    print(f"check: {len(tasks)} variants for {args.arch} in {min(args.jobs, len(tasks))} processes",
          file=sys.stderr, flush=True)
    print(f"{'variant':34} {'compile s':>9} {'regs':>5} {'smem B':>8} {'spill B':>8}  key instructions (count in PTX)",
          flush=True)
    outcomes = [None] * len(tasks)
    printed = failures = rows = 0
    progress = Progress("check", len(tasks))
    for index, outcome in _finished(args.jobs, _check_one, args.arch, tasks):
        outcomes[index] = outcome
        progress.clear()
        # A variant's rows are printed once every variant listed before it has finished.
        while printed < len(tasks) and outcomes[printed] is not None:
            done = outcomes[printed]
            if isinstance(done, Exception):
                failures += 1
                print(f"{_task_label(*tasks[printed]):34} compile failed: {type(done).__name__}: {done}  <-- FAIL")
                done = []
            for label, seconds, regs, smem, spill, found in done:
                bad = spill > 0 or not all(found[i] for i in found if i != "setmaxnreg")
                failures += bad
                rows += 1
                ins = " ".join(f"{k}={v}" for k, v in found.items())
                print(f"{label:34} {seconds:9.1f} {regs:5d} {smem if smem is not None else '-':>8} {spill:8d}  {ins}{'  <-- FAIL' if bad else ''}")
            sys.stdout.flush()
            printed += 1
        progress.advance(_task_label(*tasks[index]))
    progress.clear()
    print(f"{rows} kernels, {failures} with spills, missing instructions or failed compiles "
          f"({progress.elapsed():.0f} s)")
    return 1 if failures else 0


def _warm_one(arch: str, variant, pass_name: str):
    from .cache import get_or_compile

    start = time.perf_counter()
    builds = kernel_builds(arch, pass_name, *variant)
    for _label, key, build, _expected in builds:
        get_or_compile(key, build, arch)
    main_label = next(label for label, _key, _build, expected in builds if expected)
    return main_label, time.perf_counter() - start


def _this_gpus_target() -> str:
    """The compile target of the visible GPU; a usage error without one (warmup needs --arch then)."""
    import torch

    from . import device

    if not torch.cuda.is_available():
        raise UsageError("no CUDA GPU visible: name the compile target, e.g. --arch sm_90a (H100) or --arch sm_80 (A100)")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise UsageError(f"this GPU is sm_{major}{minor}; cute-flash needs an Ampere (sm_80) or newer GPU")
    return device.target_arch_for((major, minor))


def cmd_warmup(args) -> int:
    """Fill the disk cache for the chosen variants, several compiles at once."""
    from . import cache

    arch = args.arch or _this_gpus_target()
    if not cache.disk_enabled():
        raise UsageError("the disk cache is off (CUTE_FLASH_CACHE=0): nothing to warm")
    dtypes, head_dims = _variant_selection(args)
    tasks = []
    if "fwd" in args.passes:
        tasks += [(variant, "fwd") for variant in forward_variants(dtypes, head_dims, (False, True))]
    if "bwd" in args.passes:
        gqas = (False, True) if args.gqa else (False,)
        tasks += [((d, h, c, g), "bwd") for d, h, c in forward_variants(dtypes, head_dims, (False, True)) for g in gqas]
    if "decode" in args.passes:
        tasks += [(variant, "decode") for variant in forward_variants(dtypes, head_dims, (False, True))]
    print(f"warmup: {len(tasks)} variants for {arch} in {min(args.jobs, len(tasks))} processes", file=sys.stderr, flush=True)
    progress = Progress("warmup", len(tasks))
    failed = []
    for index, outcome in _finished(args.jobs, _warm_one, arch, tasks):
        if isinstance(outcome, Exception):
            failed.append(f"{_task_label(*tasks[index])}: {type(outcome).__name__}: {outcome}")
            progress.advance(f"{_task_label(*tasks[index])} failed")
        else:
            label, seconds = outcome
            progress.advance(f"{label}, {seconds:.1f} s")
    progress.clear()
    for line in failed:
        print(f"warmup: compile failed: {line}", file=sys.stderr)
    print(f"{len(tasks) - len(failed)} variants ready in {cache.cache_root() / cache.namespace()} "
          f"({progress.elapsed():.1f} s){f', {len(failed)} failed' if failed else ''}", flush=True)
    return 1 if failed else 0


def cmd_info(args) -> int:
    import cutlass
    import torch

    from . import cache

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


def length_arg(text: str) -> str:
    """A length class of cute_flash.dispatch (an argparse type)."""
    from .dispatch import LENGTH_CLASSES

    if text not in LENGTH_CLASSES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length class; use one of {', '.join(LENGTH_CLASSES)}")
    return text


def cmd_layouts(args) -> int:
    """Print what the kernels dispatch picks for one variant build (docs/layouts.md), draw it
    with --svg; or, with --docs, regenerate the reports and pictures the docs embed."""
    from pathlib import Path

    from . import explorer
    from .errors import CuteFlashError

    if args.docs:
        written = explorer.write_docs(Path(args.docs))
        print(f"{len(written)} files written under {args.docs}")
        return 0
    try:
        plans = explorer.kernel_plans(args.arch, args.pass_name, args.dtype, args.head_dim, args.causal, args.length,
                                      args.num_sms, args.gqa, args.deterministic)
    except CuteFlashError as exc:
        raise UsageError(str(exc)) from None
    for label, plan in plans:
        explored = explorer.explore(label, plan, compile_kernel=args.compile)
        print(explored.text)
        drawn = explorer.pictures(explored.layouts) if args.svg else {}
        if drawn:
            folder = Path(args.svg) / explored.layouts.kernel
            folder.mkdir(parents=True, exist_ok=True)
            for name, svg in drawn.items():
                (folder / name).write_text(svg)
            print(f"{len(drawn)} pictures in {folder}\n")
    return 0


# --causal, --gqa, --deterministic: which values of the flag get their variants.
CAUSAL_CHOICES = {"both": (False, True), "yes": (True,), "no": (False,)}


def cmd_export(args) -> int:
    """Build a shared library and C header (docs/api.md, "C ABI") from the chosen variants."""
    from .errors import CuteFlashError
    from .export import ExportError, export_library, kernel_jobs

    arch = args.arch or _this_gpus_target()
    causals = CAUSAL_CHOICES[args.causal]
    gqas, deterministics = CAUSAL_CHOICES[args.gqa], CAUSAL_CHOICES[args.deterministic]
    progress = None
    try:
        kernels = len(kernel_jobs(arch, args.dtypes, args.head_dims, causals, args.passes, gqas, deterministics)[0])
        print(f"export: {kernels} kernels for {arch} in {min(args.jobs, kernels)} processes", file=sys.stderr,
              flush=True)
        progress = Progress("export", kernels)
        done = export_library(args.out, arch, args.dtypes, args.head_dims, causals, args.passes, args.runtime,
                              args.jobs, args.cc, args.cudart_static, progress=progress.advance, gqas=gqas,
                              deterministics=deterministics)
    except (ExportError, CuteFlashError) as exc:
        if progress is not None:
            progress.clear()
        print(f"cute-flash export: error: {exc}", file=sys.stderr)
        return 1
    progress.clear()
    print(f"{done.library} and {done.header}: {done.kernels} kernels ({done.seconds:.0f} s); "
          f"link with -L{done.library.parent} -lcute_flash -Wl,-rpath,{done.library.parent}", flush=True)
    return 0


def _add_export_parser(sub) -> None:
    from pathlib import Path

    from .export import RUNTIMES

    p = sub.add_parser("export", help="build libcute_flash.so and cute_flash.h, a C ABI (docs/api.md)")
    p.add_argument("--arch", type=arch_arg, default=None,
                   help="compile target: sm_80 (A100 and other sm_8x), sm_90a (H100), ... (default: the visible GPU)")
    p.add_argument("--dtypes", type=comma_list(dtype_arg), default="bf16,fp16",
                   help="comma list of bf16 (bfloat16), fp16 (float16, half), fp32 (float32, split TF32); "
                        "default: bf16,fp16")
    p.add_argument("--head-dims", type=comma_list(head_dim_arg), default="64,128",
                   help="comma list of multiples of 8 up to 256; default: 64,128")
    p.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default="both",
                   help="causal variants, non-causal ones or both (default)")
    p.add_argument("--passes", type=comma_list(export_pass_arg), default="fwd,bwd", help="fwd, bwd or fwd,bwd (default)")
    p.add_argument("--gqa", choices=tuple(CAUSAL_CHOICES), default="both",
                   help="backward for kv_heads < heads (yes), for kv_heads == heads (no) or both (default); "
                        "the grouped-query kernels also serve kv_heads == heads, more slowly")
    p.add_argument("--deterministic", choices=tuple(CAUSAL_CHOICES), default="no",
                   help="deterministic backward (yes), the faster unordered one (no, default) or both; the "
                        "deterministic kernels also serve calls that do not ask for it")
    p.add_argument("--runtime", choices=RUNTIMES, default="shared",
                   help="shared: libcute_dsl_runtime.so copied next to the library (default); static: the DSL's "
                        "static runtime and the toolkit's libcudart_static.a linked in")
    p.add_argument("--cudart-static", type=Path, default=None,
                   help="libcudart_static.a for --runtime static (default: from CUDA_HOME, CUDA_PATH or /usr/local/cuda)")
    p.add_argument("--cc", default=None, help="C compiler (default: $CC or cc)")
    p.add_argument("--jobs", type=jobs_arg, default=os.cpu_count() or 2,
                   help="compiles at once (default: one per CPU core)")
    p.add_argument("-o", "--out", type=Path, required=True, help="folder for the library, the header and build/")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="cute-flash", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, compile target and cache")
    for name, helptext in (("check", "compile every variant, report registers/smem/spills/instructions"),
                           ("warmup", "compile variants into the disk cache in parallel")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--arch", type=arch_arg, default="sm_80" if name == "check" else None,
                       help="compile target: sm_80, sm_86, sm_89, sm_90a, ... (default: "
                            f"{'sm_80' if name == 'check' else 'the visible GPU'})")
        p.add_argument("--dtypes", type=comma_list(dtype_arg), default="bf16,fp16",
                       help="comma list of bf16 (bfloat16), fp16 (float16, half), fp32 (float32); "
                            "default: bf16,fp16")
        p.add_argument("--head-dims", type=comma_list(head_dim_arg), default=None,
                       help="comma list of multiples of 8 up to 256; default: "
                            f"{'all of them' if name == 'check' else '32,64,96,128,192,256'}")
        p.add_argument("--jobs", type=jobs_arg, default=os.cpu_count() or 2,
                       help="compiles at once (default: one per CPU core)")
        p.add_argument("--passes", type=comma_list(pass_arg), default="fwd,bwd" if name == "warmup" else "fwd",
                       help="fwd, bwd, decode or a comma list of them (the backward kernels of the family "
                            "dispatch picks for each head dim; decode: flash_attn_with_kvcache's kernels for a "
                            "contiguous cache)")
        if name == "warmup":
            p.add_argument("--gqa", action="store_true", help="also the grouped-query backward variants")
    p = sub.add_parser("layouts", help="the layouts, atoms and copies a dispatched kernel builds (docs/layouts.md)")
    p.add_argument("--arch", type=arch_arg, default="sm_90a", help="compile target (default: sm_90a)")
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--head-dim", type=head_dim_arg, default=128, help="a multiple of 8 up to 256 (default: 128)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pass", dest="pass_name", type=pass_arg, default="fwd", help="fwd (default) or bwd")
    p.add_argument("--length", type=length_arg, default="long",
                   help="the forward's length class: short_512, short, short_2k, mid (causal), long (default)")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs the persistent Hopper kernels are sized for (default: the visible GPU's, else 132)")
    p.add_argument("--gqa", action="store_true", help="the grouped-query backward")
    p.add_argument("--deterministic", action="store_true", help="the deterministic backward")
    p.add_argument("--svg", metavar="DIR", help="also draw the layouts, into DIR/<kernel class>/")
    p.add_argument("--compile", action="store_true", help="also compile: ptxas's registers and spills")
    p.add_argument("--docs", metavar="DIR", help="regenerate the reports and pictures docs/layouts.md embeds "
                                                 "(cute-flash layouts --docs docs/layouts) and nothing else")
    _add_export_parser(sub)
    sub.add_parser("bench", help="run a benchmark suite (see cute-flash bench --help)")
    sub.add_parser("dashboard", help="render benchmark results into plots (see cute-flash dashboard --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("bench", "dashboard"):
        if argv[0] == "bench":
            from .perf.bench import main as run
        else:
            from .perf.dashboard import main as run
        return run(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        commands = {"info": cmd_info, "check": cmd_check, "warmup": cmd_warmup, "layouts": cmd_layouts,
                    "export": cmd_export}
        return commands[args.command](args)
    except UsageError as exc:
        print(f"cute-flash {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
