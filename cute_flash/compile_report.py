"""Compile a kernel object and report what ptxas made of it (no GPU needed).

    compile_report(kernel_obj, fake_args, *, arch=None) -> CompileReport

`kernel_obj` is a kernel class instance (its `__call__` is a @cute.jit function) and `fake_args`
the arguments to compile it against (fake tensors, a Float32, a fake stream). `arch`, e.g.
"sm_80" or "sm_90a", overrides CUTE_DSL_ARCH for this compile. The report holds the PTX text,
the registers per thread, the spill bytes (stores + loads), the static shared memory ptxas saw
(None when the kernel only uses dynamic smem) and the compile time in seconds.

The ptxas report is printed by native code (and, as a remark, by Python), so output is captured at
the file-descriptor level and at sys.stdout/sys.stderr;
PTX is kept with the compile options --keep-ptx --dump-dir=<temporary directory>, with the
DSL's own file cache disabled for the call (a cached compile would run no ptxas, write nothing).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass



def _dsl_envar():
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar


@dataclass
class CompileReport:
    ptx: str
    registers: int
    spill_bytes: int
    smem_bytes: int | None
    seconds: float


@contextlib.contextmanager
def _capture_output(path: str):
    """Send fds 1/2 (native printers) and sys.stdout/sys.stderr (Python printers, which a test
    runner may have replaced) to the file at `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab", buffering=0) as sink, open(path, "a", buffering=1) as text:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            text.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _parse(log: str) -> tuple[int, int, int | None]:
    text = re.sub(r"\s+", " ", log)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [int(a) + int(b) for a, b in
              re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", text)]
    if not regs:
        raise RuntimeError("no ptxas report found in the compiler output:\n" + log[-4000:])
    return max(regs), max(spills, default=0), (max(smem) if smem else None)


def compile_report(kernel_obj, fake_args, *, arch: str | None = None) -> CompileReport:
    import cutlass.cute as cute

    envar = _dsl_envar()
    saved_caching = envar.disable_file_caching
    with tempfile.TemporaryDirectory(prefix="cute_flash_report_") as tmp:
        options = f"--keep-ptx --dump-dir={tmp} remarks{{ptx}}"
        if arch is not None:
            options = f"--gpu-arch={arch} " + options
        log_path = os.path.join(tmp, "ptxas.log")
        envar.disable_file_caching = True  # a cached compile would run no ptxas and keep nothing
        try:
            start = time.perf_counter()
            with _capture_output(log_path):
                cute.compile(kernel_obj, *fake_args, options=options)
            seconds = time.perf_counter() - start
        finally:
            envar.disable_file_caching = saved_caching
        with open(log_path, errors="replace") as f:
            log = f.read()
        ptx_files = sorted(glob.glob(os.path.join(tmp, "**", "*.ptx"), recursive=True))
        if not ptx_files:
            raise RuntimeError(f"the DSL wrote no PTX under {tmp}")
        ptx = "\n".join(open(p, errors="replace").read() for p in ptx_files)
    registers, spill_bytes, smem_bytes = _parse(log)
    return CompileReport(ptx, registers, spill_bytes, smem_bytes, seconds)
