"""`cute-flash bench --suite NAME`: run a suite on this GPU and write one result file.

Every cell is measured for every available method in the same process, so ratios compare
like with like: same GPU, clocks, inputs and timing rules. A failure in one cell (out of
memory, an unsupported shape, a missing backward) is recorded in that cell and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import zlib
from pathlib import Path

import torch

from cute_flash.cli import ArgumentParser, short_dtype_arg

from . import harness, results
from .methods import METHOD_NAMES, OURS, discover_methods
from .suites import PASSES, SUITES, Cell, attention_flops, get_suite

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative to the current directory (the repository's results archive when run from its root):
# never inside the installed package.
DEFAULT_OUT = Path("perf/results")
DEVICE = "cuda"  # the CPU tests point this at "cpu" to exercise the whole run without a GPU
OVERHEAD_CALLS = 1000
OVERHEAD_GOAL_US = 20.0


class Progress:
    """A one-line progress bar on stderr; on a non-terminal, a line every 5% or 15 s."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = sys.stderr if stream is None else stream
        self.t0 = self._last = time.monotonic()
        self._last_pct = -5
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def step(self, label: str, advance: int = 1) -> None:
        """Announce the unit about to run (`advance=0`) or count it as done."""
        self.done = min(self.total, self.done + advance)
        frac = self.done / self.total
        elapsed = time.monotonic() - self.t0
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
        elif frac * 100 >= self._last_pct + 5 or time.monotonic() - self._last > 15:
            self._last_pct, self._last = frac * 100, time.monotonic()
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------------------- one cell


def make_inputs(cell: Cell, dtype: torch.dtype, n_sets: int, grad: bool, device: str = DEVICE) -> list[tuple]:
    """`n_sets` independent (q, k, v, dout) sets of fresh N(0, 1) values."""
    sets = []
    for _ in range(n_sets):
        q = torch.randn(cell.batch, cell.seqlen_q, cell.nheads, cell.headdim, dtype=dtype, device=device)
        k = torch.randn(cell.batch, cell.seqlen_k, cell.nheads_kv, cell.headdim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        dout = torch.randn_like(q) if grad else None
        sets.append((q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), dout))
    return sets


def make_runner(fn, pass_: str, sets: list[tuple], causal: bool, scale: float, mods: dict = {},  # noqa: B006
                scope=contextlib.nullcontext):
    """`run(i)` performs one `pass_` on input set i (with Cell.mods) and returns its fresh outputs;
    every call of fn and every gradient inside `scope()` (Method.scope)."""
    if pass_ == "fwd":
        def run(i):
            q, k, v, _ = sets[i]
            with torch.no_grad(), scope():
                return fn(q, k, v, causal, scale, **mods)
    elif pass_ == "bwd":
        with scope():
            graphs = [(fn(q, k, v, causal, scale, **mods), (q, k, v), do) for q, k, v, do in sets]

        def run(i):
            out, inputs, do = graphs[i]
            with scope():
                return torch.autograd.grad(out, inputs, do, retain_graph=True)
    elif pass_ == "fwdbwd":
        def run(i):
            q, k, v, do = sets[i]
            with scope():
                return torch.autograd.grad(fn(q, k, v, causal, scale, **mods), (q, k, v), do)
    else:
        raise ValueError(f"unknown pass {pass_!r}")
    return run


def no_autograd_means_unsupported(status: str, pass_: str) -> str:
    """A forward that returns a tensor autograd cannot differentiate has no backward yet."""
    if pass_ != "fwd" and status.startswith("error:") and "does not require grad" in status:
        return "unsupported: no backward (output has no grad_fn): " + status[len("error: "):]
    return status


def peak_of_one_call(m, pass_: str, sets: list[tuple], cell: Cell, scale: float) -> dict:
    run = make_runner(m.fn, pass_, sets, cell.causal, scale, cell.mods(), m.scope)
    run(0)  # warm-up: compilation and one-time workspaces are not per call
    return {"peak_bytes": harness.measure_peak_bytes(run)}


