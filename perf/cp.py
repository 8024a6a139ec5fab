"""`cp` suite: context-parallel ring attention on the GPUs of one host, against one GPU.

The ring is `cute_flash.distributed.ring_flash_attn_func`; the single GPU runs `flash_attn_func`.

    torchrun --nproc_per_node=N -m cute_flash.perf.cp --out DIR [options]
    python perf/cp.py --nproc N --out DIR [options]        (starts the N processes itself)

bf16, head dim 128, 32 heads, batch 1; total sequence 64k to 512k tokens, causal and not, the
forward (fwd) and forward + backward (fwdbwd). Per cell:

* ring: wall time of one call on all ranks (the slowest rank's median); per-GPU TFLOP/s = the
  problem's FLOPs / W / time (FLOPs as the bench counts them: 4·B·H·S²·D for the forward, half of
  it causal; fwdbwd 3.5 times the forward);
* compute only: the same ring steps on the rank's own K/V, no messages: ring / compute-only
  shows how much of the transfer the kernels hide (1.0: all of it);
* share: our single-GPU kernel (`flash_attn_func`) on one GPU's share of the tokens, S / W,
  same mask, run on rank 0 alone; vs_share = ring per-GPU TFLOP/s / share TFLOP/s;
* full (up to --full-max-seqlen): the whole sequence on one GPU; scaling efficiency =
  full time / (W · ring time), the fraction of a W-fold speedup the ring reaches.

Writes `cp-<gpu>-x<W>-<layout>-<date>-<commit>.json` and `.md` (the table) into --out after every
cell, `"complete": false` until the last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cute_flash.cli import ArgumentParser, short_dtype_arg
from cute_flash.distributed import LAYOUTS, ring_steps
from cute_flash.perf import results
from cute_flash.perf.harness import classify_error
from cute_flash.perf.suites import PASS_FLOP_FACTOR

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("fwd", "fwdbwd")
DEFAULT_SEQLENS = (65536, 131072, 262144, 524288)
REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # the CPU test points this at "cpu" to run the whole loop in one gloo process


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _release() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class CpCell:
    seqlen: int  # the whole sequence, over all ranks
    causal: bool
    pass_: str
    batch: int = 1
    nheads: int = 32
    nheads_kv: int = 32
    headdim: int = 128

    def label(self) -> str:
        return f"S={self.seqlen // 1024}k{' causal' if self.causal else ''} {self.pass_}"


def attention_flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool, pass_: str) -> float:
    """The bench's convention (perf/suites.py): 4·B·H·S²·D, halved when causal, times the pass's factor."""
    flops = 4.0 * batch * nheads * seqlen * seqlen * headdim
    return (flops / 2 if causal else flops) * PASS_FLOP_FACTOR[pass_]


def rank_flops(cell: CpCell, world_size: int, layout: str) -> list[float]:
    """FLOPs each rank's kernels do in the ring, from the step plan (a diagonal block counts half,
    as in the total): they sum to the whole problem's; their spread is the layout's imbalance."""
    local = cell.seqlen // world_size
    per_element = 4.0 * cell.batch * cell.nheads * cell.headdim * PASS_FLOP_FACTOR[cell.pass_]
    return [per_element * sum(b.work for b in ring_steps(r, world_size, local, layout, cell.causal) if b is not None)
            for r in range(world_size)]


def imbalance(flops: list[float]) -> float:
    """Busiest rank's work / the mean: 1.0 is balanced; the ring runs at the busiest rank's pace."""
    return max(flops) / (sum(flops) / len(flops))


def cells_for(args) -> list[CpCell]:
    return [CpCell(s, c, p, args.batch, args.nheads, args.nheads_kv, args.headdim)
            for s in args.seqlens for c in args.causal for p in args.passes]


def derived(row: dict, world_size: int) -> dict:
    """TFLOP/s and ratios from a row's times (ms); absent times give None."""
    def tflops(flops, ms):
        return flops / (ms * 1e-3) / 1e12 if ms else None

    ring = row.get("ring_ms")
    out = {"ring_tflops_per_gpu": tflops(row["flops"] / world_size, ring),
           "share_tflops": tflops(row["share_flops"], row.get("share_ms")),
           "full_tflops": tflops(row["flops"], row.get("full_ms"))}
    out["vs_share"] = (out["ring_tflops_per_gpu"] / out["share_tflops"]
                       if out["ring_tflops_per_gpu"] and out["share_tflops"] else None)
    out["scaling_efficiency"] = row["full_ms"] / (world_size * ring) if ring and row.get("full_ms") else None
    out["overlap"] = row["compute_ms"] / ring if ring and row.get("compute_ms") else None
    return out


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(doc: dict) -> str:
    w = doc["world_size"]
    lines = [f"# cp suite: {w} × {doc['gpu'].get('name', '?')}, {doc['layout']} layout, {doc['dtype']}, "
             f"H={doc['nheads']} D={doc['headdim']}",
             "",
             "| S | mask | pass | ring ms | per-GPU TFLOP/s | share (S/W) TFLOP/s | vs share | full ms | "
             "scaling eff. | compute-only / ring | imbalance | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(
            f"| {r['seqlen'] // 1024}k | {'causal' if r['causal'] else 'full'} | {r['pass']} "
            f"| {_fmt(r.get('ring_ms'), '.1f')} "
            f"| {_fmt(r.get('ring_tflops_per_gpu'), '.0f')} | {_fmt(r.get('share_tflops'), '.0f')} "
            f"| {_fmt(r.get('vs_share'), '.2f')} | {_fmt(r.get('full_ms'), '.1f')} "
            f"| {_fmt(r.get('scaling_efficiency'), '.0%')} | {_fmt(r.get('overlap'), '.2f')} "
            f"| {r['imbalance']:.2f} | {r['status']} |")
    if not doc.get("complete"):
        lines += ["", "(incomplete: the run stopped or is still going)"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m cute_flash.perf.cp", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/cp"), help="directory for the JSON and markdown files "
                   "(default: %(default)s)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (GPUs) to start when not run by torchrun (default: every visible GPU)")
    p.add_argument("--seqlens", type=_ints, default=DEFAULT_SEQLENS,
                   help="total sequence lengths, comma-separated (default: 65536,131072,262144,524288)")
    p.add_argument("--causal", type=_masks, default=(True, False), help="causal, full or both (default: both)")
    p.add_argument("--passes", type=_passes, default=PASSES, help="fwd, fwdbwd or both (default: both)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--dtype", type=short_dtype_arg, default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-kv", type=int, default=None, help="(default: --nheads)")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed calls per measurement (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (default: 1)")
    p.add_argument("--full-max-seqlen", type=int, default=131072,
                   help="longest sequence also run whole on one GPU, for the scaling efficiency "
                        "(default: 131072; 0: never)")
    p.add_argument("--no-compute-only", action="store_true", help="skip the ring without messages")
    args = p.parse_args(argv)
    args.nheads_kv = args.nheads_kv or args.nheads
    return args


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def _masks(text: str) -> tuple[bool, ...]:
    choices = {"causal": (True,), "full": (False,), "both": (True, False)}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"choose causal, full or both, not {text!r}")
    return choices[text]


