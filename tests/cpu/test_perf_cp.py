"""The `cp` suite's bookkeeping on the CPU (perf/cp.py): arguments, FLOPs per rank from the ring's
step plan, derived rates, the table and the files. Timing needs GPUs and is not run here."""

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cute_flash.perf import cp
from cute_flash.perf.suites import Cell, attention_flops

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_suite():
    args = cp.parse_args(["--out", "x"])
    assert (args.dtype, args.nheads, args.nheads_kv, args.headdim, args.batch) == ("bf16", 32, 32, 128, 1)
    assert args.seqlens == (65536, 131072, 262144, 524288) and args.layout == "zigzag"
    cells = cp.cells_for(args)
    assert len(cells) == 4 * 2 * 2
    assert {(c.causal, c.pass_) for c in cells} == {(True, "fwd"), (True, "fwdbwd"), (False, "fwd"), (False, "fwdbwd")}


def test_options_narrow_the_cells():
    args = cp.parse_args(["--seqlens", "4096,8192", "--causal", "causal", "--passes", "fwd", "--nheads-kv", "8",
                          "--layout", "contiguous", "--dtype", "half"])
    assert [(c.seqlen, c.causal, c.pass_, c.nheads_kv) for c in cp.cells_for(args)] == [
        (4096, True, "fwd", 8), (8192, True, "fwd", 8)]
    assert args.dtype == "fp16"