def time_methods(cell: Cell, pass_: str, methods, sets: list[tuple], scale: float, clock, n_sets: int,
                 flush: bool, target_s: float, seed: int, min_rounds: int = 10) -> dict[str, dict]:
    """Each method's timing row (or failure status) for one pass; the methods take turns on the
    GPU in carryover-balanced orders, so each follows every other equally often."""
    runs, measured = {}, {}
    for m in methods:
        try:
            runs[m.name] = make_runner(m.fn, pass_, sets, cell.causal, scale, cell.mods(), m.scope)
        except Exception as exc:  # noqa: BLE001 - every failure is a result to record
            measured[m.name] = {"status": harness.classify_error(exc)}
            harness.release_memory()
    times = harness.measure_times_interleaved(runs, n_sets, clock, flush_l2=flush, target_s=target_s, seed=seed,
                                              min_rounds=min_rounds)
    for name, stats in times.items():
        if isinstance(stats, Exception):
            measured[name] = {"status": harness.classify_error(stats)}
            continue
        sec = stats["median"] * 1e-3
        measured[name] = harness.guarded(lambda run=runs[name], stats=stats, sec=sec: {
            "time_ms": stats,
            "tflops": attention_flops(cell, pass_) / sec / 1e12,
            "tokens_per_s": cell.batch * cell.seqlen_q / sec,
            "peak_bytes": harness.measure_peak_bytes(run),
            "input_sets": n_sets,
            "l2_flush": flush,
        })
    del runs, times
    harness.release_memory()
    if len(methods) > 1:  # the others' saved graphs may have been what ran out: try alone
        for m in methods:
            if measured[m.name]["status"] == "oom":
                measured.update(time_methods(cell, pass_, [m], sets, scale, clock, n_sets, flush, target_s, seed,
                                             min_rounds))
    return measured


def method_errors(m, cell: Cell, sets: list[tuple], scale: float) -> dict:
    """The method's max abs error vs the float64 reference on the first batch element of the
    first input set: out for "fwd", the largest of dq, dk, dv for "bwd" (and "fwdbwd")."""
    from cute_flash import reference_attention

    q, k, v, dout = (None if t is None else t[:1].detach() for t in sets[0])
    grad = dout is not None
    exact = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref_out, _ = reference_attention(*exact, softmax_scale=scale, causal=cell.causal)
    inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with m.scope():
        out = m.fn(*inputs, cell.causal, scale)
    errors = {"fwd": (out.double() - ref_out).abs().max().item()}
    if grad:
        ref_grads = torch.autograd.grad(ref_out, exact, dout.double())
        with m.scope():
            grads = torch.autograd.grad(out, inputs, dout)
        errors["bwd"] = errors["fwdbwd"] = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
    return errors


def measure_cell(cell: Cell, suite: str, dtype_name: str, methods, clock, l2_bytes: int,
                 progress: Progress, target_s: float, device: str = DEVICE, min_rounds: int = 10,
                 accuracy: bool = False) -> list[dict]:
    dtype = DTYPES[dtype_name]
    scale = cell.headdim ** -0.5
    grad = any(p != "fwd" for p in cell.passes)
    q_elems = cell.batch * cell.seqlen_q * cell.nheads * cell.headdim
    kv_elems = cell.batch * cell.seqlen_k * cell.nheads_kv * cell.headdim
    set_bytes = ((2 if grad else 1) * q_elems + 2 * kv_elems) * dtype.itemsize  # q (+ dout), k, v
    n_sets, flush = (1, False) if cell.kind == "memory" else harness.input_sets_needed(set_bytes, l2_bytes)
    base = {"suite": suite, "dtype": dtype_name, **cell.key()}
    rows = []
    try:
        sets = make_inputs(cell, dtype, n_sets, grad, device)
    except Exception as exc:  # noqa: BLE001 - the inputs alone may not fit
        status = "inputs: " + harness.classify_error(exc)
        for pass_ in cell.passes:
            rows += [{**base, "pass": pass_, "method": m.name, "status": status} for m in methods]
            progress.step(f"{suite} {cell.label()} {pass_}: {status}", len(methods))
        return rows

    errors = {}
    if accuracy:
        for m in methods:
            try:
                errors[m.name] = method_errors(m, cell, sets, scale)
            except Exception as exc:  # noqa: BLE001 - a method that fails here fails its timing too
                errors[m.name] = {"status": harness.classify_error(exc)}
            harness.release_memory()
    for pass_ in cell.passes:
        progress.step(f"{suite} {pass_} {cell.label()}", 0)
        if cell.kind == "memory":
            measured = {m.name: harness.guarded(lambda m=m: peak_of_one_call(m, pass_, sets, cell, scale))
                        for m in methods}
        else:
            seed = zlib.crc32(f"{suite} {pass_} {cell.label()}".encode())
            measured = time_methods(cell, pass_, methods, sets, scale, clock, n_sets, flush, target_s, seed,
                                    min_rounds)
        for m in methods:
            row = {**base, "pass": pass_, "method": m.name, **measured[m.name]}
            row["status"] = no_autograd_means_unsupported(row["status"], pass_)
            if pass_ in errors.get(m.name, {}):
                row["max_error"] = errors[m.name][pass_]
            rows.append(row)
        progress.step(f"{suite} {pass_} {cell.label()} done", len(methods))
    del sets
    harness.release_memory()
    return rows


