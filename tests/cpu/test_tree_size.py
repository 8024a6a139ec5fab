"""The tracked tree travels to the GPU machine beside the ~62 MiB DSL bundle (.device/), and the
two together must stay under 64 MiB (docs/dsl-notes.md). Result files are what grows: superseded
ones belong in perf/results' archive (perf/README.md)."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# 64 MiB less the bundle with flash-attn-4 after scripts/slim-device-bundle.sh (64,507,145 bytes,
# 2026-11-29), with each file counted in whole 4 KiB blocks as the transfer counts them (a tree of
# 2.21 MB in bytes, 2.49 MB in blocks, was refused beside the unslimmed bundle on 2026-11-27), and
# ~100 KB of room for a run's carried scratch (a few scripts).
TREE_BUDGET_BYTES = 2_500_000
BLOCK = 4096


def test_tracked_tree_leaves_room_for_the_gpu_bundle():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    sizes = {name.decode(): -(-(REPO / name.decode()).stat().st_size // BLOCK) * BLOCK
             for name in names if name and (REPO / name.decode()).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= TREE_BUDGET_BYTES, (
        f"tracked files take {total} bytes (budget {TREE_BUDGET_BYTES}); move superseded result files "
        f"into a perf/results archive (perf/README.md). Largest: {largest}")
