"""Ring attention (cute_flash/distributed.py) without a GPU: the step plan, the sharding helpers
and the typed errors in this process; the ring itself in 2 and 4 processes on the gloo backend,
with float64 stand-ins for the kernels (tests/cpu/reference_kernels.py), against the float64
reference on the unsharded sequence: out, lse, dq, dk, dv, for causal and not, both layouts,
grouped-query heads and rings over subgroups. The multi-GPU test's harness
(tests/gpu/test_distributed.py: sharding, gathering, references on sampled rows, verdicts) runs
here too, in 16-bit dtypes with the stand-ins, so that it is known to work before a GPU sees it."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import types
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cute_flash
from cute_flash import distributed, reference_attention
from cute_flash.distributed import (
    RingBlock,
    gather_sequence,
    ring_flash_attn_func,
    ring_steps,
    shard_sequence,
    unshard_sequence,
    zigzag_shard,
    zigzag_unshard,
)
from cute_flash.errors import ErrorCode

from tests.gpu import test_distributed as gpu_harness

from .reference_kernels import ReferenceKernels
from .typed_errors import expect

TOLERANCE = 1e-6
"""Float64 throughout, except the LSE, which is float32 as the kernels keep it: P = exp(S - lse)
then errs by ~1e-7 relative in the backward (and so do outputs merged by it)."""


@pytest.fixture
def stand_ins(monkeypatch):
    kernels = ReferenceKernels()
    monkeypatch.setattr(distributed, "_step_kernels", kernels)
    return kernels


# --- The step plan --------------------------------------------------------------------------------


def covered_pairs(world_size: int, chunk: int, layout: str, causal: bool) -> list[tuple[int, int]]:
    """Every (global query, global key) pair the plan computes, over all ranks and steps."""
    positions = torch.arange(2 * world_size * chunk if layout == "zigzag" else world_size * chunk)
    shards = [shard_sequence(positions, 0, r, world_size, layout).tolist() for r in range(world_size)]
    local = len(shards[0])
    pairs = []
    for rank in range(world_size):
        for step, block in enumerate(ring_steps(rank, world_size, local, layout, causal)):
            if block is None:
                continue
            source = shards[(rank - step) % world_size]
            for i in range(block.q_start, block.q_stop):
                for j in range(block.k_start, block.k_stop):
                    if not block.causal or j <= i:
                        pairs.append((shards[rank][i], source[j]))
    return pairs


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_the_plan_computes_each_visible_pair_once(world_size, layout, causal):
    chunk = 3
    pairs = covered_pairs(world_size, chunk, layout, causal)
    length = (2 if layout == "zigzag" else 1) * world_size * chunk
    expected = [(i, j) for i in range(length) for j in range(length) if not causal or j <= i]
    assert sorted(pairs) == expected


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_balances_causal_work_at_every_step(world_size):
    local = 2 * 5
    plans = [ring_steps(r, world_size, local, "zigzag", True) for r in range(world_size)]
    assert all(block is not None for plan in plans for block in plan)
    for step in range(world_size):
        assert len({plan[step].work for plan in plans}) == 1, f"step {step}: {[plan[step] for plan in plans]}"
    assert plans[0][0] == RingBlock(0, 10, 0, 10, True)
    assert plans[1][1] == RingBlock(0, 10, 0, 5, False)  # holds rank 0's shard: its first chunk only
    assert plans[0][1] == RingBlock(5, 10, 0, 10, False)  # holds rank W-1's shard: our later chunk only


def test_contiguous_causal_work_grows_with_the_rank():
    plans = [ring_steps(r, 4, 6, "contiguous", True) for r in range(4)]
    assert [sum(b is not None for b in plan) for plan in plans] == [1, 2, 3, 4]


# --- Sharding helpers --------------------------------------------------------------------------------


def test_zigzag_shards_hold_chunks_r_and_2w_minus_1_minus_r():
    x = torch.arange(16).view(1, 16)
    assert zigzag_shard(x, 1, 0, 4).tolist() == [[0, 1, 14, 15]]
    assert zigzag_shard(x, 1, 3, 4).tolist() == [[6, 7, 8, 9]]
    assert shard_sequence(x, 1, 1, 4, "contiguous").tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_unshard_inverts_shard(layout):
    x = torch.randn(2, 24, 3, 4)
    for world_size in (1, 2, 3, 4):
        shards = [shard_sequence(x, 1, r, world_size, layout) for r in range(world_size)]
        assert torch.equal(unshard_sequence(shards, 1, layout), x)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, 1, r, 3) for r in range(3)], 1), x)


def test_sharding_errors_are_typed():
    x = torch.randn(1, 12, 2, 8)
    message = expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, zigzag_shard, x, 1, 0, 4)
    assert "multiple of 8" in message
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, shard_sequence, x, 1, 0, 5, "contiguous")
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, shard_sequence, x, 1, 2, 2)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, shard_sequence, x, 1, 0, 2, "striped")
    expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, unshard_sequence, [x, x[:, :6]], 1)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, zigzag_unshard, [x[:, :5]] * 2, 1)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, unshard_sequence, [], 1)


# --- One process (no process group): plain attention, and the typed errors ---------------------------


def qkv(seqlen=12, nheads=4, nheads_kv=2, head_dim=8, dtype=torch.float64, seqlen_k=None):
    q = torch.randn(2, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (torch.randn(2, seqlen_k or seqlen, nheads_kv, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_without_a_process_group_it_is_plain_attention(stand_ins, layout, causal):
    q, k, v = (t.requires_grad_() for t in qkv())
    out, lse = ring_flash_attn_func(q, k, v, causal=causal, layout=layout, softmax_scale=0.4, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=0.4, causal=causal)
    torch.testing.assert_close(out, ref_out, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=TOLERANCE, atol=TOLERANCE)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref_out, (q, k, v), dout)):
        torch.testing.assert_close(got, ref, rtol=TOLERANCE, atol=TOLERANCE)
    assert [c["softmax_scale"] for c in stand_ins.backward_calls] == [0.4]


def test_deterministic_reaches_every_step(stand_ins):
    q, k, v = (t.requires_grad_() for t in qkv())
    ring_flash_attn_func(q, k, v, causal=True, deterministic=True).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        ring_flash_attn_func(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    ring_flash_attn_func(q, k, v).sum().backward()
    assert [c["deterministic"] for c in stand_ins.backward_calls] == [True, True, False]


def test_merge_keeps_rows_no_key_has_reached_at_zero():
    """The LSE merge in float32, with rows at lse = -inf on one side or both (exp(-inf - -inf) is nan)."""
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.tensor([[[float("-inf"), float("-inf"), 0.0]]])
    block_out = torch.tensor([[[[1.0, 2.0]], [[5.0, 5.0]], [[3.0, 4.0]]]])
    block_lse = torch.tensor([[[float("-inf"), 0.0, 0.0]]])
    out[0, 2, 0] = torch.tensor([1.0, 0.0])
    distributed._merge(out, lse, block_out, block_lse)
    assert torch.equal(out[0, :, 0], torch.tensor([[0.0, 0.0], [5.0, 5.0], [2.0, 2.0]]))
    assert torch.isneginf(lse[0, 0, 0]) and lse[0, 0, 1] == 0
    assert torch.isclose(lse[0, 0, 2], torch.log(torch.tensor(2.0)))


def test_ring_errors_are_typed_and_raised_before_any_message(stand_ins):
    q, k, v = qkv()
    message = expect(ErrorCode.INVALID_DIMENSION, cute_flash.UnsupportedArgumentError, ring_flash_attn_func, q, k, v,
                     layout="striped")
    assert "'zigzag'" in message and "'contiguous'" in message
    odd = qkv(seqlen=7)
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, ring_flash_attn_func, *odd, causal=True)
    ring_flash_attn_func(*odd, causal=True, layout="contiguous")  # any length is a contiguous shard
    uneven = qkv(seqlen=6, seqlen_k=8)
    expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, ring_flash_attn_func, *uneven, causal=True)
    ring_flash_attn_func(*uneven, causal=False)  # cross-attention shards are fine without the mask
    expect(ErrorCode.DIMENSION_MISMATCH, cute_flash.DimensionMismatchError, ring_flash_attn_func, *qkv(nheads=3))
    expect(ErrorCode.INVALID_DIMENSION, cute_flash.InvalidDimensionError, ring_flash_attn_func, q, k, v, causal="yes")
    assert stand_ins.forward_calls[0]["q"].shape[1] == 7 and len(stand_ins.forward_calls) == 2


def test_the_kernels_rules_apply_without_stand_ins():
    q, k, v = qkv(dtype=torch.float32)
    expect(ErrorCode.CUDA_ERROR, cute_flash.CudaError, ring_flash_attn_func, q.bfloat16(), k.bfloat16(), v.bfloat16())
    expect(ErrorCode.UNSUPPORTED_DTYPE, cute_flash.UnsupportedDtypeError, ring_flash_attn_func, q.double(), k.double(),
           v.double())


# --- The ring, in 2 and 4 processes -------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    causal: bool
    layout: str
    nheads: int = 4
    nheads_kv: int = 4
    chunk: int = 3  # rows per chunk: a zigzag shard holds two
    softmax_scale: float | None = None
    subgroups: bool = False  # rings over ranks {0, 1} and {2, 3}, each with its own sequence


CASES = [
    Case("zigzag-causal", True, "zigzag"),
    Case("zigzag-causal-gqa", True, "zigzag", nheads_kv=2, softmax_scale=0.3),
    Case("zigzag-mqa", False, "zigzag", nheads_kv=1),
    Case("contiguous-causal-gqa", True, "contiguous", nheads_kv=2, chunk=5),
    Case("contiguous", False, "contiguous", chunk=4),
    Case("subgroups-zigzag-causal", True, "zigzag", nheads_kv=2, subgroups=True),
]
WORLD_SIZES = (2, 4)


def cases_for(world_size: int) -> list[Case]:
    return [c for c in CASES if not c.subgroups or world_size == 4]


def _errors(name, got, expected) -> list[str]:
    err = (got.double() - expected.double()).abs().max().item()
    return [] if err <= TOLERANCE * (1 + expected.abs().max().item()) else [f"{name}: max error {err:.3e}"]


def run_case(case: Case, rank: int, world_size: int, groups: dict) -> dict:
    """This rank's view of one case: error messages (empty: passed) and the work of its steps."""
    kernels = distributed._step_kernels = ReferenceKernels()
    group, ring_rank, ring_size = None, rank, world_size
    if case.subgroups:
        group, ring_rank, ring_size = groups[rank // 2], rank % 2, 2
    pieces = 2 * ring_size if case.layout == "zigzag" else ring_size
    torch.manual_seed(zlib.crc32(case.name.encode()) + (rank // 2 if case.subgroups else 0))  # one sequence per ring
    full = [torch.randn(2, pieces * case.chunk, h, 8, dtype=torch.float64)
            for h in (case.nheads, case.nheads_kv, case.nheads_kv, case.nheads)]
    q, k, v, dout = (shard_sequence(t, 1, ring_rank, ring_size, case.layout) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ring_flash_attn_func(q, k, v, group=group, causal=case.causal, softmax_scale=case.softmax_scale,
                                    layout=case.layout, return_lse=True)
    # Scalar losses: autograd.grad with explicit grad_outputs imports sympy, a second of CPU time
    # in every process.
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))

    leaves = [t.clone().requires_grad_() for t in full[:3]]
    ref_out, ref_lse = reference_attention(*leaves, softmax_scale=case.softmax_scale, causal=case.causal)
    ref_grads = torch.autograd.grad((ref_out * full[3]).sum(), leaves)
    mine = lambda t, dim=1: shard_sequence(t, dim, ring_rank, ring_size, case.layout)  # noqa: E731
    errors = _errors("out", out, mine(ref_out)) + _errors("lse", lse, mine(ref_lse, 2))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors += _errors(name, got, mine(ref))
    errors += _errors("gathered out", gather_sequence(out.detach(), 1, group, case.layout), ref_out)
    return {"errors": errors,
            "forward_work": [c["q"].shape[1] * c["k"].shape[1] for c in kernels.forward_calls],
            "backward_calls": len(kernels.backward_calls)}


HARNESS_CASES = [
    gpu_harness.Case("bf16-causal-zigzag-gqa", "bf16", 32, 4, 2, True, "zigzag", seqlen=128, batch=1),
    gpu_harness.Case("fp16-causal-contiguous", "fp16", 16, 2, 2, True, "contiguous", seqlen=96, batch=2),
    gpu_harness.Case("bf16-zigzag-mqa", "bf16", 16, 4, 1, False, "zigzag", seqlen=64, batch=1),
]


def _gpu_harness_dry_run(rank: int, world_size: int) -> dict | None:
    """The GPU test's cases, shrunk, on the CPU: the stand-ins serve the ring and the single-process
    comparison, for which the GPU test imports `cute_flash.api`. This process gets a stand-in
    module of that name instead of the real one, whose import (the CuTe DSL's) costs more CPU
    time than the whole dry run."""
    kernels = distributed._step_kernels = ReferenceKernels()
    api = types.ModuleType("cute_flash.api")
    api.forward, api.backward = kernels.forward, kernels.backward
    sys.modules["cute_flash.api"] = api
    report = gpu_harness.run_all(rank, world_size, torch.device("cpu"), HARNESS_CASES)
    return report if rank == 0 else None


def _worker(rank: int, world_size: int, store: str, results: str) -> None:
    torch.set_num_threads(1)  # several processes share the machine's few cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    # Every rank creates every group, in the same order, as torch.distributed requires.
    groups = {0: dist.new_group([0, 1]), 1: dist.new_group([2, 3])} if world_size == 4 else {}
    report = {}
    try:
        for case in cases_for(world_size):
            try:
                report[case.name] = run_case(case, rank, world_size, groups)
            except Exception:  # recorded per case; the same failure on every rank keeps the ring in step
                report[case.name] = {"errors": [traceback.format_exc()]}
        if world_size == 2:
            report["gpu harness"] = _gpu_harness_dry_run(rank, world_size)
        # A rejected call raises on every rank before any message; the ring is still usable after it.
        distributed._step_kernels = ReferenceKernels()
        odd = torch.zeros(1, 3, 2, 8, dtype=torch.float64)
        try:
            ring_flash_attn_func(odd, odd, odd, causal=True)
            report["typed error"] = "no error"
        except cute_flash.InvalidDimensionError as error:
            report["typed error"] = type(error).__name__
        report["after the typed error"] = run_case(CASES[0], rank, world_size, groups)
        dist.barrier()
    finally:
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_reports(tmp_path_factory):
    """{world size: [each rank's report]}: one set of processes per world size, running every case."""
    reports = {}
    for world_size in WORLD_SIZES:
        folder = tmp_path_factory.mktemp(f"ring{world_size}")
        mp.spawn(_worker, args=(world_size, str(folder / "store"), str(folder)), nprocs=world_size, join=True)
        reports[world_size] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]
    return reports


@pytest.mark.parametrize("world_size, case", [(w, c) for w in WORLD_SIZES for c in cases_for(w)],
                         ids=lambda p: p.name if isinstance(p, Case) else f"{p}procs")
def test_ring_matches_the_reference_on_the_whole_sequence(ring_reports, world_size, case):
    for rank, report in enumerate(ring_reports[world_size]):
        result = report[case.name]
        assert not result["errors"], f"rank {rank}: " + "\n".join(result["errors"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_work_follows_the_plan(ring_reports, world_size):
    """Zigzag causal: every rank runs the kernels at every step, with equal work per step;
    contiguous causal: rank r runs r + 1 steps."""
    reports = ring_reports[world_size]
    zigzag = [r["zigzag-causal"] for r in reports]
    local = 2 * 3
    assert all(z["forward_work"] == [local * local] + [local * local // 2] * (world_size - 1) for z in zigzag)
    assert all(z["backward_calls"] == world_size for z in zigzag)
    contiguous = [r["contiguous-causal-gqa"]["backward_calls"] for r in reports]
    assert contiguous == list(range(1, world_size + 1))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_rejects_bad_shards_on_every_rank_and_stays_usable(ring_reports, world_size):
    assert [r["typed error"] for r in ring_reports[world_size]] == ["InvalidDimensionError"] * world_size
    assert all(not r["after the typed error"]["errors"] for r in ring_reports[world_size])


def test_gpu_harness_runs_and_measures_sensible_errors(ring_reports):
    """Not the GPU test's bar (16-bit stand-ins on sequences of 64 to 128 rows make errors of one
    or two roundings, which twice torch's error need not cover), but a sane measurement: a wrong
    gather or a wrong sampled reference shows as errors of order one."""
    report = ring_reports[2][0]["gpu harness"]
    assert set(report) == {c.name for c in HARNESS_CASES}
    for name, result in report.items():
        assert "error" not in result, result.get("error")
        tensors = result["tensors"]
        assert set(tensors) == {"out", "lse", "dq", "dk", "dv"}
        assert tensors["lse"]["passed"], (name, tensors["lse"])
        for tensor in ("out", "dq", "dk", "dv"):
            v = tensors[tensor]
            assert 0 < v["torch_same_dtype"] < 0.1, (name, tensor, v)
            assert max(v["vs_float64"], v["vs_ours"]) <= 4 * v["torch_same_dtype"], (name, tensor, v)


@pytest.mark.parametrize("causal", [False, True])
def test_gpu_harness_sampled_reference_is_exact(causal):
    """tests/gpu/test_distributed.py's float64 reference on sampled rows, against float64
    autograd through reference_attention on the whole sequence."""
    q, k, v = (t.requires_grad_() for t in qkv(seqlen=40, nheads=4, nheads_kv=2, head_dim=8))
    dout = torch.randn(2, 40, 4, 8, dtype=torch.float64)
    rows, keys = torch.tensor([0, 3, 17, 39]), torch.tensor([1, 20, 38, 39])
    out, lse, dq, dk, dv = gpu_harness.sampled_attention(q.detach(), k.detach(), v.detach(), dout, rows, keys, 0.35,
                                                         causal, exact=True)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=0.35, causal=causal)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out, (q, k, v), dout)
    for got, ref in ((out, ref_out[:, rows]), (lse, ref_lse[:, :, rows]), (dq, ref_dq[:, rows]),
                     (dk, ref_dk[:, keys]), (dv, ref_dv[:, keys])):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
