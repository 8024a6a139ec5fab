"""Benchmark harness logic on the CPU: FLOPs, suites, file names, schema, ratios, failures.

Nothing here is a GPU result: cells run tiny problems on the CPU under a wall clock only to
exercise the bookkeeping, and documents written here live in tmp_path.
"""

import io
from pathlib import Path
import json
import time

import pytest
import torch

from cute_flash.perf import bench, harness, results
from cute_flash.perf.__main__ import main as perf_main
from cute_flash.perf.methods import Method, discover_methods, standard_attention
from cute_flash.perf.suites import PASSES, Cell, attention_flops, get_suite


# ----------------------------------------------------------------------------- FLOPs


def test_forward_flops_match_the_paper_formula():
    cell = Cell(2, 1024, 1024, 16, 16, 128, False)
    assert attention_flops(cell, "fwd") == 4 * 2 * 16 * 1024 * 1024 * 128


def test_causal_halves_and_passes_scale():
    dense = Cell(1, 2048, 2048, 8, 8, 64, False)
    causal = Cell(1, 2048, 2048, 8, 8, 64, True)
    assert attention_flops(causal, "fwd") == attention_flops(dense, "fwd") / 2
    assert attention_flops(dense, "bwd") == 2.5 * attention_flops(dense, "fwd")
    assert attention_flops(dense, "fwdbwd") == 3.5 * attention_flops(dense, "fwd")


def test_causal_is_not_halved_when_lengths_differ():
    cell = Cell(1, 128, 1024, 8, 8, 64, True)
    assert attention_flops(cell, "fwd") == 4 * 8 * 128 * 1024 * 64


# ----------------------------------------------------------------------------- suites


def test_paper_suite_shapes():
    suite = get_suite("paper")
    assert suite.dtype == "bf16" and suite.overhead
    assert len(suite.cells) == 3 * 2 * 6
    for c in suite.cells:
        assert c.batch * c.seqlen_q == 16384
        assert c.nheads * c.headdim == 2048
        assert c.seqlen_q == c.seqlen_k and c.passes == PASSES
    assert {c.headdim for c in suite.cells} == {64, 128, 256}
    assert {c.seqlen_q for c in suite.cells} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {c.causal for c in suite.cells} == {False, True}


def test_seed_suite_shapes():
    suite = get_suite("seed")
    assert suite.dtype == "fp16"
    mem = [c for c in suite.cells if c.kind == "memory"]
    speed = [c for c in suite.cells if c.kind == "speed"]
    assert [c.seqlen_q for c in mem] == [1024, 4096, 16384, 65536]
    assert all(c.batch == 1 and c.headdim == 64 for c in mem)
    assert [c.batch for c in speed] == [1, 8, 32]
    assert all(c.seqlen_q == 1024 and c.causal for c in speed)


def test_quick_is_small_and_decode_is_registered_but_unavailable():
    quick = get_suite("quick")
    assert 0 < len(quick.cells) <= 8 and quick.overhead
    decode = get_suite("decode")
    assert not decode.cells and "KV-cache" in decode.unavailable
    with pytest.raises(ValueError):
        get_suite("nope")


def test_decode_suite_exits_cleanly_with_a_note(capsys):
    assert bench.main(["--suite", "decode"]) == 0
    assert "python -m cute_flash.perf decode" in capsys.readouterr().err


def test_decode_runner_cells():
    from cute_flash.perf import decode

    full, quick = decode.cells(False, [128, 64]), decode.cells(True, [128])
    assert len(set(full)) == len(full) and set(quick) <= set(full)
    assert {c.layout for c in full} == {"contiguous", "paged16", "paged256"}
    assert {(c.nheads, c.nheads_kv) for c in full} == {(32, 8), (8, 1)} and {c.seqlen_q for c in full} == {1, 8}
    assert min(c.batch for c in full) == 1 and max(c.batch for c in full) == 64
    assert min(c.cache_len for c in full) == 4096 and max(c.cache_len for c in full) == 131072
    cell = decode.DecodeCell(8, 32768, 1, 32, 8, 128, "contiguous")
    assert cell.kv_bytes == 8 * 32768 * 8 * 128 * 4
    row = {"cell": {"batch": 8, "cache_len": 32768}, "ours_tbps": 2.6, "cudnn_tbps": 2.5, "flash_tbps": 2.4}
    assert decode.verdict(row, 3.0)["passes"]
    assert not decode.verdict(dict(row, ours_tbps=2.45), 3.0)["passes"]  # below cuDNN
    assert not decode.verdict(dict(row, ours_tbps=2.52), 3.0)["passes"]  # 0.84x the copy


