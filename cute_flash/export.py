"""`cute-flash export`: a shared library and a C header (cute_flash/c_abi/cute_flash.h) that give C,
Rust or any FFI language the forward and backward without Python.

    export_library(out_dir, arch, dtypes, head_dims, causals, ..., gqas=..., deterministics=...) -> Export

Each chosen variant's kernels are compiled ahead of time for one target with a plain (not TVM-FFI)
entry point and a stream argument, and written by the CuTe DSL's `export_to_c` as an object file
(host launcher + embedded cubin) and a header. The DSL's header describes how the launcher takes its
arguments; it is checked here against what the C shim (c_abi/cuflash.c) passes, so a kernel whose
signature changed fails the export instead of a launch. A generated table (c_abi/cuflash_kernels.h)
tells the shim which kernels the library holds; the system C compiler links shim, table and kernels
into `libcute_flash.so`.

The library uses the sm80 kernel family on every target: the Hopper forward takes per-call
workspaces and a tail-split plan made by Python (cute_flash/launchers.py), which the C library
does not reproduce. The sm80 kernels compiled for sm_90a run on the H100, slower than the Hopper
forward.

A backward variant is (dtype, head dim, causal, gqa, deterministic), as in the Python package's
dispatch.plan_backward. Its grouped-query form writes fp32 per-query-head dK / dV that Python sums
with torch; here the sum is a fourth exported kernel (kernels/sm80/bwd_group_sum.py, role "sum").
The deterministic form orders dQ's accumulation with counters the shim zeroes per call.

CUDA comes from the DSL's runtime library, one of:
- "shared" (default): libcute_dsl_runtime.so, copied next to the library (found through
  RPATH=$ORIGIN). It holds the CUDA runtime statically and loads libcuda.so.1 on first use.
- "static": the DSL's libcuda_dialect_runtime_static.a and the toolkit's libcudart_static.a linked
  in: one file, which loads libcuda.so.1 on first use. The static CUDA runtime must come from the
  CUDA major version the DSL's runtime was built for (its folder: cu12 or cu13).
Either way the library needs only the CUDA driver at run time, and loads without one: argument
checks run before any CUDA call.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import __version__

C_ABI_DIR = Path(__file__).parent / "c_abi"
HEADER = "cute_flash.h"
LIBRARY = "libcute_flash.so"
SHARED_RUNTIME = "libcute_dsl_runtime.so"
STATIC_RUNTIME = "libcuda_dialect_runtime_static.a"
RUNTIMES = ("shared", "static")
DTYPE_CONSTANTS = {"float16": "CUFLASH_DTYPE_F16", "bfloat16": "CUFLASH_DTYPE_BF16", "float32": "CUFLASH_DTYPE_F32"}
DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}

# What cuflash.c passes each kernel's launcher, in order (before the launcher's return slot):
# tensors by descriptor, scalars by address. The DSL's header must say the same.
LAUNCH_ARGUMENTS = {
    "fwd": ("mQ", "mK", "mV", "mO", "mLSE", "&softmax_scale", "&stream"),
    "pre": ("mO", "mdO", "mLSE", "mLSElog2", "mdPsum", "mdQaccum", "&stream"),
    "main": ("mQ", "mK", "mV", "mdO", "mLSElog2", "mdPsum", "mdQaccum", "mdK", "mdV", "mdQsemaphore",
             "&softmax_scale", "&stream"),
    "post": ("mdQaccum", "mdQ", "&softmax_scale", "&stream"),
    "sum": ("mdKaccum", "mdVaccum", "mdK", "mdV", "&stream"),
}
# (dynamic extents, dynamic strides) of the descriptor cuflash.c builds for each operand:
# cf_bshd for (batch, seqlen, heads, head_dim) operands, cf_rows for (batch, heads, rows) ones.
BSHD, ROWS = (3, 3), (3, 2)
DESCRIPTORS = {name: BSHD for name in ("mQ", "mK", "mV", "mO", "mdO", "mdQ", "mdK", "mdV", "mdKaccum",
                                      "mdVaccum")} | {
    name: ROWS for name in ("mLSE", "mLSElog2", "mdPsum", "mdQaccum", "mdQsemaphore")}


class ExportError(RuntimeError):
    """The export could not produce a working library (a compiler, a runtime, a kernel signature)."""


@dataclass(frozen=True)
class KernelJob:
    """One kernel to compile and export: `role` of the pass ("fwd", or the backward's "pre",
    "main", "post" and, for grouped-query attention, "sum") of one variant."""

    role: str
    dtype: str
    head_dim: int
    causal: bool
    prefix: str
    label: str
    gqa: bool = False
    deterministic: bool = False


@dataclass(frozen=True)
class ExportedKernel:
    prefix: str
    label: str
    launcher: str  # the DSL's packed-arguments entry point


@dataclass(frozen=True)
class Export:
    library: Path
    header: Path
    build_dir: Path
    kernels: int
    seconds: float


# ----------------------------------------------------------------------------- plans


def plan_of(arch: str, role: str, dtype: str, head_dim: int, causal: bool, gqa: bool = False,
            deterministic: bool = False):
    """The dispatch plan of one kernel of the C library for `arch`."""
    import torch

    from . import dispatch
    from .device import capability_of

    # The library holds the sm80 family's kernels on every target, sm_90a included.
    capability, torch_dtype = capability_of(arch), getattr(torch, dtype)
    if role == "fwd":
        return dispatch.plan_forward(capability, torch_dtype, head_dim, causal, family="sm80")
    if role == "sum":
        return dispatch.plan_group_sum(capability, torch_dtype, head_dim)
    return getattr(dispatch.plan_backward(capability, torch_dtype, head_dim, causal, deterministic, gqa,
                                          family="sm80"), role)


def backward_roles(gqa: bool) -> tuple[str, ...]:
    return ("pre", "main", "post", "sum") if gqa else ("pre", "main", "post")


def _label(role: str, dtype: str, head_dim: int, causal: bool, gqa: bool, deterministic: bool) -> str:
    label = f"{role}/{DTYPE_SHORT[dtype]}/d{head_dim}"
    if role in ("fwd", "main"):
        label += f"/{'causal' if causal else 'full'}"
    if role == "main":
        label += ("/gqa" if gqa else "") + ("/deterministic" if deterministic else "")
    return label


def kernel_jobs(arch: str, dtypes, head_dims, causals, passes, gqas=(False, True),
                deterministics=(False,)) -> tuple[list[KernelJob], dict, dict]:
    """Every distinct kernel the variants need (kernels that compile alike, such as the
    backward's preprocess and postprocess, are shared between variants), and per variant the
    prefixes of its kernels: ({(dtype, head_dim, causal): prefix} forward,
    {(dtype, head_dim, causal, gqa, deterministic): {role: prefix}} backward)."""
    from .cache import entry_name

    jobs: dict[tuple, KernelJob] = {}
    forward, backward = {}, {}

    def job(role, dtype, head_dim, causal, gqa=False, deterministic=False) -> str:
        plan = plan_of(arch, role, dtype, head_dim, causal, gqa, deterministic)
        key = (arch,) + plan.key
        if key not in jobs:
            jobs[key] = KernelJob(role, dtype, head_dim, causal, f"cfk_{role}_{entry_name(key)[:16]}",
                                  _label(role, dtype, head_dim, causal, gqa, deterministic), gqa, deterministic)
        return jobs[key].prefix

    for dtype in dtypes:
        for head_dim in head_dims:
            for causal in causals:
                if "fwd" in passes:
                    forward[(dtype, head_dim, causal)] = job("fwd", dtype, head_dim, causal)
                if "bwd" not in passes:
                    continue
                for gqa in gqas:
                    for deterministic in deterministics:
                        variant = (dtype, head_dim, causal, gqa, deterministic)
                        backward[variant] = {role: job(role, *variant) for role in backward_roles(gqa)}
    return list(jobs.values()), forward, backward


# ----------------------------------------------------------------------------- compiling


def _compile_plain(arch: str, kernel, fake_args):
    """`cute.compile` for `arch` with a stream parameter the C caller passes (the plans' fake
    stream is TVM-FFI's environment stream, which only a TVM-FFI entry point has)."""
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    *args, stream = fake_args
    if type(stream).__name__ != "_FakeStream":
        raise ExportError(f"{type(kernel).__name__}'s last compile-time argument is not its stream")
    env = CuTeDSL._get_dsl().envar
    previous = env._arch
    env.arch = arch  # `--gpu-arch` in the compile options breaks export_to_c (docs/dsl-notes.md)
    try:
        return cute.compile(kernel, *args, cute.runtime.make_fake_stream())
    finally:
        env.arch = previous


def export_kernel(arch: str, job: KernelJob, build_dir: str) -> ExportedKernel:
    """Compile one kernel and write `<prefix>.o` and the DSL's `<prefix>.h` into `build_dir`,
    checked against what cuflash.c passes. Runs in worker processes."""
    kernel, fake_args = plan_of(arch, job.role, job.dtype, job.head_dim, job.causal, job.gqa, job.deterministic).build()
    compiled = _compile_plain(arch, kernel, fake_args)
    compiled.export_to_c(file_path=build_dir, file_name=job.prefix, function_prefix=job.prefix)
    header = Path(build_dir, f"{job.prefix}.h").read_text()
    return ExportedKernel(job.prefix, job.label, check_dsl_header(header, job.prefix, LAUNCH_ARGUMENTS[job.role]))


def check_dsl_header(header: str, prefix: str, arguments: tuple[str, ...]) -> str:
    """The launcher symbol of a DSL-generated header, after checking that it takes `arguments` in
    this order, each tensor with the descriptor layout cuflash.c builds, and returns a status."""
    launcher = re.search(rf"void (_mlir_{prefix}__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\);", header)
    packed = re.search(r"void \*args\[(\d+)\] = \{\s*(.*?),\s*&ret\s*\};", header, re.S)
    if launcher is None or packed is None or "int32_t ret = 0;" not in header:
        raise ExportError(f"{prefix}: the DSL's header has no launcher of the expected form")
    found = tuple(name.strip() for name in packed[2].split(","))
    if found != arguments:
        raise ExportError(f"{prefix}: the kernel takes {found}, the C library passes {arguments}")
    for name in arguments:
        if name.startswith("&"):
            continue
        layout = re.search(r"typedef struct \{\s*void \*data;\s*int32_t dynamic_shapes\[(\d+)\];\s*"
                           rf"int64_t dynamic_strides\[(\d+)\];\s*\}} {prefix}_Tensor_{name}_t;", header)
        expected = DESCRIPTORS[name]
        if layout is None or (int(layout[1]), int(layout[2])) != expected:
            raise ExportError(f"{prefix}: {name}'s descriptor is not (void *data, int32_t[{expected[0]}], "
                              f"int64_t[{expected[1]}])")
    if "float softmax_scale" not in header and "&softmax_scale" in arguments:
        raise ExportError(f"{prefix}: softmax_scale is not a float")
    return launcher[1]


def _exported(job: KernelJob, export) -> ExportedKernel:
    """`export()`, with a failed compile named by its kernel."""
    try:
        return export()
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 (the DSL raises many kinds; the kernel's name matters most)
        raise ExportError(f"{job.label}: compile failed: {type(exc).__name__}: {exc}") from exc


def _export_all(arch: str, jobs: list[KernelJob], build_dir: Path, workers: int, progress) -> dict[str, ExportedKernel]:
    done = {}
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            done[job.prefix] = _exported(job, lambda: export_kernel(arch, job, str(build_dir)))
            progress(job.label)
        return done
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # The DSL's compiler state does not survive fork(); start clean interpreters.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(export_kernel, arch, job, str(build_dir)): job for job in jobs}
        for future in as_completed(futures):
            job = futures[future]
            done[job.prefix] = _exported(job, future.result)
            progress(job.label)
    return done


# ----------------------------------------------------------------------------- the kernel table


def kernel_table(arch: str, kernels: dict[str, ExportedKernel], forward: dict, backward: dict) -> str:
    """C source of the table cuflash_kernels.h declares, for the exported kernels."""
    from .device import capability_of
    from .kernels.common.layouts import dq_accum_row
    from .launchers import ROW_PAD

    major, minor = capability_of(arch)
    lines = ["/* Generated by `cute-flash export`: the kernels this library holds. */",
             '#include "cute_flash.h"', '#include "cuflash_kernels.h"', ""]
    for k in kernels.values():
        lines += [f"void _mlir_{k.prefix}_cuda_init(void **);",
                  f"void _mlir_{k.prefix}_cuda_load_to_device(void **);",
                  f"void {k.launcher}(void **, int32_t);",
                  f'static cf_kernel {k.prefix} = {{"{k.label}", _mlir_{k.prefix}_cuda_init, '
                  f"_mlir_{k.prefix}_cuda_load_to_device, {k.launcher}, 0, 0}};", ""]
    lines.append("const cf_forward_variant cf_forward_variants[] = {")
    for (dtype, head_dim, causal), prefix in forward.items():
        lines.append(f"    {{{DTYPE_CONSTANTS[dtype]}, {head_dim}, {int(causal)}, &{prefix}}},")
    lines += ["    {0, 0, 0, 0},", "};", "const cf_backward_variant cf_backward_variants[] = {"]
    for (dtype, head_dim, causal, gqa, deterministic), prefixes in backward.items():
        m_block = plan_of(arch, "main", dtype, head_dim, causal, gqa, deterministic).settings()["m_block_size"]
        group_sum = f"&{prefixes['sum']}" if gqa else "0"
        lines.append(f"    {{{DTYPE_CONSTANTS[dtype]}, {head_dim}, {int(causal)}, {int(gqa)}, {int(deterministic)}, "
                     f"{m_block}, {dq_accum_row(head_dim)}, &{prefixes['pre']}, &{prefixes['main']}, "
                     f"&{prefixes['post']}, {group_sum}}},")
    info = build_info(arch, forward, backward)
    lines += ["    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},", "};",
              f"const int cf_target_major = {major}, cf_target_minor = {minor}, "
              f"cf_target_arch_specific = {int(arch.endswith('a'))};",
              f"const int cf_row_pad = {ROW_PAD};",
              "const char cf_build_info[] = " + "\n    ".join(_c_string(line + "\n") for line in info) + ";", ""]
    return "\n".join(lines)


def build_info(arch: str, forward: dict, backward: dict) -> list[str]:
    import cutlass

    lines = [f"cute-flash {__version__}, C ABI version {abi_version()}, target {arch} (sm80 kernel family), "
             f"nvidia-cutlass-dsl {cutlass.__version__}"]
    lines += [f"forward {DTYPE_SHORT[dtype]} head_dim={head_dim} causal={int(causal)}"
              for dtype, head_dim, causal in forward]
    lines += [f"backward {DTYPE_SHORT[dtype]} head_dim={head_dim} causal={int(causal)} gqa={int(gqa)} "
              f"deterministic={int(deterministic)}" for dtype, head_dim, causal, gqa, deterministic in backward]
    return lines


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def abi_version() -> int:
    """CUFLASH_ABI_VERSION of the shipped header."""
    return int(re.search(r"#define CUFLASH_ABI_VERSION (\d+)", (C_ABI_DIR / HEADER).read_text())[1])


# ----------------------------------------------------------------------------- linking


def dsl_library_dir() -> Path:
    """Where the DSL keeps its runtime libraries (python -m cutlass.cute.export.aot_config --libdir)."""
    from cutlass.cute.export import aot_config

    libdir = aot_config.get_libdir()
    if not libdir:
        raise ExportError("the CuTe DSL's runtime libraries were not found (aot_config --libdir is empty)")
    return Path(libdir)


def find_static_cudart() -> Path | None:
    """libcudart_static.a of the CUDA toolkit named by CUDA_HOME or CUDA_PATH, or /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        for lib in ("lib64", "lib"):
            if root and Path(root, lib, "libcudart_static.a").is_file():
                return Path(root, lib, "libcudart_static.a")
    return None


def _cuda_major(folder_name: str) -> int | None:
    """12 for the DSL's runtime folder 'cu12'."""
    match = re.fullmatch(r"cu(\d+)", folder_name)
    return int(match[1]) if match else None


def _toolkit_cuda_major(cudart_static: Path) -> int | None:
    """The CUDA major version of the toolkit a libcudart_static.a belongs to (CUDART_VERSION in its
    include/cuda_runtime_api.h), if that header is there."""
    header = cudart_static.resolve().parent.parent / "include" / "cuda_runtime_api.h"
    match = re.search(r"#define CUDART_VERSION\s+(\d+)", header.read_text()) if header.is_file() else None
    return int(match[1]) // 1000 if match else None


def _run(argv: list) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise ExportError(f"{shlex.join(str(a) for a in argv)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def _compiler(cc: str | None) -> str:
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise ExportError(f"no C compiler {cc!r} on PATH (set CC or pass --cc)")
    return cc


def _runtime_arguments(runtime: str, out_dir: Path, cudart_static: Path | None) -> list:
    """The linker's arguments for the DSL's runtime."""
    if runtime == "shared":
        return ["-L", out_dir, "-lcute_dsl_runtime", "-Wl,-rpath,$ORIGIN"]
    if runtime == "static":
        cudart_static = cudart_static or find_static_cudart()
        if cudart_static is None:
            raise ExportError("--runtime static needs libcudart_static.a: set CUDA_HOME or pass --cudart-static")
        libdir = dsl_library_dir()
        wanted, found = _cuda_major(libdir.parent.name), _toolkit_cuda_major(cudart_static)
        if wanted is not None and found is not None and wanted != found:
            raise ExportError(f"{cudart_static} is CUDA {found}'s, the DSL's runtime ({libdir}) was built for CUDA "
                              f"{wanted}: pass the static CUDA runtime of a CUDA {wanted} toolkit, or --runtime shared")
        return [libdir / STATIC_RUNTIME, cudart_static, "-ldl", "-lrt"]
    raise ExportError(f"unknown runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")


def link_library(out_dir: Path, build_dir: Path, runtime: str = "shared", cc: str | None = None,
                 cudart_static: Path | None = None) -> Path:
    """Compile the shim and the kernel table of `build_dir` and link them with its kernel objects
    into out_dir/libcute_flash.so, with the DSL's runtime as `runtime` says."""
    cc = _compiler(cc)
    runtime_args = _runtime_arguments(runtime, out_dir, cudart_static)
    objects = []
    for source in (C_ABI_DIR / "cuflash.c", build_dir / "cuflash_kernels.c"):
        obj = build_dir / f"{source.stem}.o"
        _run([cc, "-std=c11", "-O2", "-fPIC", "-Wall", "-Werror", "-I", C_ABI_DIR, "-c", source, "-o", obj])
        objects.append(obj)
    objects += sorted(p for p in build_dir.glob("cfk_*.o"))
    exports = build_dir / "exports.map"
    exports.write_text("{ global: cuflash_*; local: *; };\n")  # the kernels' DSL symbols stay inside
    if runtime == "shared":
        shutil.copy2(dsl_library_dir() / SHARED_RUNTIME, out_dir / SHARED_RUNTIME)
    library = out_dir / LIBRARY
    _run([cc, "-shared", "-o", library, *objects, *runtime_args, "-lpthread", "-lm", f"-Wl,-soname,{LIBRARY}",
          f"-Wl,--version-script={exports}", "-Wl,--no-undefined"])
    return library


# ----------------------------------------------------------------------------- all of it


def export_library(out_dir, arch: str, dtypes, head_dims, causals=(False, True), passes=("fwd", "bwd"),
                   runtime: str = "shared", jobs: int = 1, cc: str | None = None, cudart_static: Path | None = None,
                   progress=lambda label: None, *, gqas=(False, True), deterministics=(False,)) -> Export:
    """Compile the chosen variants for `arch` and build out_dir/libcute_flash.so and
    out_dir/cute_flash.h; the kernel objects, the DSL's headers and the kernel table stay in
    out_dir/build (for linking the kernels into a program statically). `dtypes` are torch's
    names ("bfloat16", "float16", "float32": split TF32). The backward is exported for every combination of `gqas`
    (False: kv_heads == heads; True: grouped-query) and `deterministics`."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    # What the link needs is checked before minutes of compiling.
    _compiler(cc)
    _runtime_arguments(runtime, out_dir, cudart_static)
    build_dir = out_dir / "build"
    if build_dir.exists():
        shutil.rmtree(build_dir)  # objects of an earlier export would be linked too
    build_dir.mkdir(parents=True)
    todo, forward, backward = kernel_jobs(arch, dtypes, head_dims, causals, passes, gqas, deterministics)
    kernels = _export_all(arch, todo, build_dir, jobs, progress)
    (build_dir / "cuflash_kernels.c").write_text(kernel_table(arch, kernels, forward, backward))
    library = link_library(out_dir, build_dir, runtime, cc, cudart_static)
    header = out_dir / HEADER
    shutil.copy2(C_ABI_DIR / HEADER, header)
    return Export(library, header, build_dir, len(kernels), time.perf_counter() - start)
