"""`decode` suite: `flash_attn_with_kvcache` against the GPU's copy bandwidth and its peers.

    python -m cute_flash.perf decode --out DIR [--quick] [--head-dims 128 64]

bf16, non-causal (a query row sees its whole cache; SDPA's causal mask is aligned top-left, so
causal peers would differ), every sequence at the full cache length. Per cell (batch, cache
length, q length, query:KV heads, head dim, cache layout):

* TB/s of K+V read: batch * cache length * KV heads * head dim * 2 bytes * 2 (K and V) / time;
* time: one step inside a captured CUDA graph of ROUNDS steps over caches rotated so that the
  steps together read well past the L2 (no step finds its cache in L2); `eager_us` is one step
  called from Python back to back (host overhead included; the value checks, one host
  synchronization, are off as in a serving loop that captured its step);
* peers, contiguous cells only: torch SDPA's cuDNN and flash backends (`enable_gqa`), and
  FlashAttention-4's `flash_attn.cute` when it imports (a hook: `fa4_decode`);
* copy: a device-to-device copy of COPY_BYTES in the same run, read + write bytes / time, and
  the bar the kernel is held to: ours >= 1.0x the best peer, and >= 0.85x the copy at batch >= 8 or cache >= 32k.

Writes `decode-<gpu>-<date>.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

L2_MARGIN_BYTES = 256 << 20
ROUNDS = 16
COPY_BYTES = 2 << 30


@dataclass(frozen=True)
class DecodeCell:
    batch: int
    cache_len: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    layout: str  # "contiguous", "paged16", "paged256"

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.cache_len * self.nheads_kv * self.head_dim * 2 * 2

    def label(self) -> str:
        return (f"B={self.batch} L={self.cache_len // 1024}k q={self.seqlen_q} {self.nheads}:{self.nheads_kv} "
                f"d={self.head_dim} {self.layout}")


SHAPES = [(1, 131072), (1, 32768), (8, 32768), (64, 8192), (1, 4096), (8, 4096), (8, 131072), (64, 4096),
          (64, 32768)]  # the points the training forward was first measured at


def cells(quick: bool, head_dims) -> list[DecodeCell]:
    out = []
    for head_dim in head_dims:
        for batch, length in SHAPES:
            for heads in ((32, 8), (8, 1)):
                for seqlen_q in (1, 8):
                    for layout in ("contiguous", "paged16", "paged256"):
                        if quick and (seqlen_q != 1 or layout == "paged16" and heads != (32, 8)):
                            continue
                        out.append(DecodeCell(batch, length, seqlen_q, *heads, head_dim, layout))
    return out


def _caches(cell: DecodeCell, copies: int):
    """`copies` independent caches (and block tables) of the cell."""
    dtype = torch.bfloat16
    made = []
    for _ in range(copies):
        if cell.layout == "contiguous":
            shape = (cell.batch, cell.cache_len, cell.nheads_kv, cell.head_dim)
            table = None
        else:
            page = int(cell.layout.removeprefix("paged"))
            pages = cell.batch * cell.cache_len // page
            shape = (pages, page, cell.nheads_kv, cell.head_dim)
            table = torch.randperm(pages, device="cuda").to(torch.int32).view(cell.batch, -1)
        made.append((torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, dtype=dtype, device="cuda"),
                     table))
    return made


def _graph_time(steps) -> float:
    """Seconds per step: the steps captured once in a CUDA graph, replayed a few times, median."""
    for step in steps:
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for step in steps:
            step()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(steps))
    return sorted(times)[len(times) // 2]


def _eager_time(step, calls: int = 50) -> float:
    import time

    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def copy_bandwidth() -> float:
    """Read + write bytes per second of a device-to-device copy."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _graph_time([lambda: dst.copy_(src)] * 4)
    return 2 * COPY_BYTES / seconds


