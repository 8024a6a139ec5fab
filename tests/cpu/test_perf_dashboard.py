"""Dashboard rendering from small, clearly fake result files written to tmp_path."""

import tarfile

import pytest

pytest.importorskip("matplotlib")

from cute_flash.perf import dashboard, results  # noqa: E402

from .test_perf_harness import fake_doc  # noqa: E402

STEM = "fake-fake-test-gpu"  # suite and GPU in every image name


@pytest.fixture
def figures(monkeypatch):
    """The figures the dashboard saves, kept open for inspection."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = []
    real_save = dashboard._save

    def keep(fig, path):
        saved.append((path.name, fig.get_suptitle(), [ax for ax in fig.axes if ax.get_visible()]))
        return real_save(fig, path)

    monkeypatch.setattr(dashboard, "_save", keep)
    yield plt, saved


def test_dashboard_renders_pages_and_nonempty_pngs(tmp_path):
    results_dir, out = tmp_path / "results", tmp_path / "dash"
    results.write(fake_doc(), results_dir)
    assert dashboard.main(["--results", str(results_dir), "--out", str(out)]) == 0

    index = (out / "index.html").read_text()
    assert "sm90/index.html" in index and "FAKE-TEST-GPU" in index
    page = (out / "sm90" / "index.html").read_text()
    expected = [f"tflops-{STEM}-fwd.png", f"tflops-{STEM}-bwd.png", f"ratio-{STEM}-fwd.png",
                f"ratio-{STEM}-bwd.png", f"memory-{STEM}.png", f"roofline-{STEM}.png"]
    for name in expected:
        png = out / "sm90" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000, name
        assert name in page
    assert not (out / "sm90" / f"tflops-{STEM}-fwdbwd.png").exists()  # no fwd+bwd rows, no plot
    assert "oom" in page and "FlashAttention-4: unavailable: fake" in page
    # ours is cute-flash wherever a reader sees it
    assert "<th>cute-flash</th>" in page and "<th>ours</th>" not in page


def test_every_image_names_the_gpu_the_commit_and_the_date(tmp_path, figures):
    plt, saved = figures
    results.write(fake_doc(), tmp_path / "r")
    assert dashboard.main(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 0
    assert len(saved) == 6
    for name, title, axes in saved:
        assert "FAKE-TEST-GPU" in title and "cute-flash at commit fake000, 2026-01-01" in title, name
        legends = [t.get_text() for ax in axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert not any("ours" in text for text in legends), (name, legends)
    ratio_titles = [title for name, title, _ in saved if name.startswith("ratio-")]
    assert all("speedup of cute-flash" in t for t in ratio_titles)


def test_speedups_sit_on_a_log_axis_clipped_to_the_window(tmp_path, figures):
    plt, saved = figures
    results.write(fake_doc(), tmp_path / "r")  # ours 6x over plain PyTorch, 1.5x over SDPA flash
    assert dashboard.main(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 0
    name, title, axes = next(s for s in saved if s[0] == f"ratio-{STEM}-fwd.png")
    low, high = dashboard.RATIO_WINDOW
    assert "log axis clipped to 0.5–2.0×" in title
    for ax in axes:
        assert ax.get_yscale() == "log"
        bottom, top = ax.get_ylim()
        assert low / 1.1 <= bottom < 1 < 1.5 < top <= high * 1.1
        assert "6.0×" in [t.get_text() for t in ax.texts]  # the clipped value, written out


def test_a_file_older_than_the_gpus_newest_run_is_marked(tmp_path, figures):
    plt, saved = figures
    old = fake_doc()
    newer = {**fake_doc(), "git": {"commit": "fake111", "dirty": False}, "created_utc": "2026-01-02T00:00:00+00:00"}
    newer["measurements"] = [m for m in newer["measurements"] if m["pass"] == "fwd"]
    results.write(old, tmp_path / "r")
    results.write(newer, tmp_path / "r")
    assert dashboard.main(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 0
    titles = dict((name, title) for name, title, _ in saved)
    assert "fake111, 2026-01-02" in titles[f"tflops-{STEM}-fwd.png"] and "older" not in titles[f"tflops-{STEM}-fwd.png"]
    assert "fake000, 2026-01-01 (older than this GPU's newest run, fake111)" in titles[f"tflops-{STEM}-bwd.png"]
    page = (tmp_path / "d" / "sm90" / "index.html").read_text()
    assert "<b>older</b>" in page and "current" in page
    # both files serve a current result, so neither is listed as superseded
    assert "superseded" not in page


def test_archive_members_that_are_not_results_are_counted_not_listed(tmp_path):
    (tmp_path / "broken.json").write_text("{\"schema\": \"other\"}")
    variants = tmp_path / "variants-log.json"
    variants.write_text("{\"runs\": []}")
    with tarfile.open(tmp_path / "archive-old.tar.xz", "w:xz") as tar:
        tar.add(variants, arcname=variants.name)
    variants.unlink()
    assert dashboard.main(["--results", str(tmp_path), "--out", str(tmp_path / "d")]) == 0
    index = (tmp_path / "d" / "index.html").read_text()
    assert "broken.json" in index and "variants-log.json" not in index
    assert "1 other files in the archives are not benchmark results" in index


def test_a_missing_results_directory_is_one_line_with_exit_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert dashboard.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cute-flash dashboard: error: no directory perf/results under" in err
    assert str(tmp_path) in err and "cute-flash bench" in err


def test_results_and_pages_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    from cute_flash.perf import bench

    assert not dashboard.DEFAULT_RESULTS.is_absolute() and not bench.DEFAULT_OUT.is_absolute()
    assert bench.parse_args(["--suite", "quick"]).out == dashboard.DEFAULT_RESULTS
    monkeypatch.chdir(tmp_path)
    results.write(fake_doc(), tmp_path / "perf" / "results")
    assert dashboard.main([]) == 0
    assert (tmp_path / "build" / "dashboard" / "sm90" / "index.html").exists()


def test_runs_of_one_commit_are_merged_and_newer_rows_win():
    older, newer = fake_doc(), fake_doc()
    older["measurements"] = [m for m in older["measurements"] if m["pass"] == "fwd" or m["kind"] == "memory"]
    newer["measurements"] = [m for m in newer["measurements"] if m["pass"] == "bwd"]
    newer["created_utc"] = "2026-01-01T01:00:00+00:00"
    result = dashboard.current_result([older, newer], "fake")
    assert result.runs == [older, newer]
    assert {r["pass"] for r in result.rows} == {"fwd", "bwd"}
    other_commit = {**fake_doc(), "git": {"commit": "fake111", "dirty": False}, "created_utc": "2026-01-02T00:00:00+00:00"}
    result = dashboard.current_result([older, newer, other_commit], "fake")
    assert result.runs == [other_commit]


def test_a_newer_forward_run_does_not_hide_the_last_backward_one():
    both = fake_doc()
    forward = {**fake_doc(), "git": {"commit": "fake2222222aaaa", "dirty": False}, "created_utc": "2026-01-03T00:00:00+00:00"}
    forward["measurements"] = [m for m in forward["measurements"] if m["pass"] == "fwd" and m["kind"] == "speed"]
    result = dashboard.current_result([both, forward], "fake")
    assert result.origins[("bf16", "fwd")] is forward and result.origins[("bf16", "bwd")] is both
    assert {r["pass"] for r in result.rows if r["kind"] == "speed"} == {"fwd", "bwd"}
    assert all(r in forward["measurements"] for r in result.rows if r["pass"] == "fwd" and r["kind"] == "speed")
    assert dashboard.short_commit(forward) == "fake222"  # full hashes are shown short


def test_a_newer_run_in_another_dtype_does_not_hide_the_older_one():
    bf16 = fake_doc()
    fp16 = {**fake_doc(), "git": {"commit": "fake222", "dirty": False}, "created_utc": "2026-01-03T00:00:00+00:00"}
    fp16["measurements"] = [{**m, "dtype": "fp16"} for m in fp16["measurements"] if m["pass"] == "fwd"]
    result = dashboard.current_result([bf16, fp16], "fake")
    assert result.runs == [bf16, fp16]
    assert {r["dtype"] for r in result.rows} == {"bf16", "fp16"}
    assert {r["pass"] for r in result.rows if r["dtype"] == "bf16"} == {r["pass"] for r in bf16["measurements"]}
    assert "fake000, 2026-01-01 (bf16); fake222, 2026-01-03 (fp16)" in result.provenance(
        [r for r in result.rows if r["pass"] == "fwd"], fp16)


def test_a_single_problem_size_renders_as_bars_from_1_on_the_log_axis(tmp_path, figures):
    plt, saved = figures
    doc = fake_doc()
    doc["measurements"] = [m for m in doc["measurements"] if m["seqlen_q"] == 1024 and m["kind"] == "speed"]
    doc["ratios"] = results.compute_ratios(doc["measurements"])
    results.write(doc, tmp_path / "r")
    assert dashboard.main(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "d")]) == 0
    for name in (f"tflops-{STEM}-fwd.png", f"ratio-{STEM}-bwd.png"):
        assert (tmp_path / "d" / "sm90" / name).stat().st_size > 1000
    assert not (tmp_path / "d" / "sm90" / f"memory-{STEM}.png").exists()
    _, _, (ax, *_) = next(s for s in saved if s[0] == f"ratio-{STEM}-fwd.png")
    assert ax.get_yscale() == "log"
    assert sorted(round(p.get_y() + p.get_height(), 3) for p in ax.patches) == [1.5, 2.0]  # 6x clipped to 2
    assert sorted(t.get_text() for t in ax.texts) == ["1.50×", "6.00×"]


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
        assert dashboard.plot_ratios(plt, rows, "fake", "fwd", tmp_path / "r.png", "GPU").stat().st_size > 1000
    finally:
        plt.Axes.errorbar = real_errorbar
    (xs, med), kw = drawn[0]
    assert list(xs) == [1024, 4096] and list(med) == [1.01, 0.99]  # the round without pairs is left out
    low, high = kw["yerr"]
    assert [round(v, 6) for v in low] == [0.06, 0.09] and [round(v, 6) for v in high] == [0.07, 0.11]
