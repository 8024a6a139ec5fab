"""Ring attention (cute_flash/distributed.py) on 2, 4 and 8 GPUs of one host over NCCL, against the
single-GPU result of our own kernels on the unsharded sequence; and torch's own context parallelism
(`torch.distributed.tensor.experimental.context_parallel`) running our kernels through the SDPA
registration (cute_flash/sdpa.py).

Each world size runs in its own set of processes, one per GPU, started by the test itself
(`torch.multiprocessing.spawn`): `pytest tests/gpu/test_distributed.py` runs every world size the
machine has GPUs for; the others are deselected (`multigpu(n)` marker, tests/conftest.py), so a
single-GPU run with CUTE_FLASH_REQUIRE_GPU=1 does not count them as skips. Without pytest:
`torchrun --nproc_per_node=N -m tests.gpu.test_distributed` prints each case's verdict and exits
non-zero when one fails.

The bar, on a sample of rows (query rows for out, lse and dq; key rows for dk and dv), as the
GPU tests measured before the flash-numerics yardstick: the ring may differ from the float64
reference by at most twice the error torch makes in the inputs' dtype (QK^T rounded to 16 bits,
float32 softmax, P rounded for P·V) against float64; its distance to our single-GPU kernels is
recorded beside it. Its LSE is held to the yardstick's LSE bound. The ring adds roundings of its own: each step's output and
gradients leave the kernel in the inputs' dtype before the float32 merge.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cute_flash.distributed import gather_sequence, ring_flash_attn_func, shard_sequence

from .common import BACKWARD_FLOOR, FORWARD_FLOOR, LSE_TOLERANCE

pytestmark = pytest.mark.gpu

WORLD_SIZES = (2, 4, 8)
SAMPLED_ROWS = 384
ROW_CHUNK = 1024
"""Query rows per piece of the sampled references: bounds their float64 score block to
ROW_CHUNK x seqlen (64 MiB at 8k)."""
SPAWN_TIMEOUT_S = 1500
"""For a whole world size: compiling the kernel variants the ring's block lengths need comes first."""


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    head_dim: int
    nheads: int
    nheads_kv: int
    causal: bool
    layout: str
    seqlen: int = 8192  # the whole sequence: 2 * 8 chunks of 512 at 8 GPUs
    batch: int = 2
    torch_cp: bool = False  # torch's context_parallel on the same shards instead of ours