def fa4_decode():
    """FlashAttention-4's function when `flash_attn.cute` imports, else None (the peer is left out)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 (any import failure leaves the peer out)
        return None
    return flash_attn_func


def measure(cell: DecodeCell) -> dict:
    from cute_flash import kvcache

    kvcache.VALUE_CHECKS = False
    copies = max(1, math.ceil(L2_MARGIN_BYTES / cell.kv_bytes))
    caches = _caches(cell, min(copies, ROUNDS))
    q = torch.randn(cell.batch, cell.seqlen_q, cell.nheads, cell.head_dim, dtype=torch.bfloat16, device="cuda")
    lengths = torch.full((cell.batch,), cell.cache_len, dtype=torch.int32, device="cuda")

    def ours(kc, vc, table):
        return lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table)

    steps = [ours(*caches[i % len(caches)]) for i in range(ROUNDS)]
    result = dict(cell=asdict(cell), label=cell.label(), kv_bytes=cell.kv_bytes)
    result["ours_us"] = _graph_time(steps) * 1e6
    result["ours_eager_us"] = _eager_time(steps[0]) * 1e6
    if cell.layout == "contiguous":
        qt = q.transpose(1, 2)
        peers = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        for name, backend in peers.items():
            def sdpa(kc, vc, _table, backend=backend):
                kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)

                def step():
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                return step
            try:
                result[f"{name}_us"] = _graph_time([sdpa(*caches[i % len(caches)]) for i in range(ROUNDS)]) * 1e6
            except Exception as error:  # noqa: BLE001 (a backend that refuses the shape is reported, not fatal)
                result[f"{name}_error"] = str(error).splitlines()[0][:200]
        fa4 = fa4_decode()
        if fa4 is not None:
            try:
                result["fa4_us"] = _graph_time(
                    [(lambda kc=kc, vc=vc: fa4(q, kc, vc)) for kc, vc, _ in
                     (caches[i % len(caches)] for i in range(ROUNDS))]) * 1e6
            except Exception as error:  # noqa: BLE001
                result["fa4_error"] = str(error).splitlines()[0][:200]
    for key in [k for k in result if k.endswith("_us") and not k.endswith("eager_us")]:
        result[key.replace("_us", "_tbps")] = cell.kv_bytes / (result[key] * 1e-6) / 1e12
    del caches
    torch.cuda.empty_cache()
    return result


def verdict(row: dict, copy_tbps: float) -> dict:
    peers = [row[k] for k in ("cudnn_tbps", "flash_tbps", "fa4_tbps") if k in row]
    cell = row["cell"]
    out = {"vs_best_peer": row["ours_tbps"] / max(peers) if peers else None,
           "vs_copy": row["ours_tbps"] / copy_tbps}
    out["copy_bar_applies"] = cell["batch"] >= 8 or cell["cache_len"] >= 32768
    out["passes"] = ((out["vs_best_peer"] is None or out["vs_best_peer"] >= 1.0)
                     and (not out["copy_bar_applies"] or out["vs_copy"] >= 0.85))
    return out


def table(rows: list[dict], copy_tbps: float) -> str:
    lines = [f"copy (read + write): {copy_tbps:.2f} TB/s", "",
             "| cell | ours TB/s | µs (graph) | µs (eager) | cuDNN | FA2 | FA4 | vs peer | vs copy | bar |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        v = row["verdict"]

        def peer(name):
            return f"{row[name + '_tbps']:.2f}" if name + "_tbps" in row else "—"
        vs_peer = "—" if v["vs_best_peer"] is None else f"{v['vs_best_peer']:.2f}"
        lines.append(f"| {row['label']} | {row['ours_tbps']:.2f} | {row['ours_us']:.1f} | {row['ours_eager_us']:.1f} | "
                     f"{peer('cudnn')} | {peer('flash')} | {peer('fa4')} | {vs_peer} | {v['vs_copy']:.2f} | "
                     f"{'pass' if v['passes'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_flash.perf decode", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quick", action="store_true", help="q length 1; paged16 only at 32:8")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--max-cells", type=int, default=0, help="stop after this many cells (0: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    stem = args.out / f"decode-{name}-{datetime.date.today().isoformat()}"
    copy_tbps = copy_bandwidth() / 1e12
    rows = []
    todo = cells(args.quick, args.head_dims)
    for cell in todo[: args.max_cells or None]:
        row = measure(cell)
        row["verdict"] = verdict(row, copy_tbps)
        rows.append(row)
        print(table([row], copy_tbps).splitlines()[-1], flush=True)
        stem.with_suffix(".json").write_text(json.dumps(dict(copy_tbps=copy_tbps, rows=rows,
                                                             complete=len(rows) == len(todo)), indent=1))
        stem.with_suffix(".md").write_text(table(rows, copy_tbps))
    print(table(rows, copy_tbps))
    return 0
