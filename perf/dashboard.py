"""`cute-flash dashboard`: render benchmark result files into static pages, one per GPU architecture.

    <out>/index.html            every architecture and GPU with its runs
    <out>/<arch>/index.html     per GPU and suite, the current result: plots and a table of cells
    <out>/<arch>/*.png          TFLOP/s vs seqlen, speedup vs each peer, memory vs N, roofline

The current result of a suite on a GPU is, per dtype and pass, the newest run that measured it,
merged with the other runs of that commit (a long suite split by filters; later rows win). A
result measured at an older commit than the GPU's newest run is marked as such, and runs that
no current result uses are listed as superseded.

Result files are read from perf/results and pages written to build/dashboard, both relative to
the current directory (so from a checkout's root: its results archive, and a git-ignored output).
"""

from __future__ import annotations

import html
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from cute_flash.cli import ArgumentParser

from . import results
from .suites import Cell, attention_flops, attention_min_bytes

DEFAULT_RESULTS = Path("perf/results")
DEFAULT_OUT = Path("build/dashboard")
METHOD_STYLE = {  # fixed colours so a method looks the same in every plot
    "ours": ("tab:red", "o"), "ours_sm80": ("tab:pink", "o"), "fa4": ("tab:purple", "s"), "sdpa_flash": ("tab:blue", "^"),
    "sdpa_cudnn": ("tab:green", "v"), "sdpa_efficient": ("tab:orange", "D"),
    "sdpa_math": ("tab:brown", "x"), "standard": ("tab:gray", "+"), "flex": ("tab:cyan", "P"),
}
METHOD_LABELS = {  # what a reader of the pages knows the methods as
    "ours": "cute-flash", "ours_sm80": "cute-flash, sm80 kernels", "fa4": "FlashAttention-4",
    "sdpa_flash": "SDPA flash (FA2)", "sdpa_cudnn": "SDPA cuDNN", "sdpa_efficient": "SDPA mem-efficient",
    "sdpa_math": "SDPA math", "standard": "plain PyTorch", "flex": "flex_attention",
}
PASS_MARKER = {"fwd": "o", "bwd": "^", "fwdbwd": "s"}  # roofline: colour is the method, shape the pass
PASS_TITLE = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
ELEM_BYTES = {"bf16": 2, "fp16": 2}
# Speedups are drawn on a log axis (2x faster and 2x slower sit equally far from 1) clipped to
# this window: a value beyond it is drawn at the edge and written out, so a 35x lead over plain
# PyTorch does not flatten the few percent that separate the fast kernels.
RATIO_WINDOW = (0.5, 2.0)


