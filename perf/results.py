"""The result file: its name, its schema, the environment it records, and peer ratios.

One JSON document per `bench` run:

    {"schema": SCHEMA, "suites": [...], "dtype": "bf16", "created_utc": "...",
     "git": {"commit", "dirty"}, "gpu": {"name", "arch", "sm_count", ...},
     "environment": {...}, "versions": {...}, "methods": {name: {...}},
     "roofline": {...}, "overhead": {...} | null, "suite_notes": {suite: note},
     "measurements": [...], "ratios": [...], "memory_oom_at": {...}, "complete": bool}

"complete" is false while the run is still going (the file is rewritten after every cell, so
a run cut short keeps what it measured). A measurement is one (suite, cell, pass, method): the cell's shape fields, "kind" ("speed" or
"memory"), "status" ("ok", "oom", "unsupported: ...", "error: ..."), and when ok either
"time_ms" (median, p10, p90, iqr, min, max, reps, host_ms_per_call, round_medians,
round_sm_mhz), "tflops",
"tokens_per_s", or "peak_bytes". A speed ratio also carries "paired": ours against the peer
round by round (paired_speedup).
"""

from __future__ import annotations

import datetime as _dt
import importlib
import gzip
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

SCHEMA = "cute-flash-bench/1"
REQUIRED_KEYS = ("schema", "suites", "dtype", "created_utc", "git", "gpu", "environment",
                 "versions", "methods", "roofline", "measurements", "ratios")
CELL_KEYS = ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim", "causal", "kind")


# ----------------------------------------------------------------------------- naming


def slugify(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_filename(arch: str, gpu_name: str, date: str, commit: str) -> str:
    return f"{arch}-{slugify(gpu_name)}-{date}-{commit}.json"


def unique_path(directory: Path, name: str) -> Path:
    """`name` in `directory`, or name-2.json, name-3.json, ... if a run already wrote it."""
    path = directory / name
    n = 2
    while path.exists():
        path = directory / f"{Path(name).stem}-{n}.json"
        n += 1
    return path


def git_commit(repo: Path) -> dict:
    """Short commit and dirty flag; CUTE_FLASH_GIT_COMMIT names the commit where the tree was
    copied without its .git (a remote GPU machine)."""
    if os.environ.get("CUTE_FLASH_GIT_COMMIT"):
        return {"commit": os.environ["CUTE_FLASH_GIT_COMMIT"], "dirty": None, "source": "CUTE_FLASH_GIT_COMMIT"}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return {"commit": commit or "nogit", "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "nogit", "dirty": None}


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


# ----------------------------------------------------------------------------- environment


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module:
        try:
            return getattr(importlib.import_module(module), "__version__", "unknown")
        except Exception:  # noqa: BLE001
            return None
    return None


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return None


def gpu_info(device: int = 0) -> dict:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {
        "name": p.name,
        "arch": f"sm{p.major}{p.minor}",
        "capability": [p.major, p.minor],
        "sm_count": p.multi_processor_count,
        "memory_bytes": p.total_memory,
        "l2_bytes": getattr(p, "L2_cache_size", 50 * 2**20),
    }


def environment() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": driver_version(),
        "cutlass_dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "argv": sys.argv,
    }


def versions() -> dict:
    return {
        "cute_flash": _version("cute-flash", "cute_flash"),
        "torch": _version("torch"),
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "flash-attn-4": _version("fa4") or _version("flash-attn-4") or _version("flash-attn", "flash_attn.cute"),
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "cuda-python": _version("cuda-python"),
    }


# ----------------------------------------------------------------------------- ratios


# A modified cell's fields (perf/suites.py Cell.key: absent where off).
MOD_KEYS = ("window", "softcap", "alibi", "dropout_p")


def cell_group_key(m: dict) -> tuple:
    mods = tuple(tuple(v) if isinstance(v, list) else v for v in (m.get(k) for k in MOD_KEYS))
    return (m["suite"], m["dtype"], m["pass"]) + tuple(m[k] for k in CELL_KEYS) + mods


def mods_label(m: dict) -> str:
    """A measurement's score modifications in words ("" for a plain cell)."""
    words = []
    if m.get("window") is not None:
        words.append(f"window {m['window'][0]},{m['window'][1]}")
    if m.get("softcap"):
        words.append(f"softcap {m['softcap']:g}")
    if m.get("alibi"):
        words.append("ALiBi")
    if m.get("dropout_p"):
        words.append(f"dropout {m['dropout_p']:g}")
    return ", ".join(words)


def compute_ratios(measurements: list[dict], ours: str = "ours") -> list[dict]:
    """For every cell and pass, ours against each other method. For speed cells
    `speedup` = peer median time / our median time (> 1: ours is faster); for memory cells
    `memory_ratio` = peer peak bytes / our peak bytes (> 1: ours uses less). When either side
    failed the value is None and `note` says which side and why. Speed ratios of interleaved
    timings also get `paired` (paired_speedup)."""
    groups: dict[tuple, dict[str, dict]] = {}
    for m in measurements:
        groups.setdefault(cell_group_key(m), {})[m["method"]] = m
    ratios = []
    for key, by_method in groups.items():
        mine = by_method.get(ours)
        if mine is None:
            continue
        memory = mine["kind"] == "memory"
        field = "memory_ratio" if memory else "speedup"
        for name, peer in by_method.items():
            if name == ours:
                continue
            entry = {k: mine[k] for k in ("suite", "dtype", "pass") + CELL_KEYS + MOD_KEYS if k in mine}
            entry["peer"] = name
            value, note = None, None
            if mine["status"] != "ok":
                note = f"ours: {mine['status']}"
            elif peer["status"] != "ok":
                note = f"peer: {peer['status']}"
            elif memory:
                value = peer["peak_bytes"] / mine["peak_bytes"] if mine.get("peak_bytes") and peer.get("peak_bytes") else None
            else:
                value = peer["time_ms"]["median"] / mine["time_ms"]["median"]
                paired = paired_speedup(mine["time_ms"], peer["time_ms"])
                if paired:
                    entry["paired"] = paired
            entry[field] = value
            if note:
                entry["note"] = note
            ratios.append(entry)
    return ratios


def paired_speedup(mine: dict, peer: dict) -> dict | None:
    """Peer time / our time within each round both were timed in (moments apart, so in much the
    same clock and power state): the median, lowest and highest of those per-round ratios and
    how many rounds they come from. None without per-round medians (older files)."""
    pairs = [p / m for m, p in zip(mine.get("round_medians") or [], peer.get("round_medians") or [])
             if m and p]
    if not pairs:
        return None
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs), "rounds": len(pairs)}