def test_varlen_runner_packs_16k_tokens_of_the_promised_lengths(capsys):
    from cute_flash.perf import varlen

    assert not get_suite("varlen").cells and "python -m cute_flash.perf varlen" in get_suite("varlen").unavailable
    for seed in range(20):
        lengths = varlen.lengths_for(seed)
        assert sum(lengths) == varlen.TOKENS and varlen.MIN_LEN <= min(lengths) and max(lengths) <= varlen.MAX_LEN
    assert varlen.lengths_for(3) == varlen.lengths_for(3)
    assert varlen.forward_flops([2, 3], False) == 4.0 * 16 * 128 * 13
    assert varlen.forward_flops([2, 3], True) == 4.0 * 16 * 128 * 9


def test_module_entry_point_dispatches(capsys):
    assert perf_main(["bench", "--suite", "decode"]) == 0
    assert perf_main(["frobnicate"]) == 2


# ----------------------------------------------------------------------------- naming


def test_result_filename():
    name = results.result_filename("sm90", "NVIDIA H100 80GB HBM3", "20261122", "abc1234")
    assert name == "sm90-nvidia-h100-80gb-hbm3-20261122-abc1234.json"
    assert results.slugify("  A100-SXM4 (40GB) ") == "a100-sxm4-40gb"


def test_unique_path_never_overwrites(tmp_path):
    first = results.unique_path(tmp_path, "x.json")
    first.write_text("{}")
    second = results.unique_path(tmp_path, "x.json")
    assert second.name == "x-2.json"


