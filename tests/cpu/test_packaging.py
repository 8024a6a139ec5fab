"""What a plain (non-editable) install gives a user: the wheel's metadata and files, and the
README's commands run from a directory outside the checkout. Built and installed offline, with
this environment's torch, DSL and matplotlib."""

import email
import os
import shutil
import site
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import cute_flash

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "cute_flash", "kernels", "perf")


def _run(argv, cwd, **kw):
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    setuptools_major = int(metadata.version("setuptools").split(".")[0])
    if setuptools_major < 77:
        pytest.skip("building offline needs setuptools >= 77 here (pip install -e '.[test]' brings it)")
    # From a copy, so the checkout gets no build/ folder; the results archive is not package data.
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "results", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", out, src], cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("cute_flash-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel; it sees this environment's packages
    (torch, the DSL, matplotlib) after its own, so cute_flash comes from the wheel."""
    root = tmp_path_factory.mktemp("venv")
    assert _run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root).returncode == 0
    (own_site,) = root.glob("lib/python*/site-packages")
    parents = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    parents += [p for p in site.getsitepackages() if p not in parents and os.path.isdir(p)]
    # addsitedir also runs those directories' .pth files, which put some packages on the path.
    (own_site / "parent-environment.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    installed = _run([sys.executable, "-m", "pip", "--python", root / "bin" / "python", "install", "--no-deps",
                      "--no-index", "-q", wheel], cwd=root)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return root


def test_the_wheel_carries_the_license_the_version_and_the_type_marker(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_string(whl.read(f"{info}/METADATA").decode())
        license_text = whl.read(f"{info}/licenses/LICENSE").decode()
    assert meta["Version"] == cute_flash.__version__  # one version, read from the package
    assert meta["License-Expression"] == "BSD-3-Clause" and meta["License-File"] == "LICENSE"
    assert license_text.startswith("BSD 3-Clause License") and "the cute-flash authors" in license_text
    assert any(c.startswith("Programming Language :: Python :: 3") for c in meta.get_all("Classifier"))
    # py.typed ships whenever the package has one (package data)
    assert ("cute_flash/py.typed" in names) == (REPO / "cute_flash" / "py.typed").exists()
    assert {"cute_flash/kernels/sm90/fwd.py", "cute_flash/perf/dashboard.py"} <= names
    assert not any("/results/" in n for n in names)


def test_the_readme_commands_work_outside_the_checkout(venv, tmp_path):
    pytest.importorskip("matplotlib")
    from cute_flash.perf import results

    from .test_perf_harness import fake_doc

    bin_dir = venv / "bin"
    where = _run([bin_dir / "python", "-c", "import cute_flash; print(cute_flash.__file__)"], cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr

    info = _run([bin_dir / "cute-flash", "info"], cwd=tmp_path)
    assert info.returncode == 0 and f"cute-flash {cute_flash.__version__}" in info.stdout, info.stderr

    nothing = _run([bin_dir / "cute-flash", "dashboard"], cwd=tmp_path)
    assert nothing.returncode == 2
    assert f"no directory perf/results under {tmp_path}" in nothing.stderr and "site-packages" not in nothing.stderr

    results.write(fake_doc(), tmp_path / "perf" / "results")
    drawn = _run([bin_dir / "cute-flash", "dashboard"], cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "build" / "dashboard" / "sm90" / "index.html").exists()

    bench = _run([bin_dir / "cute-flash", "bench", "--help"], cwd=tmp_path)
    assert bench.returncode == 0 and "(default: perf/results)" in bench.stdout
