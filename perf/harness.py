"""Timing and memory measurement, independent of what is being measured.

`measure_times` calls `run_once(i)` (i picks one of several input sets) under a `Clock`:
`CudaClock` on a GPU (CUDA events around each call, the GPU kept busy with a sleep kernel so
that host launch cost does not leak into device time, and an L2 flush when the input sets are
small enough to stay cached), `WallClock` elsewhere (tests). Every call's output is dropped
before the next, so no method reuses an output buffer it just wrote.
`measure_times_interleaved` times several methods in turns, over rounds whose orders are
carryover-balanced: each method follows every other equally often.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import time
from typing import Callable, Mapping

import torch

from . import nvml

# ----------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(times_ms: list[float]) -> dict:
    s = sorted(times_ms)
    q25, q75 = percentile(s, 25), percentile(s, 75)
    return {
        "median": statistics.median(s),
        "p10": percentile(s, 10),
        "p90": percentile(s, 90),
        "iqr": q75 - q25,
        "min": s[0],
        "max": s[-1],
        "reps": len(s),
    }


def round_medians(times_ms: list[float], round_ends: Mapping[int, int], rounds: int) -> list[float | None]:
    """Median of each round's calls; `round_ends[r]` is how many calls had been timed after round r."""
    medians, start = [], 0
    for r in range(rounds):
        end = round_ends.get(r, start)
        medians.append(statistics.median(times_ms[start:end]) if end > start else None)
        start = end
    return medians


def carryover_balanced_orders(n: int) -> list[list[int]]:
    """Orders of methods 0..n-1 in which each method takes each place equally often and follows
    every other method equally often (a Williams design: n orders for even n, 2n for odd n).
    A method timed right after a slower one runs a few percent fast (perf/NOTES.md, 2026-11-23);
    with orders drawn at random, 10 rounds of three methods let one method follow the slowest
    one in 2 rounds and another in 6 often enough to move a ratio by a percent."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(m + shift) % n for m in first] for shift in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders


# ----------------------------------------------------------------------------- errors


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower()


def classify_error(exc: BaseException) -> str:
    """The `status` recorded for a cell that raised: "oom", "unsupported: ..." or "error: ..."."""
    if is_oom(exc):
        return "oom"
    msg = " ".join(str(exc).split())[:300]
    name = type(exc).__name__
    if isinstance(exc, NotImplementedError) or "Unsupported" in name or "NotImplemented" in name:
        return f"unsupported: {name}: {msg}"
    return f"error: {name}: {msg}"


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error: every later cell records it, the run goes on
            pass


# ----------------------------------------------------------------------------- clocks


class WallClock:
    """Host wall time around each call; for CPU tests and as a fallback."""

    def sync(self) -> None:
        pass

    def hold(self, seconds: float) -> None:
        pass

    def sm_mhz(self) -> int | None:
        return None

    def flush_l2(self) -> None:
        pass

    def start(self):
        return time.perf_counter()

    def stop(self, token):
        return (token, time.perf_counter())

    def elapsed_ms(self, marks) -> list[float]:
        return [(b - a) * 1e3 for a, b in marks]


class CudaClock:
    """CUDA events around each call on the current stream."""

    def __init__(self, l2_bytes: int):
        self._flush = torch.empty(max(2 * l2_bytes, 1 << 20), dtype=torch.int8, device="cuda")
        self._cycles_per_s = self._calibrate_sleep()
        self._sm_clock = nvml.SmClock(nvml.cuda_device_uuid(torch.cuda.current_device()))

    @staticmethod
    def _calibrate_sleep() -> float:
        torch.cuda._sleep(1_000_000)  # first call loads the kernel
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        return 10_000_000 / (a.elapsed_time(b) * 1e-3)

    def sync(self) -> None:
        torch.cuda.synchronize()

    def hold(self, seconds: float) -> None:
        """Keep the GPU busy for `seconds` so the host can queue the next calls ahead of it."""
        if seconds > 0:
            torch.cuda._sleep(int(min(seconds, 0.5) * self._cycles_per_s))

    def sm_mhz(self) -> int | None:
        """The SM clock now (NVML), or None where NVML cannot be read."""
        return self._sm_clock.mhz()

    def flush_l2(self) -> None:
        self._flush.zero_()

    def start(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def stop(self, token):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return (token, e)

    def elapsed_ms(self, marks) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in marks]


# ----------------------------------------------------------------------------- measurement


def input_sets_needed(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> tuple[int, bool]:
    """How many input sets to rotate among so consecutive calls do not find their inputs in
    L2 (3x its size between reuses), and whether an explicit L2 flush is still needed."""
    want = 3 * l2_bytes
    n = max(1, min(max_sets, math.ceil(want / max(set_bytes, 1))))
    return n, n * set_bytes < want


@dataclasses.dataclass
class _Timed:
    """One method's timing state while it takes turns with others."""

    run_once: Callable[[int], object]
    reps: int
    host_s: float
    per_call_s: float
    marks: list = dataclasses.field(default_factory=list)
    calls: int = 0
    round_ends: dict = dataclasses.field(default_factory=dict)  # round -> len(marks) after it
    round_sm_mhz: dict = dataclasses.field(default_factory=dict)  # round -> SM clock mid-burst