CASES = [
    Case("bf16-d128-causal-zigzag", "bf16", 128, 8, 8, True, "zigzag"),
    Case("bf16-d128-zigzag", "bf16", 128, 8, 8, False, "zigzag"),
    Case("fp16-d64-causal-zigzag-gqa", "fp16", 64, 8, 2, True, "zigzag"),
    Case("bf16-d128-causal-contiguous-gqa", "bf16", 128, 8, 2, True, "contiguous"),
    Case("fp16-d128-contiguous-mqa", "fp16", 128, 8, 1, False, "contiguous"),
    Case("torch-context-parallel-bf16-d128-causal", "bf16", 128, 8, 8, True, "zigzag", batch=1, torch_cp=True),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- References on sampled rows ----------------------------------------------------------------------


def sampled_attention(q, k, v, dout, rows, keys, scale, causal, exact):
    """(out, lse, dq) at query rows `rows` and (dk, dv) at key rows `keys` of attention over the
    whole sequence (seqlen_q == seqlen_k): in float64 (`exact`), or as torch computes it in the
    inputs' dtype, its autograd included (float32 softmax, every matmul in the dtype). Every row
    is visited (dk and dv sum over all queries), ROW_CHUNK query rows at a time."""
    batch, seqlen, nheads, head_dim = q.shape
    group = nheads // k.shape[2]
    f64 = torch.float64
    out = torch.zeros(batch, len(rows), nheads, head_dim, dtype=f64, device=q.device)
    lse = torch.zeros(batch, nheads, len(rows), dtype=f64, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(batch, len(keys), k.shape[2], head_dim, dtype=f64, device=q.device)
    dv = torch.zeros_like(dk)
    positions = torch.arange(seqlen, device=q.device)
    for b in range(batch):
        for h in range(nheads):
            qh, kh, vh, doh = q[b, :, h], k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            if exact:
                qh, kh, vh, doh = (t.double() for t in (qh, kh, vh, doh))
            for start in range(0, seqlen, ROW_CHUNK):
                chunk = slice(start, min(start + ROW_CHUNK, seqlen))
                scores = (qh[chunk] @ kh.T).to(f64 if exact else torch.float32) * scale
                if causal:
                    scores = scores.masked_fill(positions[None, :] > positions[chunk, None], float("-inf"))
                chunk_lse = torch.logsumexp(scores, -1, keepdim=True)
                p = torch.exp(scores - chunk_lse)
                p_used = p if exact else p.to(q.dtype)  # what multiplies V (and dO for dV)
                dp = (doh[chunk] @ vh.T).to(p.dtype)
                ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
                ds_used = ds if exact else ds.to(q.dtype)
                mine = (rows >= chunk.start) & (rows < chunk.stop)
                local = rows[mine] - start
                out[b, mine, h] = (p_used[local] @ vh).double()
                lse[b, h, mine] = chunk_lse[local, 0].double()
                dq[b, mine, h] = (ds_used[local] @ kh).double()
                dk[b, :, h // group] += (ds_used[:, keys].T @ qh[chunk]).double()
                dv[b, :, h // group] += (p_used[:, keys].T @ doh[chunk]).double()
    return out, lse, dq, dk, dv


def sample_rows(seqlen: int, chunk: int, generator: torch.Generator, device) -> torch.Tensor:
    """Random rows plus both ends of every chunk, where a wrong block boundary shows first."""
    edges = torch.arange(0, seqlen, chunk)
    picked = torch.cat([torch.randperm(seqlen, generator=generator)[:SAMPLED_ROWS], edges, edges + chunk - 1])
    return picked.unique().to(device)


def verdicts(ring, ours, exact, same_dtype) -> dict:
    """name -> {errors, bound, passed} for out, dq, dk, dv (sampled rows) and lse. The ring is held
    to float64 by the bar; its distance to our single-GPU result is recorded beside it, not held to
    the same bound: two results that each meet the bar may differ by up to twice it (on 2 H100s,
    2026-11-27, bf16 causal dV: 0.031 apart, each within 0.030 of float64, where torch errs by 0.015)."""
    result = {}
    floors = {"out": FORWARD_FLOOR, "dq": BACKWARD_FLOOR, "dk": BACKWARD_FLOOR, "dv": BACKWARD_FLOOR}
    for name, floor in floors.items():
        torch_err = (same_dtype[name] - exact[name]).abs().max().item()
        vs_ours = (ring[name].double() - ours[name].double()).abs().max().item()
        vs_exact = (ring[name].double() - exact[name]).abs().max().item()
        bound = 2 * torch_err + floor
        result[name] = {"vs_ours": vs_ours, "vs_float64": vs_exact, "torch_same_dtype": torch_err, "bound": bound,
                        "passed": vs_exact <= bound}
    lse_err = ((ring["lse"].double() - exact["lse"]).abs() / (1 + exact["lse"].abs())).max().item()
    result["lse"] = {"relative": lse_err, "bound": LSE_TOLERANCE, "passed": lse_err <= LSE_TOLERANCE}
    return result


# --- One case, on every rank --------------------------------------------------------------------------


def _inputs(case: Case, device):
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case.name.encode()))
    dtype = DTYPES[case.dtype]

    def randn(heads):
        return torch.randn(case.batch, case.seqlen, heads, case.head_dim, generator=generator, device=device,
                           dtype=dtype)

    return randn(case.nheads), randn(case.nheads_kv), randn(case.nheads_kv), randn(case.nheads)


def _torch_context_parallel(q, k, v, dout, causal, mesh, seqlen):
    """torch's context parallelism on our zigzag shards (its head-tail load balancer's layout),
    with SDPA's flash backend routed to our kernels. Returns (out, (dq, dk, dv), kernel calls)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel

    from cute_flash import api, sdpa

    calls = {"forward": 0, "backward": 0}
    real = api.forward, api.backward
    real_support_issue = sdpa._support_issue

    def support_issue(*args):  # a call of the flash op that cute-flash hands back to torch's kernel
        issue = real_support_issue(*args)
        if issue is not None:
            calls[f"handed back: {issue}"] = calls.get(f"handed back: {issue}", 0) + 1
        return issue

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    # context_parallel shards the buffers it is given; ours are sharded already, so it gets a
    # stand-in of the global length, from which it also chooses its load balancer.
    positions = torch.zeros(1, 1, seqlen, device=q.device)
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]  # SDPA's (b, h, s, d)
    api.forward, api.backward = counted("forward", real[0]), counted("backward", real[1])
    sdpa._support_issue = support_issue
    # Flash alone: with the other backends enabled, the backend choice on DTensor inputs passed
    # torch's flash op by (on torch 2.11, 2026-11-27: no cute-flash call in any ring step).
    flash_only = torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION])
    try:
        with sdpa.enabled(), flash_only, context_parallel(mesh, buffers=[positions], buffer_seq_dims=[2]):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            grads = torch.autograd.grad(out, leaves, dout.transpose(1, 2))
    finally:
        api.forward, api.backward = real
        sdpa._support_issue = real_support_issue
    return out.transpose(1, 2), tuple(g.transpose(1, 2) for g in grads), calls


def run_case(case: Case, rank: int, world_size: int, device, mesh=None) -> dict | None:
    """Ring (or torch's context parallelism) on this rank's shards; on rank 0 the verdicts."""
    from cute_flash import api

    q, k, v, dout = _inputs(case, device)
    shards = [shard_sequence(t, 1, rank, world_size, case.layout) for t in (q, k, v, dout)]
    calls = None
    if case.torch_cp:
        local_out, local_grads, calls = _torch_context_parallel(*shards, case.causal, mesh, case.seqlen)
        local_lse = None
    else:
        leaves = [t.requires_grad_() for t in shards[:3]]
        local_out, local_lse = ring_flash_attn_func(*leaves, causal=case.causal, layout=case.layout, return_lse=True)
        local_grads = torch.autograd.grad((local_out * shards[3]).sum(), leaves)  # d/d out = dout, exactly
    ring = {name: gather_sequence(t.detach(), 1, layout=case.layout)
            for name, t in zip(("out", "dq", "dk", "dv"), (local_out, *local_grads))}
    if local_lse is not None:
        ring["lse"] = gather_sequence(local_lse, 2, layout=case.layout)
    all_calls = [None] * world_size
    dist.all_gather_object(all_calls, calls)
    if rank != 0:
        return None

    out, lse = api.forward(q, k, v, causal=case.causal)
    grads = api.backward(dout, q, k, v, out, lse, causal=case.causal)
    ours = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))
    pieces = 2 * world_size if case.layout == "zigzag" else world_size
    generator = torch.Generator().manual_seed(1 + zlib.crc32(case.name.encode()))
    rows = sample_rows(case.seqlen, case.seqlen // pieces, generator, device)
    keys = sample_rows(case.seqlen, case.seqlen // pieces, generator, device)
    scale = case.head_dim ** -0.5
    names = ("out", "lse", "dq", "dk", "dv")
    exact = dict(zip(names, sampled_attention(q, k, v, dout, rows, keys, scale, case.causal, exact=True)))
    same = dict(zip(names, sampled_attention(q, k, v, dout, rows, keys, scale, case.causal, exact=False)))

    def at(t: dict) -> dict:
        picked = {"out": t["out"][:, rows], "dq": t["dq"][:, rows], "dk": t["dk"][:, keys], "dv": t["dv"][:, keys]}
        if "lse" in t:
            picked["lse"] = t["lse"][:, :, rows]
        return picked

    ring_at, ours_at = at(ring), at(ours)
    if case.torch_cp:  # torch returns no lse: compare through ours, which the ring cases check
        ring_at["lse"] = ours_at["lse"]
    result = {"tensors": verdicts(ring_at, ours_at, exact, same)}
    if case.torch_cp:
        steps_ok = all(c == {"forward": world_size, "backward": world_size} for c in all_calls)
        result["kernel_calls"] = {"per_rank": all_calls, "passed": steps_ok}
    return result


# --- Processes ------------------------------------------------------------------------------------------


def _unavailable(case: Case) -> str | None:
    if not case.torch_cp:
        return None
    if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
        return f"torch {torch.__version__} has no flash-attention registry for cute_flash.sdpa"
    try:
        import torch.distributed.tensor.experimental as experimental
    except ImportError as error:
        return f"torch {torch.__version__} has no context_parallel ({error})"
    if not hasattr(experimental, "context_parallel"):
        return f"torch {torch.__version__} has no torch.distributed.tensor.experimental.context_parallel"
    return None


def run_all(rank: int, world_size: int, device, cases=CASES) -> dict:
    """Every case on this rank (process group initialized); rank 0 returns {case: verdict}."""
    mesh = None
    report = {}
    for case in cases:
        reason = _unavailable(case)
        if reason is not None:
            report[case.name] = {"unavailable": reason}
            continue
        if case.torch_cp and mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world_size,))
        started = time.monotonic()
        try:
            result = run_case(case, rank, world_size, device, mesh)
        except Exception:  # the same failure on every rank keeps the others in step
            result = {"error": traceback.format_exc()}
        if result is not None:
            result["seconds"] = round(time.monotonic() - started, 1)
            report[case.name] = result
        dist.barrier()
    return report


def keep_multicast_off() -> None:
    """NVLink multicast (NVLS) stays off (docs/distributed.md), before NCCL starts."""
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})


def _spawned(rank: int, world_size: int, store: str, results: str) -> None:
    keep_multicast_off()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=15))
    try:
        report = run_all(rank, world_size, device)
        if rank == 0:
            with open(results, "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


_reports: dict[int, dict | Exception] = {}


def _spawn_all(world_size: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "report.json")
        context = mp.spawn(_spawned, args=(world_size, os.path.join(folder, "store"), results),
                           nprocs=world_size, join=False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not context.join(timeout=10):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ring processes still running after {SPAWN_TIMEOUT_S} s")
        with open(results) as f:
            return json.load(f)


def report_for(world_size: int) -> dict:
    """Rank 0's report for `world_size` processes, run once per pytest session (a failure too:
    every case of that world size reports it without starting the processes again)."""
    if world_size not in _reports:
        try:
            _reports[world_size] = _spawn_all(world_size)
        except Exception as error:  # noqa: BLE001
            _reports[world_size] = error
    report = _reports[world_size]
    if isinstance(report, Exception):
        raise report
    return report


def failures(result: dict) -> list[str]:
    if "error" in result:
        return [result["error"]]
    bad = [f"{name}: {json.dumps(v)}" for name, v in result["tensors"].items() if not v["passed"]]
    if "kernel_calls" in result and not result["kernel_calls"]["passed"]:
        bad.append(f"our kernels were not called once per ring step: {result['kernel_calls']['per_rank']}")
    return bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=pytest.mark.multigpu(n), id=f"{n}gpus")
                                        for n in WORLD_SIZES])
def test_ring_matches_single_gpu_kernels(world_size, case):
    result = report_for(world_size)[case.name]
    if "unavailable" in result:
        pytest.skip(result["unavailable"])
    problems = failures(result)
    assert not problems, "\n".join(problems)


def main() -> int:
    """Under torchrun: every case on every rank, verdicts printed by rank 0."""
    keep_multicast_off()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=15))
    try:
        report = run_all(rank, world_size, device)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    failed = 0
    for name, result in report.items():
        problems = [] if "unavailable" in result else failures(result)
        failed += bool(problems)
        status = "unavailable: " + result["unavailable"] if "unavailable" in result else "FAIL" if problems else "ok"
        print(f"{world_size} GPUs  {name}: {status}  ({result.get('seconds', 0)} s)", flush=True)
        for line in problems:
            print("    " + line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