class MissingMatplotlib(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib("cute-flash dashboard needs matplotlib: pip install matplotlib "
                                "(or pip install 'cute-flash[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


def _style(method: str):
    return METHOD_STYLE.get(method, ("black", "."))


def _cell(m: dict) -> Cell:
    return Cell(m["batch"], m["seqlen_q"], m["seqlen_k"], m["nheads"], m["nheads_kv"], m["headdim"], m["causal"])


def short_commit(doc: dict) -> str:
    """The commit a run measured, abbreviated (runs record seven characters or all forty)."""
    return doc["git"]["commit"][:7] + ("+dirty" if doc["git"].get("dirty") else "")


def run_date(doc: dict) -> str:
    return doc["created_utc"][:10]


# ----------------------------------------------------------------------------- current results


@dataclass
class SuiteResult:
    """The current result of one suite on one GPU."""

    rows: list[dict]  # one measurement per cell, pass and method
    runs: list[dict]  # the result files the rows come from, oldest first
    origins: dict[tuple[str, str], dict]  # (dtype, pass) -> the newest run that measured it

    def provenance(self, rows: list[dict], newest: dict) -> str:
        """Commit and date of the runs behind `rows`, per dtype where they differ, and whether
        they are older than `newest`, the GPU's newest run."""
        dtypes_by_run: dict[str, list[str]] = {}
        for dtype, pass_ in dict.fromkeys((r["dtype"], r["pass"]) for r in rows):
            doc = self.origins[(dtype, pass_)]
            dtypes = dtypes_by_run.setdefault(f"{short_commit(doc)}, {run_date(doc)}", [])
            if dtype not in dtypes:
                dtypes.append(dtype)
        if len(dtypes_by_run) == 1:
            text = f"cute-flash at commit {next(iter(dtypes_by_run))}"
        else:
            text = "cute-flash at commit " + "; ".join(f"{run} ({', '.join(dtypes)})" for run, dtypes in dtypes_by_run.items())
        if any(self.origins[(r["dtype"], r["pass"])]["git"]["commit"][:7] != newest["git"]["commit"][:7] for r in rows):
            text += f" (older than this GPU's newest run, {short_commit(newest)})"
        return text


def _in_slice(m: dict, suite: str, dtype: str, pass_: str) -> bool:
    return m["suite"] == suite and m["dtype"] == dtype and m["pass"] == pass_


def current_result(docs: list[dict], suite: str) -> SuiteResult:
    """`suite`'s current result among one GPU's runs (`docs`, oldest first): per dtype and pass
    the newest run that measured it, merged with the other runs of that commit, later rows
    replacing earlier. So a newer forward-only run does not hide the last backward one."""
    having = [d for d in docs if suite in d["suites"]]
    slices = dict.fromkeys((m["dtype"], m["pass"]) for d in having for m in d["measurements"] if m["suite"] == suite)
    rows: dict[tuple, dict] = {}
    used: dict[int, dict] = {}
    origins = {}
    for dtype, pass_ in slices:
        measured = [d for d in having if any(_in_slice(m, suite, dtype, pass_) for m in d["measurements"])]
        origins[(dtype, pass_)] = newest = measured[-1]
        for d in measured:
            if d["git"]["commit"][:7] != newest["git"]["commit"][:7]:
                continue
            used[id(d)] = d
            for m in d["measurements"]:
                if _in_slice(m, suite, dtype, pass_):
                    rows[results.cell_group_key(m) + (m["method"],)] = m
    runs = sorted(used.values(), key=lambda d: d["created_utc"]) or having[-1:]
    return SuiteResult(list(rows.values()), runs, origins)


# ----------------------------------------------------------------------------- plots


def _x_axis(rows: list[dict]) -> str:
    """Plot against seqlen when it varies in the group, else against batch."""
    return "seqlen_q" if len({r["seqlen_q"] for r in rows}) > 1 else "batch"


def _cell_text(r: dict) -> str:
    return f"B={r['batch']} S={r['seqlen_q']} H={r['nheads']}"


def _clip(ratio: float) -> float:
    return min(max(ratio, RATIO_WINDOW[0]), RATIO_WINDOW[1])


def _ratio_axis(ax, ratios: list[float]) -> None:
    """A log y axis around 1 just wide enough for the (clipped) ratios, with plain-number ticks."""
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

    shown = [_clip(v) for v in ratios] + [1.0]
    ax.set_yscale("log")
    ax.set_ylim(min(shown) / 1.06, max(shown) * 1.06)
    ax.axhline(1.0, color="black", lw=0.8)
    # The log axis's own ticks are powers of ten, none of them inside a window around 1.
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _write_clipped(ax, points: list[tuple[float, float]], color) -> bool:
    """Mark the ratios outside RATIO_WINDOW at the window's edge with their value; True if any."""
    clipped = [(x, v) for x, v in points if _clip(v) != v]
    for x, v in clipped:
        ax.scatter([x], [_clip(v)], marker="^" if v > 1 else "v", color=color, s=40, zorder=3)
        ax.annotate(f"{v:.1f}×", (x, _clip(v)), textcoords="offset points", xytext=(4, -10 if v > 1 else 4),
                    fontsize=7, color=color)
    return bool(clipped)


def _bars(ax, values: dict[str, float], ylabel: str, title: str, ratio: bool) -> bool:
    """A panel with one problem size: a bar per method (speedups: from 1, on the clipped log
    axis), labelled with its value. True if a speedup was clipped."""
    names = list(values)
    colors = [_style(n)[0] for n in names]
    if ratio:
        bars = ax.bar(range(len(names)), [_clip(values[n]) - 1 for n in names], bottom=1.0, color=colors)
        ax.bar_label(bars, labels=[f"{values[n]:.2f}×" for n in names], fontsize=7)
        _ratio_axis(ax, list(values.values()))
    else:
        bars = ax.bar(range(len(names)), [values[n] for n in names], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(names)), [label(n) for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return ratio and any(_clip(v) != v for v in values.values())


def _grid(plt, panels: list, title: str):
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat)


def _save(fig, path: Path) -> Path:
    # Room above the panels for the figure title, about a fifth of an inch a line.
    lines = fig.get_suptitle().count("\n") + 1 if fig.get_suptitle() else 0
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.15 + 0.2 * lines) / fig.get_figheight()))
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _panels(rows: list[dict]) -> dict[tuple, list[dict]]:
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["headdim"], r["causal"], r["dtype"], results.mods_label(r)), []).append(r)
    return dict(sorted(panels.items()))