def _calibrate(run_once, n_sets: int, clock, target_s: float, min_reps: int, max_reps: int) -> _Timed:
    """The first call (compilation, autotuning, allocator growth) is excluded; three more
    estimate the per-call time, which sets the repetition count to roughly `target_s` seconds."""
    run_once(0)
    clock.sync()
    host, t0 = [], time.perf_counter()
    for i in range(3):
        h = time.perf_counter()
        out = run_once((i + 1) % n_sets)
        host.append(time.perf_counter() - h)
        del out
    clock.sync()
    per_call = (time.perf_counter() - t0) / 3
    reps = int(max(min_reps, min(max_reps, target_s / max(per_call, 1e-9))))
    return _Timed(run_once, reps, statistics.median(host), per_call)


def _timed_calls(t: _Timed, n: int, n_sets: int, clock, flush_l2: bool, hold_s: float) -> int | None:
    """`n` back-to-back timed calls, queued behind a GPU sleep of `hold_s` that hides their
    launches; returns the SM clock read while the middle of them runs (None without NVML)."""
    queued_at = time.perf_counter()
    clock.hold(hold_s)
    for _ in range(n):
        if flush_l2:
            clock.flush_l2()
        token = clock.start()
        out = t.run_once(t.calls % n_sets)
        t.marks.append(clock.stop(token))
        del out
        t.calls += 1
    # The host is done queueing; the GPU works through the sleep and then the calls.
    time.sleep(max(0.0, queued_at + hold_s + 0.5 * n * t.per_call_s - time.perf_counter()))
    sm_mhz = clock.sm_mhz()
    clock.sync()
    return sm_mhz


def _calls_in_round(reps: int, rounds: int, i_round: int) -> int:
    """A method's `reps` calls spread evenly over all rounds, so that every method runs in every
    round. Filling rounds in turn instead left a method with fewer calls out of the last round,
    which ran 5-15% slower for every method at 8k-16k keys (the GPU heats over a cell), and so
    compared the methods on different rounds (2026-11-24)."""
    return reps * (i_round + 1) // rounds - reps * i_round // rounds


