"""The command line, CPU side: info and check (a compile of real kernels for their targets)."""

import pytest

from cute_flash import cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "nvidia-cutlass-dsl 4.8.1" in out and "disk cache" in out


@pytest.mark.parametrize("arch, family, instructions", [
    ("sm_80", "sm80", ("mma.sync", "ldmatrix", "cp.async")),
    ("sm_90a", "sm90", ("wgmma.mma_async", "cp.async.bulk.tensor")),
])
def test_check_reports_resources_and_instructions(capsys, arch, family, instructions):
    code = cli.main(["check", "--arch", arch, "--head-dims", "128", "--dtypes", "bfloat16", "--jobs", "2"])
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
    assert f"{expected} kernels, 0 with spills or missing instructions" in out


def test_check_covers_the_backward_kernels(capsys):
    code = cli.main(["check", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "float16", "--passes", "bwd", "--jobs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    labels = sorted(line.split()[0] for line in out.splitlines() if line.startswith("bwd/"))
    assert labels == ["bwd/main/sm80/float16/d64/causal", "bwd/main/sm80/float16/d64/full",
                      "bwd/post/sm80/float16/d64", "bwd/pre/sm80/float16/d64"]
    assert "mma.sync=" in out and "4 kernels, 0 with spills" in out
