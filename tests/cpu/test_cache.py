"""The compiled-kernel cache: memory, disk, atomic writes, locking, corruption, second process."""

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cute_flash import cache

from . import tiny_kernel

ARCH = "sm_80"


def entry_files(folder: Path):
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".o", ".json"))


def child_lookup(env):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cpu.tiny_kernel"], capture_output=True, text=True, env=env,
        cwd=Path(__file__).parents[2], timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def counts(monkeypatch):
    fresh = {k: 0 for k in cache.stats}
    monkeypatch.setattr(cache, "stats", fresh)
    return fresh


def test_memory_then_disk_then_compile(cache_dir, counts):
    first = cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts["compiled"] == 1
    assert cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH) is first
    names = entry_files(cache_dir)
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".o")
    meta = json.loads(next(cache_dir.rglob("*.json")).read_text())
    assert meta["key"] == repr((ARCH,) + tiny_kernel.KEY) and len(meta["sha256"]) == 64
    cache.clear_memory()
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts == {"compiled": 1, "loaded_from_disk": 1, "rebuilt_corrupt": 0}


def test_key_arch_and_namespace_separate_entries(cache_dir, counts):
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), "sm_80")
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), "sm_90a")
    cache.get_or_compile(tiny_kernel.KEY[:-1] + (32,), tiny_kernel.build(32), "sm_80")
    assert counts["compiled"] == 3
    (folder,) = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert folder.name == cache.namespace() and "dsl-4.8.1" in folder.name


def test_corrupted_entry_is_detected_and_rebuilt(cache_dir, counts):
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    (obj,) = cache_dir.rglob("*.o")
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    cache.clear_memory()
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts == {"compiled": 2, "loaded_from_disk": 0, "rebuilt_corrupt": 1}
    cache.clear_memory()
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts["loaded_from_disk"] == 1


def test_truncated_sidecar_is_rebuilt(cache_dir, counts):
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    (meta,) = cache_dir.rglob("*.json")
    meta.write_text(meta.read_text()[:10])
    cache.clear_memory()
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts["rebuilt_corrupt"] == 1 and counts["compiled"] == 2


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "entry.o"
    cache._atomic_write(target, b"old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        cache._atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.o"]


def test_disabled_disk_cache_writes_nothing(cache_dir, counts, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE", "0")
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts["compiled"] == 1 and not cache_dir.exists()


def test_second_process_loads_without_compiling(cache_dir):
    env = {**os.environ, "CUTE_FLASH_CACHE_DIR": str(cache_dir)}
    cold = child_lookup(env)
    warm = child_lookup(env)
    assert cold["compiled"] == 1 and cold["loaded_from_disk"] == 0
    assert warm["compiled"] == 0 and warm["loaded_from_disk"] == 1


def _look_up_after_barrier(barrier, build_seconds, results):
    """One of several processes: wait for all, then look the kernel up with a build slowed down so
    that the first compiler still holds the entry's lock when the others ask for it."""
    build = tiny_kernel.build()

    def slow_build():
        time.sleep(build_seconds)
        return build()

    barrier.wait(timeout=300)
    started = time.time()
    cache.get_or_compile(tiny_kernel.KEY, slow_build, ARCH)
    results.put({**cache.stats, "started": started, "finished": time.time()})


def test_concurrent_processes_compile_once(cache_dir):
    """Three processes ask for one kernel at the same moment: the file lock lets one compile and
    the others load its entry (without the lock all three would compile). The timestamps prove
    that every process asked before the first one had finished."""
    context = multiprocessing.get_context("spawn")  # the DSL does not survive fork()
    parties, build_seconds = 3, 3.0
    barrier, results = context.Barrier(parties), context.Queue()
    processes = [context.Process(target=_look_up_after_barrier, args=(barrier, build_seconds, results))
                 for _ in range(parties)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert max(r["started"] for r in reports) < min(r["finished"] for r in reports), "the lookups did not overlap"
    assert sum(r["compiled"] for r in reports) == 1
    assert sum(r["loaded_from_disk"] for r in reports) == parties - 1


def test_entry_that_fails_to_load_is_rebuilt(cache_dir, counts):
    """Bytes that match their checksum but do not load (not an object file) count as damaged:
    the entry is rebuilt, and the rebuilt one loads."""
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    (obj,), (meta,) = cache_dir.rglob("*.o"), cache_dir.rglob("*.json")
    garbage = b"\x7fELF but not an object file" * 64
    obj.write_bytes(garbage)
    info = json.loads(meta.read_text())
    meta.write_text(json.dumps({**info, "sha256": hashlib.sha256(garbage).hexdigest()}))
    cache.clear_memory()
    assert cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH) is not None
    assert counts == {"compiled": 2, "loaded_from_disk": 0, "rebuilt_corrupt": 1}
    rebuilt = json.loads(meta.read_text())["sha256"]
    assert rebuilt == hashlib.sha256(obj.read_bytes()).hexdigest() != hashlib.sha256(garbage).hexdigest()
    cache.clear_memory()
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts["loaded_from_disk"] == 1 and counts["rebuilt_corrupt"] == 1


def test_entry_of_another_key_is_not_served(cache_dir, counts, monkeypatch):
    """Two keys whose entries share a file name (forced here; a hash collision or a key whose
    repr changed) are told apart by the key in the sidecar: each lookup gets its own kernel,
    rebuilding over the other's entry instead of loading it."""
    monkeypatch.setattr(cache, "entry_name", lambda key: "0" * 32)
    other_key = tiny_kernel.KEY[:-1] + (32,)
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    cache.get_or_compile(other_key, tiny_kernel.build(32), ARCH)
    assert counts == {"compiled": 2, "loaded_from_disk": 0, "rebuilt_corrupt": 1}
    (meta,) = cache_dir.rglob("*.json")
    assert json.loads(meta.read_text())["key"] == repr((ARCH,) + other_key)
    cache.clear_memory()
    cache.get_or_compile(other_key, tiny_kernel.build(32), ARCH)
    cache.get_or_compile(tiny_kernel.KEY, tiny_kernel.build(), ARCH)
    assert counts == {"compiled": 3, "loaded_from_disk": 1, "rebuilt_corrupt": 2}