def measure_times_interleaved(
    runs: Mapping[str, Callable[[int], object]],
    n_sets: int,
    clock,
    *,
    flush_l2: bool = False,
    target_s: float = 0.5,
    min_reps: int = 10,
    max_reps: int = 200,
    burst: int = 25,
    min_rounds: int = 10,
    seed: int = 0,
) -> dict[str, dict | Exception]:
    """Median and spread (ms) of each of several `run_once`s that take turns on the GPU.

    Each method's repetitions are split over the same rounds. The rounds' orders form whole
    carryover-balanced designs (`carryover_balanced_orders`, shuffled, methods assigned at random
    by `seed`), so the round count is rounded up to a multiple of the design's length: a method
    timed right after a slower one can run a few percent fast, and a balanced design gives
    every method that advantage equally often.
    A method that raises gets its exception as its result and the others go on.
    `burst` caps one method's calls per round (more rounds when a method needs more calls).
    Each result also lists its median per round (`round_medians`, None where the method had no
    call that round), so that methods can be compared round by round (results.paired_speedup),
    and the SM clock read in the middle of each round's calls (`round_sm_mhz`, None without NVML).
    """
    results: dict[str, dict | Exception] = {}
    timed: dict[str, _Timed] = {}
    for name, run_once in runs.items():
        try:
            timed[name] = _calibrate(run_once, n_sets, clock, target_s, min_reps, max_reps)
        except Exception as exc:  # noqa: BLE001 - the caller records it
            results[name] = exc
            release_memory()
    if not timed:
        return results
    design = carryover_balanced_orders(len(timed))
    rounds = max([min_rounds] + [math.ceil(t.reps / burst) for t in timed.values()])
    rounds = math.ceil(rounds / len(design)) * len(design)
    # Every method's calls of a round wait behind the same sleep, long enough to queue the calls
    # of the method with the most host time per round, so no method rests longer before its
    # bursts than another (sized per method, FA4's sleeps were 2-3x ours; measured on the H100,
    # that changed a method's speed by at most the round-to-round noise, ~1.5%, either way).
    flush_s = 20e-6 if flush_l2 else 0.0
    hold_s = 1.5 * max((math.ceil(t.reps / rounds) * (t.host_s + flush_s) for t in timed.values()), default=0.0)
    rng = random.Random(seed)
    names = rng.sample(list(timed), len(timed))
    orders = [[names[m] for m in order] for _ in range(rounds // len(design)) for order in rng.sample(design, len(design))]
    for i_round, order in enumerate(orders):
        for name in order:
            t = timed[name]
            n = _calls_in_round(t.reps, rounds, i_round)
            if name in results or not n:
                continue
            try:
                t.round_sm_mhz[i_round] = _timed_calls(t, n, n_sets, clock, flush_l2, hold_s)
                t.round_ends[i_round] = len(t.marks)
            except Exception as exc:  # noqa: BLE001 - the caller records it
                results[name] = exc
                release_memory()
    for name, t in timed.items():
        if name not in results:
            times_ms = clock.elapsed_ms(t.marks)
            stats = summarize(times_ms)
            stats["host_ms_per_call"] = t.host_s * 1e3
            stats["round_medians"] = round_medians(times_ms, t.round_ends, rounds)
            stats["round_sm_mhz"] = [t.round_sm_mhz.get(r) for r in range(rounds)]
            results[name] = stats
    return {name: results[name] for name in runs}


def measure_times(run_once: Callable[[int], object], n_sets: int, clock, **kwargs) -> dict:
    """Median and spread (ms) of `run_once` alone, each input set used in turn."""
    result = measure_times_interleaved({"": run_once}, n_sets, clock, **kwargs)[""]
    if isinstance(result, Exception):
        raise result
    return result


def measure_peak_bytes(run_once: Callable[[int], object]) -> int | None:
    """Peak device memory a call adds on top of what is allocated before it (inputs excluded);
    None without CUDA. Run one warm-up call first so one-time allocations are out."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    release_memory()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run_once(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def guarded(fn: Callable[[], dict]) -> dict:
    """Run one measurement; any exception becomes a recorded status instead of a crash."""
    try:
        result = fn()
        result.setdefault("status", "ok")
        return result
    except Exception as exc:  # noqa: BLE001 - every failure is a result to record
        return {"status": classify_error(exc)}
    finally:
        release_memory()
