"""Compiled-kernel cache: in memory, then on disk, then the CuTe DSL compiler.

A compile key holds only what changes generated code (architecture, pass, dtype, head dim,
causal, tiles, ...), never batch, lengths or the scale value, so one compiled kernel serves every
size. On disk, entries live under `$CUTE_FLASH_CACHE_DIR` (default `~/.cache/cute-flash`) in a
folder named after the package source hash and DSL version, so an edit to any kernel or a DSL
upgrade starts a fresh folder. Each entry is the object file that `export_to_c` writes (TVM-FFI
host launcher + embedded cubin) plus a JSON sidecar with its SHA-256; writes are atomic (temp file +
rename), a per-entry file lock makes concurrent processes compile a kernel once, and an entry whose
bytes do not match its checksum, or that fails to load, is rebuilt. `CUTE_FLASH_CACHE=0` turns
the disk cache off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import CuTeDSL

COMPILE_OPTIONS = "--enable-tvm-ffi"
"""TVM-FFI entry points take framework tensors directly: a few microseconds per call instead of
tens per tensor for `from_dlpack`, and they check dtype, shape and device on the way in."""

Build = Callable[[], tuple[Any, tuple]]
"""Returns (kernel object, fake arguments) for `cute.compile`."""

_memory: dict[tuple, Any] = {}
_memory_lock = threading.Lock()
_compile_lock = threading.Lock()
stats = {"compiled": 0, "loaded_from_disk": 0, "rebuilt_corrupt": 0}


def disk_enabled() -> bool:
    return os.environ.get("CUTE_FLASH_CACHE", "1") not in ("0", "false", "off", "no")


def cache_root() -> Path:
    return Path(os.environ.get("CUTE_FLASH_CACHE_DIR") or Path.home() / ".cache" / "cute-flash")


def _source_hash() -> str:
    """Hash of every Python file of the package and its kernels: any edit changes it."""
    import cute_flash
    import cute_flash.kernels

    digest = hashlib.sha256()
    for root in sorted({Path(cute_flash.__file__).parent, Path(cute_flash.kernels.__file__).parent}):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_namespace: str | None = None


def namespace() -> str:
    """Folder name that separates incompatible entries: source hash and DSL version."""
    global _namespace
    if _namespace is None:
        _namespace = f"src-{_source_hash()}-dsl-{cutlass.__version__}"
    return _namespace


def entry_name(key: tuple) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def compile_for_arch(arch: str, build: Build):
    """`cute.compile` for a target such as 'sm_80' or 'sm_90a', GPU present or not."""
    kernel, fake_args = build()
    env = CuTeDSL._get_dsl().envar
    with _compile_lock:
        previous = env._arch
        env.arch = arch
        try:
            return cute.compile(kernel, *fake_args, options=COMPILE_OPTIONS)
        finally:
            env.arch = previous


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _prefix(name: str) -> str:
    return "cute_flash_" + name[:16]


def _load_entry(folder: Path, name: str, key: tuple):
    """The compiled function stored for `key`, or None if absent or damaged (then removed)."""
    obj, meta = folder / f"{name}.o", folder / f"{name}.json"
    if not obj.exists() or not meta.exists():
        return None
    try:
        info = json.loads(meta.read_text())
        data = obj.read_bytes()
        if info.get("key") != repr(key) or info.get("sha256") != hashlib.sha256(data).hexdigest():
            raise ValueError("checksum or key mismatch")
        return getattr(cute.runtime.load_module(str(obj), enable_tvm_ffi=True), _prefix(name))
    except Exception:
        stats["rebuilt_corrupt"] += 1
        for path in (obj, meta):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return None


def _store_entry(folder: Path, name: str, key: tuple, compiled, seconds: float) -> None:
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        compiled.export_to_c(str(Path(tmp, f"{name}.o")), function_name=_prefix(name))
        data = Path(tmp, f"{name}.o").read_bytes()
    _atomic_write(folder / f"{name}.o", data)
    meta = {
        "key": repr(key),
        "sha256": hashlib.sha256(data).hexdigest(),
        "compile_seconds": round(seconds, 3),
        "dsl_version": cutlass.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_write(folder / f"{name}.json", json.dumps(meta, indent=1).encode())


def get_or_compile(key: tuple, build: Build, arch: str):
    """The compiled kernel for `key`, compiling it at most once per machine.

    `arch` is the compile target ('sm_80', 'sm_90a', ...). It is part of the cache key, so callers
    leave it out of `key`.
    """
    key = (arch,) + tuple(key)
    compiled = _memory.get(key)
    if compiled is not None:
        return compiled
    with _memory_lock:
        compiled = _memory.get(key)
        if compiled is None:
            compiled = _from_disk_or_compile(key, build, arch)
            _memory[key] = compiled
    return compiled


def _from_disk_or_compile(key: tuple, build: Build, arch: str):
    if not disk_enabled():
        stats["compiled"] += 1
        return compile_for_arch(arch, build)
    folder = cache_root() / namespace()
    folder.mkdir(parents=True, exist_ok=True)
    name = entry_name(key)
    with _file_lock(folder / f"{name}.lock"):
        compiled = _load_entry(folder, name, key)
        if compiled is not None:
            stats["loaded_from_disk"] += 1
            return compiled
        start = time.perf_counter()
        compiled = compile_for_arch(arch, build)
        stats["compiled"] += 1
        _store_entry(folder, name, key, compiled, time.perf_counter() - start)
    return compiled


def clear_memory() -> None:
    """Forget in-memory entries (the disk cache stays); used by tests and `cute-flash warmup`."""
    _memory.clear()
