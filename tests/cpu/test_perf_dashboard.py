"""Dashboard rendering from a small, clearly fake result file written to tmp_path."""

import pytest

pytest.importorskip("matplotlib")

from cute_flash.perf import dashboard, results  # noqa: E402

from .test_perf_harness import fake_doc  # noqa: E402


def test_dashboard_renders_pages_and_nonempty_pngs(tmp_path):
    results_dir, out = tmp_path / "results", tmp_path / "dash"
    results.write(fake_doc(), results_dir)
    assert dashboard.main(["--results", str(results_dir), "--out", str(out)]) == 0

    index = (out / "index.html").read_text()
    assert "sm90/index.html" in index and "FAKE-TEST-GPU" in index
    page = (out / "sm90" / "index.html").read_text()
    expected = ["tflops-fake-fwd.png", "tflops-fake-bwd.png", "ratio-fake-fwd.png", "ratio-fake-bwd.png",
                "memory-fake.png", "roofline-fake.png"]
    for name in expected:
        png = out / "sm90" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000, name
        assert name in page
    assert not (out / "sm90" / "tflops-fake-fwdbwd.png").exists()  # no fwd+bwd rows, no plot
    assert "oom" in page and "fa4: unavailable: fake" in page


def test_dashboard_lists_unreadable_files_and_empty_dirs(tmp_path):
    (tmp_path / "broken.json").write_text("{\"schema\": \"other\"}")
    assert dashboard.main(["--results", str(tmp_path), "--out", str(tmp_path / "d")]) == 0
    assert "broken.json" in (tmp_path / "d" / "index.html").read_text()
    assert dashboard.main(["--results", str(tmp_path / "missing"), "--out", str(tmp_path / "d")]) == 2


def test_runs_of_one_commit_are_merged_and_newer_rows_win(tmp_path):
    older, newer = fake_doc(), fake_doc()
    older["measurements"] = [m for m in older["measurements"] if m["pass"] == "fwd" or m["kind"] == "memory"]
    newer["measurements"] = [m for m in newer["measurements"] if m["pass"] == "bwd"]
    newer["created_utc"] = "2026-01-01T01:00:00+00:00"
    doc, rows, merged = dashboard.merge_suite([older, newer], "fake")
    assert merged == 2 and doc is newer
    assert {r["pass"] for r in rows} == {"fwd", "bwd"}
    other_commit = {**fake_doc(), "git": {"commit": "fake111", "dirty": False}, "created_utc": "2026-01-02T00:00:00+00:00"}
    doc, rows, merged = dashboard.merge_suite([older, newer, other_commit], "fake")
    assert merged == 1 and doc is other_commit


def test_a_single_problem_size_renders_as_bars(tmp_path):
    doc = fake_doc()
    doc["measurements"] = [m for m in doc["measurements"] if m["seqlen_q"] == 1024 and m["kind"] == "speed"]
    doc["ratios"] = results.compute_ratios(doc["measurements"])
    results.write(doc, tmp_path / "r")
    assert dashboard.main(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 0
    for name in ("tflops-fake-fwd.png", "ratio-fake-bwd.png"):
        assert (tmp_path / "d" / "sm90" / name).stat().st_size > 1000
    assert not (tmp_path / "d" / "sm90" / "memory-fake.png").exists()


def test_a_newer_run_in_another_dtype_does_not_hide_the_older_one():
    bf16 = fake_doc()
    fp16 = {**fake_doc(), "git": {"commit": "fake222", "dirty": False}, "created_utc": "2026-01-03T00:00:00+00:00"}
    fp16["measurements"] = [{**m, "dtype": "fp16"} for m in fp16["measurements"] if m["pass"] == "fwd"]
    doc, rows, merged = dashboard.merge_suite([bf16, fp16], "fake")
    assert merged == 2 and doc is fp16
    assert {r["dtype"] for r in rows} == {"bf16", "fp16"}
    assert {r["pass"] for r in rows if r["dtype"] == "bf16"} == {r["pass"] for r in bf16["measurements"]}


def test_ratio_plots_draw_the_paired_rounds_as_bars(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ratio(seqlen, paired):
        return {"kind": "speed", "pass": "fwd", "headdim": 64, "causal": False, "dtype": "bf16", "batch": 1,
                "nheads": 1, "seqlen_q": seqlen, "seqlen_k": seqlen, "peer": "fa4", "speedup": 1.02, "paired": paired}

    drawn = []
    real_errorbar = plt.Axes.errorbar
    plt.Axes.errorbar = lambda self, *a, **kw: drawn.append((a, kw)) or real_errorbar(self, *a, **kw)
    try:
        rows = [ratio(1024, {"median": 1.01, "min": 0.95, "max": 1.08, "rounds": 10}), ratio(2048, None),
                ratio(4096, {"median": 0.99, "min": 0.9, "max": 1.1, "rounds": 10})]
        assert dashboard.plot_ratios(plt, rows, "fake", "fwd", tmp_path / "r.png").stat().st_size > 1000
    finally:
        plt.Axes.errorbar = real_errorbar
    (xs, med), kw = drawn[0]
    assert list(xs) == [1024, 4096] and list(med) == [1.01, 0.99]  # the round without pairs is left out
    low, high = kw["yerr"]
    assert [round(v, 6) for v in low] == [0.06, 0.09] and [round(v, 6) for v in high] == [0.07, 0.11]
