
import pytest
import torch


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


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