# ----------------------------------------------------------------------------- machine facts


def measure_roofline(clock) -> dict:
    """Dense bf16 GEMM peak (torch.matmul at 8192^3) and device-to-device copy bandwidth."""
    out = {}
    n = 8192

    def gemm():
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        stats = harness.measure_times(lambda i: torch.matmul(a, b), 1, clock, target_s=0.5)
        return {"shape": [n, n, n], "dtype": "bf16", "time_ms": stats, "tflops": 2 * n**3 / (stats["median"] * 1e-3) / 1e12}

    def copy():
        nbytes = 1 << 30
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        stats = harness.measure_times(lambda i: dst.copy_(src), 1, clock, target_s=0.5)
        return {"bytes": nbytes, "time_ms": stats, "gb_per_s": 2 * nbytes / (stats["median"] * 1e-3) / 1e9,
                "note": "read + write bytes per copy"}

    out["gemm"] = harness.guarded(gemm)
    out["copy"] = harness.guarded(copy)
    return out


def measure_overhead(methods, clock, dtype_name: str) -> dict:
    """Per-call host cost of a tiny forward (B=1, S=128, H=1, D=64) without CUDA graphs:
    wall time of OVERHEAD_CALLS back-to-back calls minus their device time."""
    dtype = DTYPES[dtype_name]
    q, k, v = (torch.randn(1, 128, 1, 64, dtype=dtype, device=DEVICE) for _ in range(3))
    out = {"shape": {"batch": 1, "seqlen": 128, "nheads": 1, "headdim": 64, "dtype": dtype_name},
           "calls": OVERHEAD_CALLS, "goal_us": OVERHEAD_GOAL_US, "methods": {}}
    for m in methods:
        if m.name not in (OURS, "sdpa_flash", "fa4") or not m.available:
            continue

        def one(fn=m.fn):
            def run(i):
                with torch.no_grad():
                    return fn(q, k, v, False, 0.125)

            for _ in range(20):
                run(0)
            device = harness.measure_times(run, 1, clock, min_reps=200, max_reps=200)
            clock.sync()
            t0 = time.perf_counter()
            for _ in range(OVERHEAD_CALLS):
                run(0)
            clock.sync()
            wall_us = (time.perf_counter() - t0) / OVERHEAD_CALLS * 1e6
            device_us = device["median"] * 1e3
            host_us = max(wall_us - device_us, 0.0)
            return {"wall_us_per_call": wall_us, "device_us_per_call": device_us,
                    "host_us_per_call": host_us, "enqueue_us_median": device["host_ms_per_call"] * 1e3,
                    "meets_goal": host_us <= OVERHEAD_GOAL_US}

        out["methods"][m.name] = harness.guarded(one)
    out["torch_add_us_per_call"] = eager_op_us(clock)
    return out


def eager_op_us(clock) -> float:
    """Wall time per call of one tiny eager `torch.add`: this host's cost of a single PyTorch
    op launch, the yardstick for the overhead numbers above (they vary with the CPU)."""
    x = torch.ones(1, device=DEVICE)
    for _ in range(20):
        torch.add(x, x)
    clock.sync()
    t0 = time.perf_counter()
    for _ in range(OVERHEAD_CALLS):
        torch.add(x, x)
    clock.sync()
    return (time.perf_counter() - t0) / OVERHEAD_CALLS * 1e6