@pytest.mark.parametrize("argv", [["--causal", "sometimes"], ["--passes", "bwd"], ["--seqlens", "64k"],
                                  ["--layout", "striped"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cp.parse_args(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("pass_", ["fwd", "fwdbwd"])
def test_zigzag_causal_flops_are_balanced_and_sum_to_the_bench_count(world_size, pass_):
    cell = cp.CpCell(65536, True, pass_)
    flops = cp.rank_flops(cell, world_size, "zigzag")
    assert len(set(flops)) == 1 and cp.imbalance(flops) == 1.0
    whole = attention_flops(Cell(1, 65536, 65536, 32, 32, 128, True), pass_)
    assert sum(flops) == pytest.approx(whole, rel=1e-12)
    assert cp.attention_flops(1, 32, 65536, 128, True, pass_) == whole


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_contiguous_causal_work_is_unbalanced(world_size):
    flops = cp.rank_flops(cp.CpCell(65536, True, "fwd"), world_size, "contiguous")
    assert flops == sorted(flops) and cp.imbalance(flops) == pytest.approx((2 * world_size - 1) / world_size)
    full = cp.rank_flops(cp.CpCell(65536, False, "fwd"), world_size, "contiguous")
    assert cp.imbalance(full) == 1.0 and sum(full) == pytest.approx(2 * sum(flops), rel=1e-12)


def test_derived_rates():
    row = {"flops": 8e15, "share_flops": 1e15, "ring_ms": 2000.0, "share_ms": 2500.0, "full_ms": 7000.0,
           "compute_ms": 1800.0}
    d = cp.derived(row, 4)
    assert d["ring_tflops_per_gpu"] == pytest.approx(1000.0)  # 8e15 / 4 GPUs / 2 s
    assert d["share_tflops"] == pytest.approx(400.0)
    assert d["vs_share"] == pytest.approx(2.5)
    assert d["scaling_efficiency"] == pytest.approx(7000 / (4 * 2000))
    assert d["overlap"] == pytest.approx(0.9)
    missing = cp.derived({"flops": 1.0, "share_flops": 1.0}, 2)
    assert all(value is None for value in missing.values())


def fake_doc(complete=True):
    args = cp.parse_args(["--seqlens", "65536"])
    facts = {"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "git": {"commit": "abc1234", "dirty": False},
             "versions": {}, "environment": {}}
    doc = cp.new_doc(args, 4, facts, datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc))
    ok = {"seqlen": 65536, "causal": True, "pass": "fwd", "imbalance": 1.0, "status": "ok", "flops": 8e15,
          "share_flops": 1e15, "ring_ms": 2000.0, "share_ms": 2500.0, "compute_ms": 1900.0}
    failed = {"seqlen": 65536, "causal": False, "pass": "fwdbwd", "imbalance": 1.0, "status": "oom", "flops": 1.0,
              "share_flops": 1.0}
    doc["rows"] = [{**ok, **cp.derived(ok, 4)}, {**failed, **cp.derived(failed, 4)}]
    doc["complete"] = complete
    return doc


def test_markdown_table():
    table = cp.markdown_table(fake_doc())
    lines = table.splitlines()
    assert lines[0] == "# cp suite: 4 × NVIDIA H100 80GB HBM3, zigzag layout, bf16, H=32 D=128"
    assert lines[2].startswith("| S | mask | pass | ring ms | per-GPU TFLOP/s |")
    assert lines[4] == "| 64k | causal | fwd | 2000.0 | 1000 | 400 | 2.50 | — | — | 0.95 | 1.00 | ok |"
    assert lines[5].endswith("| — | — | — | — | — | — | — | 1.00 | oom |")
    assert "incomplete" not in table and "incomplete" in cp.markdown_table(fake_doc(complete=False))


def test_files(tmp_path):
    doc = fake_doc()
    stem = cp.doc_stem(doc)
    assert stem == "cp-nvidia-h100-80gb-hbm3-x4-zigzag-20261201-abc1234"
    json_path, md_path = cp.write(doc, tmp_path / "out", stem)
    assert json.loads(json_path.read_text())["rows"][0]["vs_share"] == pytest.approx(2.5)
    assert md_path.read_text() == cp.markdown_table(doc)


def test_launch_mode():
    assert cp.launched_by_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not cp.launched_by_torchrun({"RANK": "0"})


def test_runs_as_a_script():
    """`python perf/cp.py` (no package context) finds its imports through the installed package."""
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "cp.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--full-max-seqlen" in proc.stdout


def test_perf_module_dispatches_cp():
    from cute_flash.perf.__main__ import main as perf_main

    with pytest.raises(SystemExit) as exit_:
        perf_main(["cp", "--help"])
    assert exit_.value.code == 0


def test_multicast_stays_off():
    environ = {"NCCL_NVLS_ENABLE": "1"}
    cp.keep_multicast_off(environ)
    assert environ == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_the_whole_loop_runs_in_one_cpu_process(tmp_path, monkeypatch):
    """run() end to end on the CPU: one gloo rank, the float64 stand-ins for the kernels (the ring's
    steps and flash_attn_func's), tiny shapes; the numbers mean nothing, the bookkeeping is real."""
    import torch
    import torch.distributed as dist

    from cute_flash import distributed

    from .reference_kernels import install

    install(monkeypatch)
    monkeypatch.setattr(cp, "DEVICE", "cpu")
    monkeypatch.setattr(cp, "DTYPES", {"bf16": torch.float32})
    monkeypatch.setattr(cp, "machine_facts", lambda: {"gpu": {"name": "cpu"}, "git": {"commit": "test"},
                                                      "versions": {}, "environment": {}})
    monkeypatch.setattr(distributed, "_step_kernels", None)  # through cute_flash.api, as on the GPU
    args = cp.parse_args(["--out", str(tmp_path), "--seqlens", "32,48", "--nheads", "2", "--headdim", "8",
                          "--reps", "2", "--warmup", "0", "--full-max-seqlen", "32"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cp.run(0, 1, args)
    finally:
        dist.destroy_process_group()
    (json_path,) = tmp_path.glob("cp-cpu-x1-zigzag-*-test.json")
    doc = json.loads(json_path.read_text())
    assert doc["complete"] and len(doc["rows"]) == 2 * 2 * 2
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        assert row["ring_ms"] > 0 and row["compute_ms"] > 0 and row["share_ms"] > 0
        assert ("full_ms" in row) == (row["seqlen"] == 32)
        assert row["ring_tflops_per_gpu"] > 0 and row["vs_share"] > 0
    assert (tmp_path / json_path.name.replace(".json", ".md")).read_text() == cp.markdown_table(doc)
