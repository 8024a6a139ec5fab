"""The command line, CPU side: info, usage errors (one line, exit status 2, nothing compiled),
the order and progress of check, and check itself (a compile of real kernels for their targets)."""

import pytest
import torch

from cute_flash import cli


def run(argv, capsys):
    """cli.main's exit status, stdout and stderr; a usage error exits as argparse does."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "nvidia-cutlass-dsl 4.8.1" in out and "disk cache" in out


def test_version(capsys):
    from cute_flash import __version__

    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"cute-flash {__version__}"


@pytest.mark.parametrize("argv, message", [
    (["check", "--arch", "sm90"], "argument --arch: 'sm90' is not a target name: did you mean sm_90a?"),
    (["check", "--arch", "sm_90"], "did you mean sm_90a? (the Hopper kernels use wgmma"),
    (["warmup", "--arch", "sm80"], "did you mean sm_80?"),
    (["check", "--arch", "sm_100f"], "did you mean sm_100a?"),
    (["check", "--arch", "sm_75"], "the CuTe DSL cannot target sm_75: cute-flash needs an Ampere (sm_80) or newer GPU"),
    (["check", "--arch", "sm_70"], "the CuTe DSL cannot target sm_70"),
    (["check", "--arch", "sm_95"], "'sm_95' is not a target the CuTe DSL knows; use one of sm_80, sm_86"),
    (["check", "--arch", "hopper"], "'hopper' is not a GPU target; use one of sm_80"),
    (["check", "--head-dims", "100"], "argument --head-dims: head dim 100 is not supported: cute-flash computes "
                                      "multiples of 8 up to 256"),
    (["warmup", "--head-dims", "64,264"], "head dim 264 is not supported"),
    (["check", "--head-dims", "64,x"], "'x' is not a head dim"),
    (["export", "-o", "x", "--dtypes", "fp64"], "argument --dtypes: 'fp64' is not an element type"),
    (["check", "--dtypes", "int8"], "'int8' is not an element type: use bf16 (bfloat16), fp16 (float16, half) or fp32"),
    (["check", "--passes", "fwdbwd"], "'fwdbwd' is not a pass: use fwd, bwd, decode or a comma list of them"),
    (["check", "--jobs", "0"], "'0' is not a number of processes"),
    ([], "cute-flash: error: the following arguments are required: command"),
])
def test_usage_errors_are_one_line_with_exit_status_2(capsys, argv, message):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith("cute-flash") and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="warmup takes the visible GPU's target")
def test_warmup_without_a_gpu_asks_for_the_target(capsys):
    code, out, err = run(["warmup"], capsys)
    assert code == 2 and out == ""
    assert err == ("cute-flash warmup: error: no CUDA GPU visible: name the compile target, "
                   "e.g. --arch sm_90a (H100) or --arch sm_80 (A100)\n")


def test_warmup_with_the_disk_cache_off_says_so(capsys, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE", "0")
    code, _, err = run(["warmup", "--arch", "sm_80"], capsys)
    assert code == 2 and err == "cute-flash warmup: error: the disk cache is off (CUTE_FLASH_CACHE=0): nothing to warm\n"


@pytest.mark.parametrize("spelling, name, short", [
    ("bf16", "bfloat16", "bf16"), ("bfloat16", "bfloat16", "bf16"), ("BF16", "bfloat16", "bf16"),
    ("fp16", "float16", "fp16"), ("float16", "float16", "fp16"), ("half", "float16", "fp16"),
])
def test_every_command_takes_every_dtype_spelling(spelling, name, short):
    from cute_flash.perf import bench

    assert cli.build_parser().parse_args(["check", "--dtypes", spelling]).dtypes == [name]
    assert cli.build_parser().parse_args(["warmup", "--arch", "sm_80", "--dtypes", spelling]).dtypes == [name]
    assert bench.parse_args(["--suite", "quick", "--dtype", spelling]).dtype == short


def test_arguments_are_normalized():
    args = cli.build_parser().parse_args(["check", "--arch", "sm_90a", "--dtypes", "fp16,half,bf16",
                                          "--head-dims", "128, 64,128", "--passes", "bwd,fwd"])
    assert args.arch == "sm_90a" and args.dtypes == ["float16", "bfloat16"]
    assert args.head_dims == [128, 64] and args.passes == ["bwd", "fwd"]
    defaults = cli.build_parser().parse_args(["check"])
    assert defaults.arch == "sm_80" and defaults.dtypes == ["bfloat16", "float16"] and defaults.passes == ["fwd"]
    assert cli.build_parser().parse_args(["warmup"]).passes == ["fwd", "bwd"]


def fake_rows(variant, pass_name):
    dtype, head_dim, causal = variant
    label = f"{pass_name}/sm80/{dtype}/d{head_dim}/{'causal' if causal else 'full'}"
    return [(label, 1.0, 128, 49152, 0, {"mma.sync": 4})]


def test_check_prints_rows_in_listed_order_with_progress_on_stderr(capsys, monkeypatch):
    """Compiles finish in any order; rows come out in the order the variants are listed, each
    once those before it are done. Nothing is compiled: the worker pool is replaced."""

    def finished_backwards(jobs, work, arch, tasks):
        assert work is cli._check_one and arch == "sm_80"
        for index in reversed(range(len(tasks))):
            variant, pass_name = tasks[index]
            yield index, (RuntimeError("ptxas died") if variant[1] == 64 and variant[2] else fake_rows(variant, pass_name))

    monkeypatch.setattr(cli, "_finished", finished_backwards)
    code, out, err = run(["check", "--head-dims", "32,64", "--dtypes", "fp16", "--jobs", "1"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == [
        "fwd/sm80/float16/d32/full", "fwd/sm80/float16/d32/causal", "fwd/sm80/float16/d64/full", "fwd/float16/d64/causal"]
    assert "compile failed: RuntimeError: ptxas died  <-- FAIL" in lines[4]
    assert lines[-1].startswith("3 kernels, 1 with spills, missing instructions or failed compiles")
    progress = [line for line in err.splitlines() if " done, " in line]
    assert [line.split(" done")[0] for line in progress] == ["check: 1/4", "check: 2/4", "check: 3/4", "check: 4/4"]
    assert all("s elapsed" in line for line in progress)
    assert err.splitlines()[0] == "check: 4 variants for sm_80 in 1 processes"


@pytest.mark.parametrize("arch, family, instructions", [
    ("sm_80", "sm80", ("mma.sync", "ldmatrix", "cp.async")),
    ("sm_90a", "sm90", ("wgmma.mma_async", "cp.async.bulk.tensor")),
])
def test_check_reports_resources_and_instructions(capsys, arch, family, instructions):
    code = cli.main(["check", "--arch", arch, "--head-dims", "128", "--dtypes", "bf16", "--jobs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith("fwd/")]
    # causal and not; the sm90 family also launches short sequences persistently (another kernel;
    # d128's causal "short_2k" kernel is its short one, its non-causal one rescales O later)
    expected = 5 if family == "sm90" else 2
    assert len(rows) == expected and all(f"fwd/{family}/bfloat16/d128" in r for r in rows)
    assert sorted(r.split()[0] for r in rows if "/short" in r or "/mid" in r) == (
        ["fwd/sm90/bfloat16/d128/causal/short", "fwd/sm90/bfloat16/d128/full/short", "fwd/sm90/bfloat16/d128/full/short_2k"]
        if family == "sm90" else [])
    for row in rows:
        assert all(f"{ins}=" in row and f"{ins}=0" not in row for ins in instructions), row
        assert "FAIL" not in row
    assert f"{expected} kernels, 0 with spills, missing instructions or failed compiles" in out


def test_check_covers_the_backward_kernels(capsys):
    code = cli.main(["check", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "half", "--passes", "bwd", "--jobs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    labels = [line.split()[0] for line in out.splitlines() if line.startswith("bwd/")]
    # the listed order: the non-causal variant's kernels (main, then preprocess and postprocess
    # in kernel_builds' order), then the causal main kernel
    assert sorted(labels) == ["bwd/main/sm80/float16/d64/causal", "bwd/main/sm80/float16/d64/full",
                              "bwd/post/sm80/float16/d64", "bwd/pre/sm80/float16/d64"]
    assert labels[-1] == "bwd/main/sm80/float16/d64/causal"
    assert "mma.sync=" in out and "4 kernels, 0 with spills" in out


def test_check_covers_the_decode_kernels(capsys):
    """--passes decode: flash_attn_with_kvcache's kernels in each CTA shape dispatch may pick (the
    deep one only where the target holds it) and the split merge, reported once per head dim."""
    code = cli.main(["check", "--arch", "sm_80", "--head-dims", "128", "--dtypes", "bf16", "--passes", "decode",
                     "--jobs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    labels = [line.split()[0] for line in out.splitlines() if line.startswith("decode/")]
    assert sorted(labels) == sorted([f"decode/bfloat16/d128/{c}/{s}" for c in ("full", "causal")
                                     for s in ("default", "deep", "narrow", "keys", "deep-keys")] + [
        f"decode/combine/bfloat16/d128/{s}" for s in ("8-warps", "16-warps", "8-rows")])
    assert "mma.sync=" in out and "13 kernels, 0 with spills" in out