# ----------------------------------------------------------------------------- report


def summary_table(rows: list[dict]) -> str:
    """One line per (cell, pass): TFLOP/s (speed) or peak MiB (memory) of each method."""
    names = list(dict.fromkeys(r["method"] for r in rows))
    lines = [f"{'suite':6} {'pass':6} {'cell':44} " + " ".join(f"{n[:12]:>12}" for n in names)]
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault(results.cell_group_key(r), {})[r["method"]] = r
    for key, by in groups.items():
        r0 = next(iter(by.values()))
        mods = results.mods_label(r0)
        cell = (f"B={r0['batch']} S={r0['seqlen_q']} H={r0['nheads']} D={r0['headdim']}{' c' if r0['causal'] else ''}"
                f"{' ' + mods if mods else ''}")
        cols = []
        for n in names:
            r = by.get(n)
            if r is None:
                cols.append("-")
            elif r["status"] != "ok":
                cols.append(r["status"].split(":")[0])
            elif r["kind"] == "memory":
                cols.append(f"{(r['peak_bytes'] or 0) / 2**20:.0f}MiB")
            elif "max_error" in r:
                cols.append(f"{r['tflops']:.0f}TF {r['max_error']:.0e}")
            else:
                cols.append(f"{r['tflops']:.1f}TF")
        lines.append(f"{r0['suite']:6} {r0['pass']:6} {cell:44} " + " ".join(f"{c[:12]:>12}" for c in cols))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="cute-flash bench", description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True,
                   help=f"suite name, or several joined by commas (one result file): {', '.join(SUITES)}")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the result file (default: %(default)s)")
    p.add_argument("--dtype", type=short_dtype_arg, default=None,
                   help="bf16 (bfloat16), fp16 (float16, half) or fp32 (default: the suite's own: paper/quick bf16, "
                        "seed fp16, fp32 fp32)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of: {', '.join(METHOD_NAMES)} (default: all)")
    p.add_argument("--target-s", type=float, default=0.5, help="seconds of timed calls per measurement (default: 0.5)")
    p.add_argument("--min-rounds", type=int, default=10,
                   help="turns each method takes per cell, at least (rounded up to whole balanced designs: "
                        "12 for three methods at the default 10); more rounds narrow a cell's spread where "
                        "the GPU's clock wanders from round to round (default: 10)")
    p.add_argument("--no-roofline", action="store_true", help="skip the GEMM-peak and copy-bandwidth measurement")
    p.add_argument("--headdims", type=_ints, default=None, help="only these head dims, e.g. 64,128")
    p.add_argument("--seqlens", type=_ints, default=None, help="only these seqlens, e.g. 512,1024")
    p.add_argument("--passes", type=_passes, default=None, help="only these passes: fwd,bwd,fwdbwd")
    p.add_argument("--causal", choices=("yes", "no"), default=None, help="only causal (yes) or non-causal (no) cells")
    return p.parse_args(argv)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _passes(text: str) -> tuple[str, ...]:
    passes = tuple(x for x in text.split(",") if x)
    if not set(passes) <= set(PASSES):
        raise argparse.ArgumentTypeError(f"passes must be among {', '.join(PASSES)}")
    return passes


