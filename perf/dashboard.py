"""`cute-flash dashboard`: render every result file into a static page per GPU architecture.

    <out>/index.html            every run, grouped by architecture
    <out>/<arch>/index.html     plots and tables of the newest run of each suite on that arch
    <out>/<arch>/*.png          TFLOP/s vs seqlen, speedup vs each peer, memory vs N, roofline

The default output, build/dashboard, is git-ignored: images never enter the tracked tree.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from pathlib import Path

from . import results
from .suites import Cell, attention_flops, attention_min_bytes

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = Path("build/dashboard")
METHOD_STYLE = {  # fixed colours so a method looks the same in every plot
    "ours": ("tab:red", "o"), "ours_sm80": ("tab:pink", "o"), "fa4": ("tab:purple", "s"), "sdpa_flash": ("tab:blue", "^"),
    "sdpa_cudnn": ("tab:green", "v"), "sdpa_efficient": ("tab:orange", "D"),
    "sdpa_math": ("tab:brown", "x"), "standard": ("tab:gray", "+"),
}
PASS_MARKER = {"fwd": "o", "bwd": "^", "fwdbwd": "s"}  # roofline: colour is the method, shape the pass
PASS_TITLE = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
ELEM_BYTES = {"bf16": 2, "fp16": 2}


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


def _style(method: str):
    return METHOD_STYLE.get(method, ("black", "."))


def _cell(m: dict) -> Cell:
    return Cell(m["batch"], m["seqlen_q"], m["seqlen_k"], m["nheads"], m["nheads_kv"], m["headdim"], m["causal"])


def _x_axis(rows: list[dict]) -> str:
    """Plot against seqlen when it varies in the group, else against batch."""
    return "seqlen_q" if len({r["seqlen_q"] for r in rows}) > 1 else "batch"


def _cell_text(r: dict) -> str:
    return f"B={r['batch']} S={r['seqlen_q']} H={r['nheads']}"


def _bars(ax, values: dict[str, float], ylabel: str, title: str, baseline: float | None = None) -> None:
    """A panel with one problem size: one bar per method, labelled with its value."""
    names = list(values)
    bars = ax.bar(range(len(names)), [values[n] for n in names], color=[_style(n)[0] for n in names])
    ax.bar_label(bars, fmt="%.2f" if baseline else "%.0f", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    if baseline is not None:
        ax.axhline(baseline, color="black", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")


def _grid(plt, panels: list, title: str):
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat)


def _save(fig, path: Path) -> Path:
    # Room above the panels for the (up to two-line) figure title, about 0.6 inch.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _panels(rows: list[dict]) -> dict[tuple, list[dict]]:
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["headdim"], r["causal"], r["dtype"]), []).append(r)
    return dict(sorted(panels.items()))


def _panel_title(key: tuple) -> str:
    headdim, causal, dtype = key
    return f"hdim {headdim}, {'causal' if causal else 'non-causal'}, {dtype}"


def _plot_over_length(plt, panels: dict, title: str, path: Path, series: str, value: str,
                      ylabel: str, bar_label: str, ratio: bool) -> Path:
    """One panel per (head dim, causal, dtype) with a line per `series` (method or peer) of
    `value` over the sequence length, or bars when the panel holds one length. `ratio` panels
    get a log y axis and a line at 1."""
    fig, axes = _grid(plt, list(panels), title)
    for ax, (key, group) in zip(axes, panels.items()):
        group = [r for r in group if r[value]]  # failed cells carry no value
        xkey = _x_axis(group)
        if len({r[xkey] for r in group}) == 1:
            _bars(ax, {r[series]: r[value] for r in group}, bar_label,
                  f"{_panel_title(key)}, {_cell_text(group[0])}", baseline=1.0 if ratio else None)
            continue
        for name in dict.fromkeys(r[series] for r in group):
            pts = sorted((r[xkey], r[value]) for r in group if r[series] == name)
            color, marker = _style(name)
            ax.plot(*zip(*pts), marker=marker, color=color, label=f"vs {name}" if ratio else name)
            if ratio:
                _paired_range(ax, [r for r in group if r[series] == name], xkey, color)
        ax.set_xscale("log", base=2)
        if ratio:
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_yscale("log", base=2)
            _plain_ratio_ticks(ax)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(xkey.replace("_q", ""))
        ax.set_ylabel(ylabel)
        ax.set_title(_panel_title(key), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _plain_ratio_ticks(ax) -> None:
    """Ratios as plain numbers on the log axis (its own ticks are powers of 2, often only 2^0)."""
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _paired_range(ax, rows: list[dict], xkey: str, color) -> None:
    """The paired speedup (results.paired_speedup: peer / ours within each round) as its median
    with a bar over the rounds' min-max, beside the ratio of medians: how far the ratio can be
    trusted."""
    paired = sorted((r[xkey], r["paired"]) for r in rows if r.get("paired"))
    if not paired:
        return
    xs = [x for x, _ in paired]
    med = [p["median"] for _, p in paired]
    spread = [[p["median"] - p["min"] for _, p in paired], [p["max"] - p["median"] for _, p in paired]]
    ax.errorbar(xs, med, yerr=spread, fmt="_", color=color, alpha=0.5, capsize=2, lw=1)


def plot_tflops(plt, rows: list[dict], suite: str, pass_: str, path: Path) -> Path | None:
    ok = [r for r in rows if r["kind"] == "speed" and r["pass"] == pass_ and r["status"] == "ok"]
    panels = _panels(ok)
    if not panels:
        return None
    return _plot_over_length(plt, panels, f"{suite}: {PASS_TITLE[pass_]} TFLOP/s", path,
                             "method", "tflops", "TFLOP/s", "TFLOP/s", ratio=False)


def plot_ratios(plt, ratios: list[dict], suite: str, pass_: str, path: Path) -> Path | None:
    panels = _panels([r for r in ratios if r["kind"] == "speed" and r["pass"] == pass_])
    if not panels:
        return None
    title = (f"{suite}: {PASS_TITLE[pass_]} speedup of ours over each peer (>1: ours faster)\n"
             "bars: median and min-max over rounds of the speedup within each round")
    return _plot_over_length(plt, panels, title, path, "peer", "speedup", "speedup", "speedup of ours", ratio=True)


def plot_memory(plt, rows: list[dict], suite: str, path: Path) -> Path | None:
    mem = [r for r in rows if r["kind"] == "memory"]
    if not mem:
        return None
    passes = list(dict.fromkeys(r["pass"] for r in mem))
    fig, axes = _grid(plt, passes, f"{suite}: peak extra device memory vs N (x: out of memory)")
    for ax, pass_ in zip(axes, passes):
        group = [r for r in mem if r["pass"] == pass_]
        top = max([r.get("peak_bytes") or 1 for r in group if r["status"] == "ok"] or [1]) / 2**20 * 2
        for method in dict.fromkeys(r["method"] for r in group):
            color, marker = _style(method)
            pts = sorted((r["seqlen_q"], r["peak_bytes"] / 2**20) for r in group
                         if r["method"] == method and r["status"] == "ok" and r.get("peak_bytes"))
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, label=method)
            ooms = [r["seqlen_q"] for r in group if r["method"] == method and r["status"] == "oom"]
            if ooms:
                ax.scatter([min(ooms)], [top], marker="x", s=80, color=color,
                           label=f"{method} OOM at N={min(ooms)}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (seqlen)")
        ax.set_ylabel("MiB")
        ax.set_title(PASS_TITLE[pass_], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_roofline(plt, doc: dict, rows: list[dict], suite: str, path: Path) -> Path | None:
    roof = doc.get("roofline") or {}
    gemm, copy = roof.get("gemm", {}), roof.get("copy", {})
    pts = [r for r in rows if r["kind"] == "speed" and r["status"] == "ok"]
    if gemm.get("status") != "ok" or copy.get("status") != "ok" or not pts:
        return None
    peak, bw = gemm["tflops"], copy["gb_per_s"] * 1e9 / 1e12  # TFLOP/s, TB/s
    fig, (ax,) = _grid(plt, [0], f"{suite}: roofline (measured bf16 GEMM {peak:.0f} TFLOP/s, copy {copy['gb_per_s']:.0f} GB/s)")
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
        ax.scatter(*zip(*v), color=color, marker=PASS_MARKER[pass_], s=18, label=f"{method} {pass_}")
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
    out = ["<table><tr><th>pass</th><th>cell</th>" + "".join(f"<th>{html.escape(m)}</th>" for m in methods) + "</tr>"]
    for by in groups.values():
        r0 = next(iter(by.values()))
        cell = f"B={r0['batch']} S={r0['seqlen_q']} H={r0['nheads']} D={r0['headdim']}{' causal' if r0['causal'] else ''} {r0['dtype']}"
        out.append(f"<tr><td>{r0['pass']}</td><td>{cell}</td>"
                   + "".join(f"<td>{_fmt_time(by[m]) if m in by else '-'}</td>" for m in methods) + "</tr>")
    return "\n".join(out) + "</table>"


def _env_rows(doc: dict) -> str:
    env, gpu, git = doc["environment"], doc["gpu"], doc["git"]
    items = [("file", Path(doc["_path"]).name), ("created (UTC)", doc["created_utc"]),
             ("commit", f"{git['commit']}{' (dirty)' if git.get('dirty') else ''}"),
             ("GPU", f"{gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs)"),
             ("torch / CUDA / driver", f"{env.get('torch')} / {env.get('cuda')} / {env.get('driver')}"),
             ("cutlass-dsl / python", f"{env.get('cutlass_dsl')} / {env.get('python')}"),
             ("suites", ", ".join(doc["suites"]))]
    if doc.get("complete") is False:
        items.append(("complete", "no: the run stopped early; this file holds what it measured"))
    skipped = [f"{n}: {i['note']}" for n, i in doc["methods"].items() if not i["available"]]
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
            parts.append(f"host overhead {name}: {o['host_us_per_call']:.1f} µs/call "
                         f"(device {o['device_us_per_call']:.1f} µs){' ✓' if name == 'ours' and o['meets_goal'] else ''}")
        else:
            parts.append(f"host overhead {name}: {o.get('status')}")
    return "<p>" + " · ".join(html.escape(p) for p in parts) + "</p>" if parts else ""


CSS = ("body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;margin:1em 0}"
       "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left;vertical-align:top}"
       "img{max-width:100%;border:1px solid #eee;margin:4px 0}small{color:#666}")


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def merge_suite(docs: list[dict], suite: str) -> tuple[dict, list[dict], int]:
    """For each dtype `suite` was measured in, the newest run (docs sorted oldest first) merged
    with the other runs on the same commit and GPU (a long suite split by filters); later rows
    replace earlier. So an fp16 run does not hide the last bf16 one: panels are per dtype.
    Returns the document whose machine facts (roofline, overhead) to show, the rows, and how
    many files were merged."""
    having = [d for d in docs if suite in d["suites"]]
    dtypes = dict.fromkeys(m["dtype"] for d in having for m in d["measurements"] if m["suite"] == suite)
    rows: dict[tuple, dict] = {}
    used: dict[int, dict] = {}
    for dtype in dtypes:
        measured = [d for d in having if any(m["suite"] == suite and m["dtype"] == dtype for m in d["measurements"])]
        origin = (measured[-1]["git"]["commit"], measured[-1]["gpu"]["name"])
        for d in measured:
            if (d["git"]["commit"], d["gpu"]["name"]) != origin:
                continue
            used[id(d)] = d
            for m in d["measurements"]:
                if m["suite"] == suite and m["dtype"] == dtype:
                    rows[results.cell_group_key(m) + (m["method"],)] = m
    runs = sorted(used.values(), key=lambda d: d["created_utc"]) or having[-1:]
    facts = next((d for d in reversed(runs) if d.get("roofline")), runs[-1])
    return facts, list(rows.values()), len(runs)


def render_arch(plt, arch: str, docs: list[dict], out: Path) -> Path:
    """Plots and tables for the newest run of each suite on this architecture."""
    out.mkdir(parents=True, exist_ok=True)
    docs = sorted(docs, key=lambda d: d["created_utc"])
    body = []
    for suite in dict.fromkeys(s for d in reversed(docs) for s in d["suites"]):
        doc, rows, merged = merge_suite(docs, suite)
        ratios = results.compute_ratios(rows)
        note = f"<p>merged from {merged} result files of this commit</p>" if merged > 1 else ""
        body.append(f"<h2>suite {html.escape(suite)}</h2>{_env_rows(doc)}{note}{_machine_facts(doc)}")
        if not rows:
            body.append(f"<p>{html.escape((doc.get('suite_notes') or {}).get(suite, 'no measurements'))}</p>")
            continue
        images = []
        for pass_ in PASS_TITLE:
            images.append(plot_tflops(plt, rows, suite, pass_, out / f"tflops-{suite}-{pass_}.png"))
            images.append(plot_ratios(plt, ratios, suite, pass_, out / f"ratio-{suite}-{pass_}.png"))
        images.append(plot_memory(plt, rows, suite, out / f"memory-{suite}.png"))
        images.append(plot_roofline(plt, doc, rows, suite, out / f"roofline-{suite}.png"))
        body += [f"<p><img src='{p.name}' alt='{p.stem}'></p>" for p in images if p]
        body.append(_table(rows))
    runs = "".join(f"<li>{html.escape(Path(d['_path']).name)} — {html.escape(', '.join(d['suites']))}</li>" for d in docs)
    body.append(f"<h2>all runs on {html.escape(arch)}</h2><ul>{runs}</ul>")
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
    if skipped:
        body += "<h2>unreadable files</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in skipped) + "</ul>"
    index = out / "index.html"
    index.write_text(_page("cute-flash performance", body))
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cute-flash dashboard", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="directory of result JSON files (default: %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s, git-ignored)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.results.is_dir():
        print(f"cute-flash dashboard: no such directory {args.results}", file=sys.stderr)
        return 2
    try:
        index = render(args.results, args.out)
    except MissingMatplotlib as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"wrote {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