def _passes(text: str) -> tuple[str, ...]:
    passes = tuple(x for x in text.split(",") if x) if text != "both" else PASSES
    if not passes or not set(passes) <= set(PASSES):
        raise argparse.ArgumentTypeError(f"passes must be among {', '.join(PASSES)}")
    return passes


MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast (NVLS) stays off (docs/distributed.md): the ring needs point-to-point transfers
only, and a program using multicast can take a shared host's GPUs out of service."""


def keep_multicast_off(environ=os.environ) -> None:
    environ.update(MULTICAST_OFF)  # before NCCL starts; spawned processes inherit it


def launched_by_torchrun(environ=os.environ) -> bool:
    return all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


# --- On the GPUs ----------------------------------------------------------------------------------------


def _timed(fn, reps: int, warmup: int) -> float:
    """Median wall ms of `fn` over `reps` calls started together on every rank; the slowest rank's."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(times)], device=DEVICE)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _one_gpu_ms(cell: CpCell, seqlen: int, dtype, reps: int, warmup: int) -> float:
    import cute_flash

    q, k, v, dout = _inputs(cell, seqlen, dtype, grad=cell.pass_ == "fwdbwd")
    fn = _runner(lambda: cute_flash.flash_attn_func(q, k, v, causal=cell.causal), (q, k, v), dout, cell.pass_)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(cell: CpCell, seqlen: int, dtype, grad: bool):
    shape_q = (cell.batch, seqlen, cell.nheads, cell.headdim)
    shape_kv = (cell.batch, seqlen, cell.nheads_kv, cell.headdim)
    q, k, v = (torch.randn(s, device=DEVICE, dtype=dtype).requires_grad_(grad)
               for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn(shape_q, device=DEVICE, dtype=dtype) if grad else None


def _runner(call, leaves, dout, pass_: str):
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                return call()
        return run
    return lambda: torch.autograd.grad(call(), leaves, dout)


def _no_messages_ring(ring):
    """The ring's steps on this rank's own K/V: same kernels, same shapes, no transfers."""
    from cute_flash.distributed import _Pending

    class Local(type(ring)):
        def __init__(self):
            self.__dict__.update(ring.__dict__)

        def pass_on(self, tensor, tag):
            return _Pending([], tensor)

    return Local()


def _ring_times(cell: CpCell, args, world_size: int, dtype) -> dict:
    """ring_ms, and compute_ms unless --no-compute-only, on this rank's random shards."""
    from cute_flash import distributed

    q, k, v, dout = _inputs(cell, cell.seqlen // world_size, dtype, grad=cell.pass_ == "fwdbwd")
    ring = distributed._Ring(None)
    scale = cell.headdim ** -0.5

    def ring_call(which):
        return lambda: distributed._RingAttention.apply(q, k, v, which, args.layout, cell.causal, scale, False)[0]

    times = {"ring_ms": _timed(_runner(ring_call(ring), (q, k, v), dout, cell.pass_), args.reps, args.warmup)}
    if not args.no_compute_only:
        local = _runner(ring_call(_no_messages_ring(ring)), (q, k, v), dout, cell.pass_)
        times["compute_ms"] = _timed(local, args.reps, args.warmup)
    return times


def measure_cell(cell: CpCell, args, rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from cute_flash import distributed

    dtype = DTYPES[args.dtype]
    flops = rank_flops(cell, world_size, args.layout)
    row = {**asdict(cell), "pass": cell.pass_, "layout": args.layout, "world_size": world_size,
           "flops": sum(flops), "imbalance": imbalance(flops),
           "share_flops": attention_flops(cell.batch, cell.nheads, cell.seqlen // world_size, cell.headdim,
                                          cell.causal, cell.pass_)}
    row.pop("pass_")
    try:
        distributed.check_sequence_split(cell.seqlen, world_size, args.layout)
        row.update(_ring_times(cell, args, world_size, dtype))
        row["status"] = "ok"
    except Exception as error:  # noqa: BLE001  (recorded; the next cell still runs)
        row["status"] = classify_error(error)
    _release()  # the ring's buffers, before one GPU runs alone
    for name, seqlen, wanted in (("share_ms", cell.seqlen // world_size, True),
                                 ("full_ms", cell.seqlen, 0 < cell.seqlen <= args.full_max_seqlen)):
        if not wanted:
            continue
        # One GPU alone while the others wait in the broadcast, which every rank reaches (a
        # failure on rank 0 is sent as -1) so that the collectives stay in step.
        value = torch.full((1,), -1.0, device=DEVICE)
        if rank == 0:
            try:
                value[0] = _one_gpu_ms(cell, seqlen, dtype, args.reps, args.warmup)
            except Exception as error:  # noqa: BLE001
                row[name.replace("_ms", "_status")] = classify_error(error)
            _release()
        dist.broadcast(value, src=0)
        if value.item() > 0:
            row[name] = value.item()
    row.update(derived(row, world_size))
    return row


def run(rank: int, world_size: int, args) -> None:
    import torch.distributed as dist

    cells = cells_for(args)
    if rank == 0:
        doc = new_doc(args, world_size, machine_facts(), results.utc_now())
        stem = doc_stem(doc)
    for i, cell in enumerate(cells):
        if rank == 0:
            print(f"[{i + 1}/{len(cells)}] {cell.label()}", file=sys.stderr, flush=True)
        row = measure_cell(cell, args, rank, world_size)
        dist.barrier()
        if rank == 0:
            doc["rows"].append(row)
            doc["complete"] = i == len(cells) - 1
            write(doc, args.out, stem)
    if rank == 0:
        print(markdown_table(doc), flush=True)


def machine_facts() -> dict:
    return {"gpu": results.gpu_info(torch.cuda.current_device()), "git": results.git_commit(REPO),
            "versions": results.versions(), "environment": results.environment()}


def new_doc(args, world_size: int, facts: dict, now: datetime.datetime) -> dict:
    """The result document, rows to come; `facts`: gpu, git, versions, environment (perf/results.py)."""
    return {"suite": "cp", "created_utc": now.isoformat(), "world_size": world_size, "layout": args.layout,
            "dtype": args.dtype, "batch": args.batch, "nheads": args.nheads, "nheads_kv": args.nheads_kv,
            "headdim": args.headdim, **facts, "rows": [], "complete": False}


def doc_stem(doc: dict) -> str:
    date = datetime.datetime.fromisoformat(doc["created_utc"]).strftime("%Y%m%d")
    return (f"cp-{results.slugify(doc['gpu'].get('name', 'gpu'))}-x{doc['world_size']}-{doc['layout']}-"
            f"{date}-{doc['git']['commit']}")


def write(doc: dict, out: Path, stem: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{stem}.json", out / f"{stem}.md"
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(markdown_table(doc))
    return paths


def _process(rank: int, world_size: int, args, store: str | None) -> None:
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    init = {} if store is None else {"init_method": f"file://{store}", "rank": rank, "world_size": world_size}
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30), **init)
    try:
        run(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    keep_multicast_off()
    if launched_by_torchrun():
        _process(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    nproc = args.nproc or torch.cuda.device_count()
    if nproc < 1:
        print("python -m cute_flash.perf.cp: no CUDA GPU visible", file=sys.stderr)
        return 2
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_process, args=(nproc, args, os.path.join(folder, "store")), nprocs=nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
