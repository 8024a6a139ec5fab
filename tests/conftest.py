import os
import zlib

import pytest
import torch

REQUIRE_GPU = "CUTE_FLASH_REQUIRE_GPU"
"""Set to 1 on a GPU machine (scripts/gpu-validate.sh does): a skipped GPU test then fails, so a
run where every GPU test skipped (a CPU build of torch, a missing DSL) cannot pass as a green one."""


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"{torch.cuda.get_device_name()} is older than sm_80"
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "nvidia-cutlass-dsl is not installed"
    return None


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU, "0") not in ("", "0", "false", "no", "off")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _deselect_multi_gpu(config, items) -> None:
    """Tests marked `multigpu(n)` are left out (deselected, not skipped) where fewer than n GPUs
    are visible: a single-GPU run with CUTE_FLASH_REQUIRE_GPU set stays green without them, and a
    machine with n GPUs runs them (where a skip inside one does count as a failure)."""
    count, kept, dropped = None, [], []
    for item in items:
        marker = item.get_closest_marker("multigpu")
        if marker is not None:
            count = _gpu_count() if count is None else count
            if count < (marker.args[0] if marker.args else 2):
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_modifyitems(config, items):
    _deselect_multi_gpu(config, items)
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With CUTE_FLASH_REQUIRE_GPU set, any skip of a GPU test (the marker above, a skipif, a
    pytest.skip inside the test) is reported as a failure carrying the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and gpu_required() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_GPU} is set but this GPU test was skipped: {reason}"


@pytest.fixture(autouse=True)
def _seed_from_node_id(request):
    """Every test draws its own, reproducible random inputs: the seed is a hash of its node id
    (path, name and parameters), stable across runs and machines."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty disk cache for one test."""
    from cute_flash import cache

    folder = tmp_path / "cache"
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(folder))
    monkeypatch.setenv("CUTE_FLASH_CACHE", "1")
    cache.clear_memory()
    yield folder
    cache.clear_memory()