def test_git_commit_outside_a_repo(tmp_path, monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_GIT_COMMIT", raising=False)
    assert results.git_commit(tmp_path)["commit"] == "nogit"
    monkeypatch.setenv("CUTE_FLASH_GIT_COMMIT", "abc1234")
    assert results.git_commit(tmp_path)["commit"] == "abc1234"


# ----------------------------------------------------------------------------- statistics


def test_summarize_percentiles():
    s = harness.summarize([float(x) for x in range(1, 102)])  # 1..101
    assert s["median"] == 51 and s["p10"] == 11 and s["p90"] == 91
    assert s["iqr"] == 50 and s["reps"] == 101 and s["min"] == 1


def test_input_sets_rotate_small_problems_and_flush_tiny_ones():
    l2 = 50 * 2**20
    assert harness.input_sets_needed(4 * l2, l2) == (1, False)
    n, flush = harness.input_sets_needed(l2, l2)
    assert n == 3 and not flush
    n, flush = harness.input_sets_needed(1024, l2)
    assert n == 8 and flush


def test_measure_times_with_wall_clock_counts_reps():
    calls = []
    stats = harness.measure_times(lambda i: calls.append(i), 3, harness.WallClock(), min_reps=7, max_reps=7)
    assert stats["reps"] == 7
    assert len(calls) == 1 + 3 + 7  # compile call, estimate, timed
    assert set(calls) == {0, 1, 2}  # every input set is used


def test_interleaved_methods_take_turns_in_a_fresh_order_each_round():
    calls = []

    def method(name):
        return lambda i: calls.append(name)

    times = harness.measure_times_interleaved({"a": method("a"), "b": method("b")}, 2, harness.WallClock(),
                                              min_reps=20, max_reps=20, min_rounds=10, seed=3)
    assert times["a"]["reps"] == 20 and times["b"]["reps"] == 20
    timed = calls[8:]  # each method's compile call and three estimates come first
    assert len(timed) == 40
    firsts = [timed[4 * r] for r in range(10)]  # two calls per method per round
    assert all(len(set(timed[4 * r:4 * r + 2])) == 1 for r in range(10))  # a round's share runs together
    assert firsts.count("a") == firsts.count("b") == 5  # each goes first in half the rounds


def test_balanced_orders_let_each_method_follow_every_other_equally_often():
    for n in range(1, 7):
        orders = harness.carryover_balanced_orders(n)
        assert len(orders) == (n if n % 2 == 0 else 2 * n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        for place in range(n):  # each method in each place equally often
            assert sorted(order[place] for order in orders) == sorted(list(range(n)) * (len(orders) // n))
        follows = {}
        for order in orders:
            for before, after in zip(order, order[1:]):
                follows[before, after] = follows.get((before, after), 0) + 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


class _BurstMarkingClock(harness.WallClock):
    """Appends "|" to `calls` at each burst's hold, so the calls between two marks are one burst."""

    def __init__(self, calls: list):
        self.calls = calls

    def hold(self, seconds):
        self.calls.append("|")


def test_three_methods_each_follow_each_other_in_as_many_rounds():
    calls = []
    times = harness.measure_times_interleaved(
        {name: (lambda i, name=name: calls.append(name)) for name in "abc"}, 1, _BurstMarkingClock(calls),
        min_reps=12, max_reps=12, min_rounds=10, seed=7)
    assert len(times["a"]["round_medians"]) == 12  # 10 rounded up to two whole 6-order designs
    assert times["a"]["round_sm_mhz"] == [None] * 12  # the wall clock reads no SM clock
    bursts = [b[0] for b in "".join(calls).split("|")[1:]]
    rounds = ["".join(bursts[3 * r:3 * r + 3]) for r in range(12)]
    assert sorted(rounds) == sorted(["abc", "acb", "bac", "bca", "cab", "cba"] * 2)


def test_methods_with_different_call_counts_share_every_round():
    calls = []
    times = harness.measure_times_interleaved(
        {"a": lambda i: calls.append("a"), "b": lambda i: calls.append("b")}, 1, _BurstMarkingClock(calls),
        min_reps=10, max_reps=10, min_rounds=4, seed=1)
    assert times["a"]["reps"] == times["b"]["reps"] == 10
    # Rounds of 2 or 3 calls per method (10 over 4 rounds), each method in every round.
    assert all(m is not None for stats in times.values() for m in stats["round_medians"])
    bursts = "".join(calls).split("|")[1:]
    assert sorted(len(b) for b in bursts) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert [harness._calls_in_round(64, 10, r) for r in range(10)] == [6, 6, 7, 6, 7, 6, 6, 7, 6, 7]
    assert sum(harness._calls_in_round(63, 10, r) for r in range(10)) == 63
    assert [harness._calls_in_round(3, 5, r) for r in range(5)] == [0, 1, 0, 1, 1]


def test_every_method_waits_behind_the_same_sleep_each_round():
    # The sleep that hides launches must not depend on whose calls follow it: a method with slow
    # host code would otherwise rest longer before each of its bursts.
    class RecordingClock(harness.WallClock):
        def __init__(self):
            self.holds = []

        def hold(self, seconds):
            self.holds.append(seconds)

    clock = RecordingClock()
    slow_host = lambda i: time.sleep(0.002)
    times = harness.measure_times_interleaved({"fast": lambda i: None, "slow": slow_host}, 1, clock,
                                              min_reps=10, max_reps=10, min_rounds=5)
    assert times["fast"]["reps"] == 10 and times["slow"]["reps"] == 10
    assert len(clock.holds) == 12  # one per method per round; 5 rounds rounded up to whole (2-order) designs
    assert max(clock.holds) == min(clock.holds)
    assert clock.holds[0] >= 1.5 * 2 * 0.002  # covers the slow method's two calls per round


def test_round_medians_follow_each_rounds_calls():
    times = [1.0, 3.0, 2.0, 10.0, 20.0, 5.0]
    assert harness.round_medians(times, {0: 2, 1: 2, 2: 5, 3: 6}, 5) == [2.0, None, 10.0, 5.0, None]


def test_interleaved_results_carry_one_median_per_round():
    times = harness.measure_times_interleaved({"a": lambda i: None, "b": lambda i: None}, 1, harness.WallClock(),
                                              min_reps=12, max_reps=12, min_rounds=4)
    for stats in times.values():
        assert len(stats["round_medians"]) == 4 and all(m is not None and m >= 0 for m in stats["round_medians"])


def test_paired_speedup_compares_within_rounds():
    # The peer is 10% slower in every round, while both drift by 2x across rounds: the plain
    # ratio of medians would mix rounds, the paired one sees 1.1 each time.
    mine = {"round_medians": [1.0, 2.0, None, 1.5]}
    peer = {"round_medians": [1.1, 2.2, 3.0, 1.65]}
    paired = results.paired_speedup(mine, peer)
    assert paired["rounds"] == 3
    assert abs(paired["median"] - 1.1) < 1e-12 and abs(paired["min"] - 1.1) < 1e-12 and abs(paired["max"] - 1.1) < 1e-12
    assert results.paired_speedup({"median": 1.0}, peer) is None


def test_interleaved_method_that_fails_midway_is_reported_and_others_finish():
    state = {"calls": 0}

    def flaky(i):
        state["calls"] += 1
        if state["calls"] > 6:
            raise RuntimeError("CUDA error: out of memory")

    times = harness.measure_times_interleaved({"flaky": flaky, "fine": lambda i: None}, 1, harness.WallClock(),
                                              min_reps=10, max_reps=10)
    assert isinstance(times["flaky"], RuntimeError) and harness.classify_error(times["flaky"]) == "oom"
    assert times["fine"]["reps"] == 10


# ----------------------------------------------------------------------------- failures


def _raise(exc):
    def fn(*args, **kwargs):
        raise exc

    return fn


def test_oom_and_errors_are_recorded_not_raised():
    assert harness.guarded(_raise(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")))["status"] == "oom"
    assert harness.guarded(_raise(RuntimeError("CUDA error: out of memory")))["status"] == "oom"
    assert harness.guarded(_raise(NotImplementedError("no bwd")))["status"].startswith("unsupported: ")
    status = harness.guarded(_raise(ValueError("bad head dim")))["status"]
    assert status.startswith("error: ValueError: bad head dim")
    assert harness.guarded(lambda: {"x": 1}) == {"x": 1, "status": "ok"}


def _fake_methods():
    def oom(q, k, v, causal, scale):
        raise torch.cuda.OutOfMemoryError("stand-in for a real CUDA OOM")

    def forward_only(q, k, v, causal, scale):
        return standard_attention(q, k, v, causal, scale).detach()

    return [
        Method("ours", "ours", "stand-in: forward only, like ours before its backward lands", forward_only),
        Method("standard", "reference", "plain torch", standard_attention),
        Method("oomer", "peer", "always out of memory", oom),
    ]


def test_measure_cell_end_to_end_on_cpu():
    cell = Cell(1, 64, 64, 2, 1, 16, True, ("fwd", "bwd", "fwdbwd"))
    progress = bench.Progress(3 * 3, stream=io.StringIO())
    rows = bench.measure_cell(cell, "unit", "bf16", _fake_methods(), harness.WallClock(), 50 * 2**20,
                              progress, target_s=0.0, device="cpu")
    status = {(r["pass"], r["method"]): r["status"] for r in rows}
    assert status[("fwd", "ours")] == "ok" and status[("fwd", "standard")] == "ok"
    assert all(status[(p, "oomer")] == "oom" for p in ("fwd", "bwd", "fwdbwd"))
    assert status[("bwd", "ours")].startswith("unsupported")
    assert status[("bwd", "standard")] == "ok" and status[("fwdbwd", "standard")] == "ok"
    ok = next(r for r in rows if r["pass"] == "bwd" and r["method"] == "standard")
    assert ok["tflops"] == pytest.approx(attention_flops(cell, "bwd") / (ok["time_ms"]["median"] * 1e-3) / 1e12)
    assert ok["tokens_per_s"] > 0 and ok["time_ms"]["reps"] >= 10
    assert progress.done == 9

    ratios = results.compute_ratios(rows)
    fwd_std = next(r for r in ratios if r["pass"] == "fwd" and r["peer"] == "standard")
    assert fwd_std["speedup"] > 0
    bwd_std = next(r for r in ratios if r["pass"] == "bwd" and r["peer"] == "standard")
    assert bwd_std["speedup"] is None and bwd_std["note"].startswith("ours: unsupported")
    assert next(r for r in ratios if r["pass"] == "fwd" and r["peer"] == "oomer")["note"] == "peer: oom"


def test_min_rounds_reaches_the_interleaved_timing():
    cell = Cell(1, 32, 32, 1, 1, 16, False, ("fwd",))
    methods = _fake_methods()[:2]  # two methods: designs of two orders
    for argv, rounds in (([], 10), (["--min-rounds", "13"], 14)):
        args = bench.parse_args(["--suite", "paper", *argv])
        rows = bench.measure_cell(cell, "unit", "bf16", methods, harness.WallClock(), 50 * 2**20,
                                  bench.Progress(2, stream=io.StringIO()), target_s=0.0, device="cpu",
                                  min_rounds=args.min_rounds)
        assert [len(r["time_ms"]["round_medians"]) for r in rows] == [rounds, rounds]


def test_standard_attention_matches_sdpa_on_cpu():
    torch.manual_seed(0)
    q = torch.randn(2, 33, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2))
    out = standard_attention(q, k, v, False, 16 ** -0.5)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)  # its softmax runs in fp32


def test_standard_attention_causal_is_bottom_right_aligned():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 1, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
    out = standard_attention(q, k, v, True, 1.0)
    for i in range(3):  # row i sees keys 0 .. i + 2
        p = torch.softmax(q[0, i, 0] @ k[0, : i + 3, 0].T, dim=-1)
        assert torch.allclose(out[0, i, 0], p @ v[0, : i + 3, 0], atol=1e-5)


def test_method_registry_lists_every_method_and_why_unavailable():
    methods = {m.name: m for m in discover_methods()}
    assert set(methods) == {"ours", "ours_sm80", "standard", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4",
                            "flex"}
    for m in methods.values():
        assert m.available or m.note.startswith("unavailable")
    with pytest.raises(ValueError):
        discover_methods(["nope"])


# ----------------------------------------------------------------------------- ratios


def _row(method, median=None, status="ok", kind="speed", peak=None, seqlen=1024):
    r = {"suite": "s", "dtype": "bf16", "pass": "fwd", "batch": 1, "seqlen_q": seqlen, "seqlen_k": seqlen,
         "nheads": 8, "nheads_kv": 8, "headdim": 64, "causal": False, "kind": kind, "method": method, "status": status}
    if median is not None:
        r["time_ms"] = {"median": median}
    if peak is not None:
        r["peak_bytes"] = peak
    return r


def test_ratios_are_peer_time_over_ours():
    ratios = results.compute_ratios([_row("ours", 1.0), _row("fa4", 1.5), _row("standard", 4.0)])
    assert {r["peer"]: r["speedup"] for r in ratios} == {"fa4": 1.5, "standard": 4.0}
    assert all("paired" not in r for r in ratios)  # no per-round medians, no paired ratio
    rows = [_row("ours", 1.0), _row("fa4", 1.1)]
    rows[0]["time_ms"]["round_medians"], rows[1]["time_ms"]["round_medians"] = [1.0, 0.5], [0.9, 0.6]
    (ratio,) = results.compute_ratios(rows)
    assert ratio["paired"]["rounds"] == 2 and abs(ratio["paired"]["median"] - 1.05) < 1e-12


def test_modified_cells_pair_with_their_own_peers_and_rows():
    """A softcap cell and the plain cell of the same shape are two cells: in the ratios, in the
    summary table and in the dashboard's panels."""
    from cute_flash.perf import dashboard

    rows = [_row("ours", 1.0), _row("fa4", 2.0), _row("ours", 3.0), _row("fa4", 3.0)]
    for r in rows[2:]:
        r["softcap"] = 50.0
        r["tflops"] = 1.0
    for r in rows[:2]:
        r["tflops"] = 2.0
    ratios = results.compute_ratios(rows)
    assert sorted((r.get("softcap", 0.0), r["speedup"]) for r in ratios) == [(0.0, 2.0), (50.0, 1.0)]
    table = bench.summary_table(rows).splitlines()
    assert len(table) == 3 and "softcap 50" in table[2] and "softcap" not in table[1]
    assert len(dashboard._panels(ratios)) == 2
    assert results.mods_label(rows[2]) == "softcap 50" and results.mods_label(rows[0]) == ""


def test_memory_ratios_and_oom_point():
    rows = [_row("ours", kind="memory", peak=100, seqlen=n) for n in (1024, 4096)]
    rows += [_row("standard", kind="memory", peak=400, seqlen=1024), _row("standard", kind="memory", status="oom", seqlen=4096)]
    ratios = results.compute_ratios(rows)
    assert [r["memory_ratio"] for r in ratios] == [4.0, None]
    assert results.memory_oom_points(rows) == {"s/fwd/standard": 4096}


# ----------------------------------------------------------------------------- schema


def fake_doc() -> dict:
    """A clearly fake result document (gpu name FAKE-TEST-GPU) for round-trip and plot tests."""
    rows = []
    for seqlen in (512, 1024, 2048):
        for causal in (False, True):
            for pass_ in ("fwd", "bwd"):
                for method, tf in (("ours", 300.0), ("sdpa_flash", 200.0), ("standard", 50.0)):
                    r = _row(method, 1.0, seqlen=seqlen)
                    r.update(suite="fake", causal=causal, **{"pass": pass_})
                    r["tflops"] = tf * seqlen / 2048
                    r["tokens_per_s"] = 1e6
                    t = 100 / r["tflops"]
                    r["time_ms"] = {"median": t, "p10": 0.9 * t, "p90": 1.1 * t, "iqr": 0.1 * t, "min": 0.9 * t, "max": 1.2 * t, "reps": 10}
                    rows.append(r)
    for n in (1024, 4096, 16384):
        for method, peak in (("ours", n * 1000), ("standard", n * n * 10)):
            r = _row(method, kind="memory", peak=peak, seqlen=n)
            r["suite"] = "fake"
            if method == "standard" and n == 16384:
                r = {**r, "status": "oom"}
                del r["peak_bytes"]
            rows.append(r)
    return {
        "schema": results.SCHEMA, "suites": ["fake"], "dtype": "bf16", "created_utc": "2026-01-01T00:00:00+00:00",
        "git": {"commit": "fake000", "dirty": False},
        "gpu": {"name": "FAKE-TEST-GPU", "arch": "sm90", "sm_count": 132, "capability": [9, 0],
                "memory_bytes": 80 * 2**30, "l2_bytes": 50 * 2**20},
        "environment": {"fake": True, "torch": "0", "python": "3"}, "versions": {},
        "methods": {"ours": {"kind": "ours", "available": True, "note": ""},
                    "fa4": {"kind": "peer", "available": False, "note": "unavailable: fake"}},
        "roofline": {"gemm": {"status": "ok", "tflops": 700.0}, "copy": {"status": "ok", "gb_per_s": 3000.0}},
        "overhead": {"methods": {"ours": {"status": "ok", "host_us_per_call": 12.0, "device_us_per_call": 5.0, "meets_goal": True}}},
        "suite_notes": {}, "measurements": rows, "ratios": results.compute_ratios(rows),
    }


def test_json_round_trip_and_file_name(tmp_path):
    doc = fake_doc()
    path = results.write(doc, tmp_path)
    assert path.name == "sm90-fake-test-gpu-20260101-fake000.json"
    back = results.load(path)
    back.pop("_path")
    assert back == json.loads(json.dumps(doc))
    assert results.write(doc, tmp_path).name.endswith("-2.json")


def test_compressed_result_files_load_like_plain_ones(tmp_path):
    import gzip

    plain = results.write(fake_doc(), tmp_path)
    packed = plain.with_name(plain.name + ".gz")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    docs, skipped = results.load_dir(tmp_path)
    assert skipped == [] and len(docs) == 1 and docs[0]["_path"] == str(packed)
    assert docs[0]["measurements"] == fake_doc()["measurements"]


def test_result_files_in_an_archive_load_beside_loose_ones(tmp_path):
    import gzip
    import tarfile

    loose = results.write(fake_doc(), tmp_path)
    packed_dir = tmp_path / "packed"
    packed_dir.mkdir()
    first = results.write(fake_doc(), packed_dir)
    second = first.with_name("second.json.gz")
    second.write_bytes(gzip.compress(first.read_bytes()))
    (packed_dir / "notes.txt").write_text("not a result")
    (packed_dir / "broken.json").write_text("{}")
    with tarfile.open(tmp_path / "archive-old.tar.xz", "w:xz") as tar:
        for path in sorted(packed_dir.iterdir()):
            tar.add(path, arcname=path.name)
    for path in packed_dir.iterdir():
        path.unlink()
    packed_dir.rmdir()
    docs, skipped = results.load_dir(tmp_path)
    assert [Path(d["_path"]).name for d in docs] == [loose.name, "second.json.gz", first.name]
    assert docs[2]["_path"] == str(tmp_path / "archive-old.tar.xz" / first.name)
    assert all(d["measurements"] == fake_doc()["measurements"] for d in docs)
    assert skipped and skipped[0].startswith("archive-old.tar.xz/broken.json")


def test_schema_rejects_incomplete_documents(tmp_path):
    doc = fake_doc()
    del doc["roofline"]
    with pytest.raises(ValueError):
        results.validate(doc)
    doc = fake_doc()
    del doc["measurements"][0]["time_ms"]
    with pytest.raises(ValueError):
        results.validate(doc)
    (tmp_path / "junk.json").write_text("{}")
    docs, skipped = results.load_dir(tmp_path)
    assert docs == [] and skipped and skipped[0].startswith("junk.json")


def test_filters_split_a_long_suite():
    args = bench.parse_args(["--suite", "paper", "--headdims", "128", "--seqlens", "512,1024", "--passes", "fwd", "--causal", "no"])
    cells = bench.select_cells(get_suite("paper").cells, args)
    assert [(c.headdim, c.seqlen_q, c.causal, c.passes) for c in cells] == [(128, 512, False, ("fwd",)), (128, 1024, False, ("fwd",))]
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "paper", "--passes", "sideways"])


def test_whole_run_on_cpu_writes_one_valid_file(tmp_path, monkeypatch, capsys):
    """bench.main end to end with the device pointed at the CPU, fake methods and a fake GPU
    description; the file goes to tmp_path only."""
    from cute_flash.perf import suites

    tiny = suites.Suite("tiny", "test only", "bf16", [
        Cell(1, 32, 32, 2, 2, 16, False, ("fwd", "bwd")),
        Cell(1, 64, 64, 2, 2, 16, False, ("fwd",), kind="memory"),
    ], overhead=True)
    monkeypatch.setitem(suites.SUITES, "tiny", lambda: tiny)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "OVERHEAD_CALLS", 20)
    monkeypatch.setattr(bench, "discover_methods", lambda only=None: _fake_methods())
    monkeypatch.setattr(results, "gpu_info", lambda device=0: {
        "name": "FAKE-TEST-GPU", "arch": "sm00", "capability": [0, 0], "sm_count": 1, "memory_bytes": 0, "l2_bytes": 2**20})
    assert bench.main(["--suite", "tiny,decode", "--out", str(tmp_path), "--no-roofline", "--target-s", "0"]) == 0
    [path] = tmp_path.glob("*.json")
    assert path.name.startswith("sm00-fake-test-gpu-")
    doc = results.load(path)
    assert doc["suites"] == ["tiny", "decode"] and "KV-cache" in doc["suite_notes"]["decode"]
    assert len(doc["measurements"]) == 3 * 3
    assert doc["overhead"]["methods"]["ours"]["status"] == "ok"
    assert doc["roofline"] is None and doc["complete"] is True
    out = capsys.readouterr()
    assert "wrote" in out.out and "[" in out.err  # summary on stdout, progress on stderr


def test_fp32_suite_and_errors_vs_float64_on_cpu():
    """The fp32 suite's cells and peers, and each method's error beside its timing: exact for the
    plain-torch method on fp32 inputs (float64 stand-in reference), absent without `accuracy`."""
    suite = get_suite("fp32")
    assert suite.dtype == "fp32" and suite.accuracy
    assert {(c.batch, c.seqlen_q, c.nheads, c.headdim, c.causal) for c in suite.cells} == {
        (4, 4096, 16, d, c) for d in (64, 128) for c in (False, True)}
    assert all(c.passes == ("fwd", "bwd") for c in suite.cells)
    assert set(suite.methods) == {"ours", "standard", "sdpa_math", "sdpa_efficient"}

    cell = Cell(2, 48, 48, 2, 2, 16, True, ("fwd", "bwd"))
    methods = [Method("standard", "reference", "plain torch", standard_attention)]
    rows = bench.measure_cell(cell, "unit", "fp32", methods, harness.WallClock(), 50 * 2**20,
                              bench.Progress(2, stream=io.StringIO()), target_s=0.0, device="cpu", accuracy=True)
    assert [r["pass"] for r in rows] == ["fwd", "bwd"] and all(r["status"] == "ok" for r in rows)
    assert all(0 <= r["max_error"] < 1e-5 for r in rows)
    rows = bench.measure_cell(cell, "unit", "fp32", methods, harness.WallClock(), 50 * 2**20,
                              bench.Progress(2, stream=io.StringIO()), target_s=0.0, device="cpu")
    assert all("max_error" not in r for r in rows)


def test_mods_suite_counts_flops_on_the_visible_band():
    """The sliding-window cell's FLOPs are those of the band it computes; plain cells keep their
    keys and FLOPs; methods without score modifications record "unsupported"."""
    from cute_flash.perf import harness
    from cute_flash.perf.methods import plain_only, standard_attention

    suite = get_suite("mods")
    window = next(c for c in suite.cells if tuple(c.window) != (-1, -1))
    assert window.causal and window.window == (1024, 0) and window.seqlen_q == 16384
    band = sum(min(i, 1024) + 1 for i in range(16384))
    assert attention_flops(window, "fwd") == 4.0 * window.nheads * band * window.headdim
    assert attention_flops(window, "bwd") == 2.5 * attention_flops(window, "fwd")
    dense = Cell(1, 16384, 16384, 16, 16, 128, True, ("fwd", "bwd"))
    assert dense in suite.cells and "window" not in dense.key() and "softcap" not in dense.key()
    capped = [c for c in suite.cells if c.softcap]
    assert capped and all(c.mods() == {"softcap": 50.0} for c in capped)
    assert all(c.key() | {"softcap": 50.0} == c.key() for c in capped)
    q = torch.randn(1, 3, 1, 8)
    with pytest.raises(NotImplementedError) as info:
        plain_only(standard_attention)(q, q, q, False, 1.0, softcap=50.0)
    assert harness.classify_error(info.value).startswith("unsupported")


@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwdbwd"])
def test_runner_holds_the_method_scope_around_the_backward_too(pass_):
    """A method's scope (ours_sm80: the forced kernel family) covers the gradient, which autograd
    dispatches after fn returned."""
    import contextlib

    held, seen = [], []

    @contextlib.contextmanager
    def scope():
        held.append(True)
        try:
            yield
        finally:
            held.pop()

    class Recorded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", bool(held)))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", bool(held)))
            return grad * 2

    def fn(q, k, v, causal, scale):
        return Recorded.apply(q) + k.sum() + v.sum()

    sets = [tuple(torch.randn(1, 4, 1, 8, requires_grad=pass_ != "fwd") for _ in range(3)) + (torch.randn(1, 4, 1, 8),)]
    bench.make_runner(fn, pass_, sets, False, 1.0, scope=scope)(0)
    assert seen and all(inside for _, inside in seen)
    assert ("backward", True) in seen or pass_ == "fwd"


def test_mods_suite_has_alibi_and_dropout_cells():
    cells = get_suite("mods").cells
    alibi = [c for c in cells if c.alibi]
    dropout = [c for c in cells if c.dropout_p]
    assert len(alibi) == len(dropout) == 4
    slopes = alibi[0].mods()["alibi_slopes"]
    assert slopes.dtype == torch.float32 and slopes.shape == (alibi[0].nheads,)
    assert slopes[0].item() == pytest.approx(2.0 ** (-8.0 / alibi[0].nheads)) and "alibi" in alibi[0].key()
    assert dropout[0].mods() == {"dropout_p": 0.1} and " dropout=0.1" in dropout[0].label()
    # each has a cell without the modification at the same shape beside it
    plain = {(c.batch, c.seqlen_q, c.headdim, c.causal) for c in cells if not c.mods()}
    assert all((c.batch, c.seqlen_q, c.headdim, c.causal) in plain for c in alibi + dropout)
    assert "alibi" not in cells[0].key() and "dropout_p" not in cells[0].key()