def select_cells(cells: list[Cell], args: argparse.Namespace) -> list[Cell]:
    """The suite's cells narrowed by --headdims/--seqlens/--passes/--causal, so a long suite
    can be split across several runs (the dashboard merges runs of one commit)."""
    out = []
    for c in cells:
        if args.headdims and c.headdim not in args.headdims:
            continue
        if args.seqlens and c.seqlen_q not in args.seqlens:
            continue
        if args.causal and c.causal != (args.causal == "yes"):
            continue
        passes = tuple(p for p in c.passes if not args.passes or p in args.passes)
        if passes:
            out.append(dataclasses.replace(c, passes=passes))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        suites = [get_suite(n.strip()) for n in args.suite.split(",") if n.strip()]
        methods = discover_methods(args.methods.split(",") if args.methods else None)
    except ValueError as exc:
        print(f"cute-flash bench: {exc}", file=sys.stderr)
        return 2
    notes = {s.name: s.unavailable for s in suites if s.unavailable}
    for name, note in notes.items():
        print(f"cute-flash bench: suite {name!r} is {note}", file=sys.stderr)
    runnable = [s for s in suites if not s.unavailable]
    for s in runnable:
        s.cells = select_cells(s.cells, args)
    if not any(s.cells for s in runnable):
        if runnable:
            print("cute-flash bench: the filters left no cells to run", file=sys.stderr)
        return 0 if not runnable else 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("cute-flash bench: no CUDA GPU visible; benchmarks only run on a GPU", file=sys.stderr)
        return 2

    for m in methods:
        if not m.available:
            print(f"cute-flash bench: skipping {m.name}: {m.note}", file=sys.stderr)
    usable = [m for m in methods if m.available]
    # fp32 peers run in fp32: no TF32 inside torch's matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = results.gpu_info()
    doc = {
        "schema": results.SCHEMA,
        "suites": [s.name for s in suites],
        "dtype": args.dtype or "suite default",
        "created_utc": results.utc_now().isoformat(timespec="seconds"),
        "git": results.git_commit(Path(__file__).resolve().parent),
        "gpu": gpu,
        "environment": results.environment(),
        "versions": results.versions(),
        "methods": {m.name: m.info() for m in methods},
        "suite_notes": notes,
        "filters": {k: getattr(args, k) for k in ("headdims", "seqlens", "passes", "causal") if getattr(args, k)},
        "tf32": "off (torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False)",
        "timing": {"target_s": args.target_s, "min_rounds": args.min_rounds,
                   "clock": "cuda events per call, GPU held busy ahead of the host",
                   "statistic": "median, p10/p90, IQR over reps; first call excluded",
                   "order": f"a cell's methods take turns over >= {args.min_rounds} rounds in carryover-balanced orders "
                            "(each method follows every other equally often); SM clock read mid-burst"},
    }

    def suite_methods(s):
        return [m for m in usable if args.methods or s.methods is None or m.name in s.methods]

    total = sum(len(c.passes) * len(suite_methods(s)) for s in runnable for c in s.cells)
    total += 0 if args.no_roofline else 1
    total += 1 if any(s.overhead for s in runnable) else 0
    progress = Progress(total)
    clock = harness.CudaClock(gpu["l2_bytes"]) if DEVICE == "cuda" else harness.WallClock()

    doc["roofline"] = None
    if not args.no_roofline:
        progress.step("roofline: bf16 GEMM 8192^3 and 1 GiB copy", 0)
        doc["roofline"] = measure_roofline(clock)
        progress.step("roofline done")
    doc["overhead"] = None
    if any(s.overhead for s in runnable):
        progress.step("host overhead: 1000 tiny forwards", 0)
        doc["overhead"] = measure_overhead(usable, clock, args.dtype or "bf16")
        progress.step("overhead done")

    rows: list[dict] = []
    path = results.new_path(doc, args.out)

    def save(complete: bool) -> None:
        doc.update(measurements=rows, ratios=results.compute_ratios(rows),
                   memory_oom_at=results.memory_oom_points(rows), complete=complete)
        results.write(doc, args.out, path)

    save(False)
    for s in runnable:
        for cell in s.cells:
            rows += measure_cell(cell, s.name, args.dtype or s.dtype, suite_methods(s), clock, gpu["l2_bytes"],
                                 progress, args.target_s, DEVICE, args.min_rounds, s.accuracy)
            save(False)
    progress.close()
    save(True)

    print(summary_table(rows))
    ov = (doc["overhead"] or {}).get("methods", {}).get(OURS)
    if ov and ov["status"] == "ok":
        print(f"host overhead (ours): {ov['host_us_per_call']:.1f} us/call (goal <= {OVERHEAD_GOAL_US:.0f}); "
              f"one eager torch.add on this host: {doc['overhead']['torch_add_us_per_call']:.1f} us")
    rf = doc["roofline"] or {}
    if rf.get("gemm", {}).get("status") == "ok":
        print(f"roofline: bf16 GEMM {rf['gemm']['tflops']:.0f} TFLOP/s, copy {rf['copy'].get('gb_per_s', 0):.0f} GB/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