def _panel_title(key: tuple) -> str:
    headdim, causal, dtype, mods = key
    return f"hdim {headdim}, {'causal' if causal else 'non-causal'}, {dtype}{', ' + mods if mods else ''}"


def _plot_over_length(plt, panels: dict, title: str, path: Path, series: str, value: str,
                      ylabel: str, ratio: bool) -> Path:
    """One panel per (head dim, causal, dtype) with a line per `series` (method or peer) of
    `value` over the sequence length, or bars when the panel holds one length. `ratio` panels
    get the clipped log axis, and the title says when a value went past it."""
    fig, axes = _grid(plt, list(panels), title)
    clipped = False
    for ax, (key, group) in zip(axes, panels.items()):
        group = [r for r in group if r[value]]  # failed cells carry no value
        xkey = _x_axis(group)
        if len({r[xkey] for r in group}) == 1:
            clipped |= _bars(ax, {r[series]: r[value] for r in group}, ylabel,
                             f"{_panel_title(key)}, {_cell_text(group[0])}", ratio)
            continue
        for name in dict.fromkeys(r[series] for r in group):
            pts = sorted((r[xkey], r[value]) for r in group if r[series] == name)
            color, marker = _style(name)
            xs, ys = zip(*pts)
            ax.plot(xs, [_clip(y) for y in ys] if ratio else ys, marker=marker, color=color,
                    label=f"vs {label(name)}" if ratio else label(name))
            if ratio:
                _paired_range(ax, [r for r in group if r[series] == name], xkey, color)
                clipped |= _write_clipped(ax, pts, color)
        ax.set_xscale("log", base=2)
        if ratio:
            _ratio_axis(ax, [r[value] for r in group])
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(xkey.replace("_q", ""))
        ax.set_ylabel(ylabel)
        ax.set_title(_panel_title(key), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if clipped:
        fig.suptitle(f"{title}\nlog axis clipped to {RATIO_WINDOW[0]}–{RATIO_WINDOW[1]}×: "
                     "values beyond it are drawn at the edge and written out")
    return _save(fig, path)


def _paired_range(ax, rows: list[dict], xkey: str, color) -> None:
    """The paired speedup (results.paired_speedup: peer / ours within each round) as its median
    with a bar over the rounds' min-max, beside the ratio of medians: how far the ratio can be
    trusted."""
    paired = sorted(((r[xkey], r["paired"]) for r in rows if r.get("paired")), key=lambda xp: xp[0])
    if not paired:
        return
    xs = [x for x, _ in paired]
    med = [_clip(p["median"]) for _, p in paired]
    spread = [[m - _clip(p["min"]) for m, (_, p) in zip(med, paired)],
              [_clip(p["max"]) - m for m, (_, p) in zip(med, paired)]]
    ax.errorbar(xs, med, yerr=spread, fmt="_", color=color, alpha=0.5, capsize=2, lw=1)


def plot_tflops(plt, rows: list[dict], suite: str, pass_: str, path: Path, caption: str) -> Path | None:
    ok = [r for r in rows if r["kind"] == "speed" and r["pass"] == pass_ and r["status"] == "ok"]
    panels = _panels(ok)
    if not panels:
        return None
    return _plot_over_length(plt, panels, f"{suite}: {PASS_TITLE[pass_]} TFLOP/s\n{caption}", path,
                             "method", "tflops", "TFLOP/s", ratio=False)


def plot_ratios(plt, ratios: list[dict], suite: str, pass_: str, path: Path, caption: str) -> Path | None:
    panels = _panels([r for r in ratios if r["kind"] == "speed" and r["pass"] == pass_])
    if not panels:
        return None
    title = (f"{suite}: {PASS_TITLE[pass_]} speedup of cute-flash over each peer (>1: cute-flash faster)\n"
             f"{caption}\nbars: median and min-max over rounds of the speedup within each round")
    return _plot_over_length(plt, panels, title, path, "peer", "speedup", "speedup of cute-flash", ratio=True)


def plot_memory(plt, rows: list[dict], suite: str, path: Path, caption: str) -> Path | None:
    mem = [r for r in rows if r["kind"] == "memory"]
    if not mem:
        return None
    passes = list(dict.fromkeys(r["pass"] for r in mem))
    fig, axes = _grid(plt, passes, f"{suite}: peak extra device memory vs N (x: out of memory)\n{caption}")
    for ax, pass_ in zip(axes, passes):
        group = [r for r in mem if r["pass"] == pass_]
        top = max([r.get("peak_bytes") or 1 for r in group if r["status"] == "ok"] or [1]) / 2**20 * 2
        for method in dict.fromkeys(r["method"] for r in group):
            color, marker = _style(method)
            pts = sorted((r["seqlen_q"], r["peak_bytes"] / 2**20) for r in group
                         if r["method"] == method and r["status"] == "ok" and r.get("peak_bytes"))
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, label=label(method))
            ooms = [r["seqlen_q"] for r in group if r["method"] == method and r["status"] == "oom"]
            if ooms:
                ax.scatter([min(ooms)], [top], marker="x", s=80, color=color,
                           label=f"{label(method)} OOM at N={min(ooms)}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (seqlen)")
        ax.set_ylabel("MiB")
        ax.set_title(PASS_TITLE[pass_], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_roofline(plt, doc: dict, rows: list[dict], suite: str, path: Path, caption: str) -> Path | None:
    roof = doc.get("roofline") or {}
    gemm, copy = roof.get("gemm", {}), roof.get("copy", {})
    pts = [r for r in rows if r["kind"] == "speed" and r["status"] == "ok"]
    if gemm.get("status") != "ok" or copy.get("status") != "ok" or not pts:
        return None
    peak, bw = gemm["tflops"], copy["gb_per_s"] * 1e9 / 1e12  # TFLOP/s, TB/s
    fig, (ax,) = _grid(plt, [0], f"{suite}: roofline (measured bf16 GEMM {peak:.0f} TFLOP/s, "
                                 f"copy {copy['gb_per_s']:.0f} GB/s)\n{caption}")
    intensity = {}
    for r in pts:
        ai = attention_flops(_cell(r), r["pass"]) / attention_min_bytes(_cell(r), r["pass"], ELEM_BYTES.get(r["dtype"], 2))
        intensity.setdefault((r["method"], r["pass"]), []).append((ai, r["tflops"]))
    lo = min(a for v in intensity.values() for a, _ in v) / 4
    hi = max(a for v in intensity.values() for a, _ in v) * 4
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="black", lw=1.2, label="roof")
    for (method, pass_), v in intensity.items():
        color, _ = _style(method)
        ax.scatter(*zip(*v), color=color, marker=PASS_MARKER[pass_], s=18, label=f"{label(method)} {pass_}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / compulsory byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


# ----------------------------------------------------------------------------- HTML


def _fmt_time(r: dict) -> str:
    if r["status"] != "ok":
        return html.escape(r["status"][:60])
    if r["kind"] == "memory":
        return f"{r['peak_bytes'] / 2**20:,.0f} MiB" if r.get("peak_bytes") is not None else "n/a"
    t = r["time_ms"]
    return (f"{r['tflops']:.1f} TF/s<br><small>{t['median']:.3f} ms [{t['p10']:.3f}–{t['p90']:.3f}] n={t['reps']}"
            + (f"<br>{r['tokens_per_s'] / 1e6:.1f} M tokens/s" if r.get("tokens_per_s") else "") + "</small>")


def _table(rows: list[dict]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault(results.cell_group_key(r), {})[r["method"]] = r
    out = ["<table><tr><th>pass</th><th>cell</th>" + "".join(f"<th>{html.escape(label(m))}</th>" for m in methods) + "</tr>"]
    for by in groups.values():
        r0 = next(iter(by.values()))
        cell = f"B={r0['batch']} S={r0['seqlen_q']} H={r0['nheads']} D={r0['headdim']}{' causal' if r0['causal'] else ''} {r0['dtype']}"
        out.append(f"<tr><td>{r0['pass']}</td><td>{cell}</td>"
                   + "".join(f"<td>{_fmt_time(by[m]) if m in by else '-'}</td>" for m in methods) + "</tr>")
    return "\n".join(out) + "</table>"


def _measured_at(result: SuiteResult, newest: dict) -> str:
    """A table of where each (pass, dtype) of the current result comes from, marking those older
    than the GPU's newest run."""
    lines = ["<table><tr><th>pass</th><th>dtype</th><th>measured at</th><th></th></tr>"]
    for (dtype, pass_), doc in sorted(result.origins.items(), key=lambda item: (list(PASS_TITLE).index(item[0][1]), item[0][0])):
        older = doc["git"]["commit"][:7] != newest["git"]["commit"][:7]
        note = (f"<b>older</b>: the newest run on this GPU is at {html.escape(short_commit(newest))} "
                f"({run_date(newest)}); the kernels may have changed since") if older else "current"
        lines.append(f"<tr><td>{PASS_TITLE[pass_]}</td><td>{html.escape(dtype)}</td>"
                     f"<td>{html.escape(short_commit(doc))}, {run_date(doc)}</td><td>{note}</td></tr>")
    return "\n".join(lines) + "</table>"


def _env_rows(doc: dict) -> str:
    env, gpu = doc["environment"], doc["gpu"]
    items = [("GPU", f"{gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs)"),
             ("torch / CUDA / driver", f"{env.get('torch')} / {env.get('cuda')} / {env.get('driver')}"),
             ("cutlass-dsl / python", f"{env.get('cutlass_dsl')} / {env.get('python')}")]
    if doc.get("complete") is False:
        items.append(("complete", f"no: {Path(doc['_path']).name} stopped early; it holds what it measured"))
    skipped = [f"{label(n)}: {i['note']}" for n, i in doc["methods"].items() if not i["available"]]
    if skipped:
        items.append(("skipped methods", "; ".join(skipped)))
    for suite, note in (doc.get("suite_notes") or {}).items():
        items.append((f"suite {suite}", note))
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{html.escape(str(v))}</td></tr>" for k, v in items) + "</table>"


def _machine_facts(doc: dict) -> str:
    parts = []
    roof = doc.get("roofline") or {}
    if roof.get("gemm", {}).get("status") == "ok":
        parts.append(f"bf16 GEMM 8192³: {roof['gemm']['tflops']:.0f} TFLOP/s")
    if roof.get("copy", {}).get("status") == "ok":
        parts.append(f"device copy: {roof['copy']['gb_per_s']:.0f} GB/s")
    if (doc.get("overhead") or {}).get("torch_add_us_per_call"):
        parts.append(f"one eager torch.add on this host: {doc['overhead']['torch_add_us_per_call']:.1f} µs")
    for name, o in ((doc.get("overhead") or {}).get("methods") or {}).items():
        if o.get("status") == "ok":
            parts.append(f"host overhead {label(name)}: {o['host_us_per_call']:.1f} µs/call "
                         f"(device {o['device_us_per_call']:.1f} µs){' ✓' if name == 'ours' and o['meets_goal'] else ''}")
        else:
            parts.append(f"host overhead {label(name)}: {o.get('status')}")
    return "<p>" + " · ".join(html.escape(p) for p in parts) + "</p>" if parts else ""


CSS = ("body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;margin:1em 0}"
       "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left;vertical-align:top}"
       "img{max-width:100%;border:1px solid #eee;margin:4px 0}small{color:#666}")


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def render_gpu(plt, gpu: str, docs: list[dict], out: Path) -> tuple[str, set[int]]:
    """The HTML section of one GPU's runs (`docs`, oldest first) with its plots written to
    `out`, and the ids of the runs its current results use."""
    newest = docs[-1]
    body = [f"<h2>{html.escape(gpu)}</h2>"]
    used: set[int] = set()
    # Suites with the newest runs first, so a suite last measured long ago comes last.
    for suite in dict.fromkeys(s for d in reversed(docs) for s in d["suites"]):
        result = current_result(docs, suite)
        used |= {id(d) for d in result.runs}
        facts = next((d for d in reversed(result.runs) if d.get("roofline")), result.runs[-1])
        files = ", ".join(Path(d["_path"]).name for d in result.runs)
        body.append(f"<h3>suite {html.escape(suite)}</h3>{_measured_at(result, newest) if result.rows else ''}"
                    f"<p><small>from {html.escape(files)}</small></p>{_env_rows(facts)}{_machine_facts(facts)}")
        if not result.rows:
            body.append(f"<p>{html.escape((facts.get('suite_notes') or {}).get(suite, 'no measurements'))}</p>")
            continue
        ratios = results.compute_ratios(result.rows)
        stem = f"{suite}-{results.slugify(gpu)}"
        images = []
        for pass_ in PASS_TITLE:
            passed = [r for r in result.rows if r["pass"] == pass_]
            if not passed:
                continue
            caption = f"{gpu} · {result.provenance(passed, newest)}"
            images.append(plot_tflops(plt, result.rows, suite, pass_, out / f"tflops-{stem}-{pass_}.png", caption))
            images.append(plot_ratios(plt, ratios, suite, pass_, out / f"ratio-{stem}-{pass_}.png", caption))
        caption = f"{gpu} · {result.provenance(result.rows, newest)}"
        images.append(plot_memory(plt, result.rows, suite, out / f"memory-{stem}.png", caption))
        images.append(plot_roofline(plt, facts, result.rows, suite, out / f"roofline-{stem}.png", caption))
        body += [f"<p><img src='{p.name}' alt='{p.stem}'></p>" for p in images if p]
        body.append(_table(result.rows))
    return "\n".join(body), used


def render_arch(plt, arch: str, docs: list[dict], out: Path) -> Path:
    """Per GPU of this architecture, the current result of each suite; then every run."""
    out.mkdir(parents=True, exist_ok=True)
    docs = sorted(docs, key=lambda d: d["created_utc"])
    gpus = sorted({d["gpu"]["name"] for d in docs}, key=lambda g: max(d["created_utc"] for d in docs if d["gpu"]["name"] == g),
                  reverse=True)
    body, used = [], set()
    for gpu in gpus:
        section, in_use = render_gpu(plt, gpu, [d for d in docs if d["gpu"]["name"] == gpu], out)
        body.append(section)
        used |= in_use
    runs = "".join(f"<li>{html.escape(Path(d['_path']).name)} — {html.escape(', '.join(d['suites']))}, "
                   f"{html.escape(short_commit(d))}, {run_date(d)}{'' if id(d) in used else ' <small>(superseded)</small>'}</li>"
                   for d in reversed(docs))
    body.append(f"<h2>every run on {html.escape(arch)}, newest first</h2><ul>{runs}</ul>")
    page = out / "index.html"
    page.write_text(_page(f"cute-flash performance — {arch}", "\n".join(body)))
    return page


def render(results_dir: Path, out: Path) -> Path:
    plt = _pyplot()
    docs, skipped = results.load_dir(results_dir)
    by_arch: dict[str, list[dict]] = {}
    for d in docs:
        by_arch.setdefault(d["gpu"]["arch"], []).append(d)
    out.mkdir(parents=True, exist_ok=True)
    items = []
    for arch in sorted(by_arch):
        render_arch(plt, arch, by_arch[arch], out / arch)
        gpus = sorted({d["gpu"]["name"] for d in by_arch[arch]})
        items.append(f"<li><a href='{arch}/index.html'>{arch}</a>: {len(by_arch[arch])} run(s) on "
                     f"{html.escape(', '.join(gpus))}</li>")
    body = f"<ul>{''.join(items)}</ul>" if items else f"<p>No result files in {html.escape(str(results_dir))}.</p>"
    # Archives also keep variant logs and probes, which are not result files: counted, not listed.
    archived = [s for s in skipped if ".tar.xz/" in s]
    loose = [s for s in skipped if ".tar.xz/" not in s]
    if loose:
        body += "<h2>unreadable files</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in loose) + "</ul>"
    if archived:
        body += f"<p><small>{len(archived)} other files in the archives are not benchmark results (variant logs, probes).</small></p>"
    index = out / "index.html"
    index.write_text(_page("cute-flash performance", body))
    return index


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="cute-flash dashboard", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="directory of result files, as `cute-flash bench` writes them (default: %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.results.is_dir():
        where = "" if args.results.is_absolute() else f" under {Path.cwd()}"
        print(f"{p.prog}: error: no directory {args.results}{where}: run cute-flash bench first "
              "(it writes there) or pass --results DIR", file=sys.stderr)
        return 2
    try:
        index = render(args.results, args.out)
    except MissingMatplotlib as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