def memory_oom_points(measurements: list[dict]) -> dict:
    """Per (suite, pass, method): the smallest seqlen at which a memory cell ran out of memory."""
    points: dict[str, int] = {}
    for m in measurements:
        if m["kind"] == "memory" and m["status"] == "oom":
            key = f"{m['suite']}/{m['pass']}/{m['method']}"
            points[key] = min(points.get(key, m["seqlen_q"]), m["seqlen_q"])
    return points


# ----------------------------------------------------------------------------- IO


def validate(doc: dict) -> None:
    """Raise ValueError if `doc` is not a result document this code can read."""
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ValueError(f"result file lacks {missing}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema {doc['schema']!r}, expected {SCHEMA!r}")
    for m in doc["measurements"]:
        for k in CELL_KEYS + ("suite", "dtype", "pass", "method", "status"):
            if k not in m:
                raise ValueError(f"measurement lacks {k!r}: {m}")
        if m["status"] == "ok" and "time_ms" not in m and "peak_bytes" not in m:
            raise ValueError(f"ok measurement without time_ms or peak_bytes: {m}")


def new_path(doc: dict, out_dir: Path) -> Path:
    """A fresh file name for this run's document in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result_filename(doc["gpu"]["arch"], doc["gpu"]["name"],
                           doc["created_utc"][:10].replace("-", ""), doc["git"]["commit"])
    return unique_path(out_dir, name)


def write(doc: dict, out_dir: Path, path: Path | None = None) -> Path:
    """Write `doc` atomically to `path` (rewriting it), or to a new file in `out_dir`."""
    validate(doc)
    path = path or new_path(doc, out_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def _parse(name: str, raw: bytes) -> dict:
    text = gzip.decompress(raw).decode() if name.endswith(".gz") else raw.decode()
    doc = json.loads(text)
    validate(doc)
    doc["_path"] = name
    return doc


def load(path: Path) -> dict:
    """A result file, plain (`.json`) or gzip-compressed (`.json.gz`, how older runs are kept in
    the repository: the GPU machine receives the whole tree and its size is capped)."""
    path = Path(path)
    return _parse(str(path), path.read_bytes())


def load_dir(directory: Path) -> tuple[list[dict], list[str]]:
    """All readable result files in `directory`, and in its archives (`*.tar.xz`: superseded
    runs, packed together because one xz stream over similar files is half the size of their
    separate gzip files), and a note for each file that was skipped."""
    docs, skipped = [], []

    def add(name: str, label: str, read) -> None:
        try:
            docs.append(_parse(name, read()))
        except (ValueError, KeyError, json.JSONDecodeError, OSError, EOFError) as exc:
            skipped.append(f"{label}: {exc}")

    directory = Path(directory)
    for path in sorted([*directory.glob("*.json"), *directory.glob("*.json.gz")]):
        add(str(path), path.name, path.read_bytes)
    for archive in sorted(directory.glob("*.tar.xz")):
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith((".json", ".json.gz")):
                    name = f"{archive.name}/{member.name}"
                    add(str(directory / name), name, tar.extractfile(member).read)
    return docs, skipped
