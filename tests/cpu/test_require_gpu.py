"""CUTE_FLASH_REQUIRE_GPU (tests/conftest.py): a skipped GPU test fails the run, a skipped CPU test
does not. Checked on a small suite run by a separate pytest that loads the same hooks."""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SUITE = '''
import pytest


@pytest.mark.gpu
def test_gpu_skipped_inside():
    pytest.skip("no device for this case")


@pytest.mark.gpu
def test_gpu_runs():
    pass


def test_cpu_skipped_inside():
    pytest.skip("not on this platform")
'''


MULTI_GPU_SUITE = '''
import pytest


@pytest.mark.gpu
@pytest.mark.multigpu(4096)
def test_needs_more_gpus_than_any_host():
    pass
'''


def run_suite(tmp_path, require, suite=SUITE):
    """(exit code, {test name: outcome}) of the small suite, with the switch set as given."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    multigpu(n): needs n GPUs\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(suite))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUTE_FLASH_REQUIRE_GPU": "1" if require else "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=report.xml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    outcomes = {}
    for case in ET.parse(tmp_path / "report.xml").getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = "failed" if {"failure", "error"} & set(kinds) else kinds[0] if kinds else "passed"
    return proc.returncode, outcomes, proc.stdout


def gpu_test_outcome():
    """What test_gpu_runs gives without the switch: skipped on a machine the GPU tests skip on."""
    from tests.conftest import _gpu_reason

    return "skipped" if _gpu_reason() else "passed"


def test_without_the_switch_gpu_skips_pass(tmp_path):
    code, outcomes, output = run_suite(tmp_path, require=False)
    assert code == 0, output
    assert outcomes == {"test_gpu_skipped_inside": "skipped", "test_gpu_runs": gpu_test_outcome(),
                        "test_cpu_skipped_inside": "skipped"}


def test_with_the_switch_gpu_skips_fail(tmp_path):
    code, outcomes, output = run_suite(tmp_path, require=True)
    assert code == 1, output
    expected_gpu = "failed" if gpu_test_outcome() == "skipped" else "passed"
    assert outcomes == {"test_gpu_skipped_inside": "failed", "test_gpu_runs": expected_gpu,
                        "test_cpu_skipped_inside": "skipped"}
    assert "CUTE_FLASH_REQUIRE_GPU is set but this GPU test was skipped" in output


@pytest.mark.parametrize("value, required", [("1", True), ("0", False), ("", False), ("yes", True)])
def test_switch_values(monkeypatch, value, required):
    from tests.conftest import gpu_required

    monkeypatch.setenv("CUTE_FLASH_REQUIRE_GPU", value)
    assert gpu_required() is required


def test_multi_gpu_tests_are_deselected_not_skipped_on_smaller_hosts(tmp_path):
    """A test that needs more GPUs than the host has is left out before it runs: with the switch
    on, a single-GPU run stays green (tests/gpu/test_distributed.py relies on this)."""
    code, outcomes, output = run_suite(tmp_path, require=True, suite=MULTI_GPU_SUITE)
    assert code == 5, output  # pytest's "no tests ran"
    assert outcomes == {} and "1 deselected" in output
