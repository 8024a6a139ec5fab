"""docs/architecture.md stays true: every file it names exists, and every `file: name` or
`file` (`name`, ...) pair names something defined or assigned in that file."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PATH = r"(?:cute_flash|kernels|tests|scripts|perf|docs)/[\w/.-]+\.(?:py|sh|md)"


def test_every_named_file_exists():
    named = set(re.findall(PATH, DOC))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def _defined(path: str, name: str) -> bool:
    text = (ROOT / path).read_text()
    name = name.split(".")[-1].split("::")[-1].strip("`() ")
    return bool(re.search(rf"(def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]|\b{re.escape(name)}\b\s*:|\.{re.escape(name)}\s*=", text, re.M))


def test_named_symbols_are_defined_where_the_doc_says():
    pairs = re.findall(rf"`({PATH}): ([\w.]+)`", DOC)
    for cell in re.findall(rf"`({PATH})` \(([^)]*)\)", DOC):
        path, inner = cell
        pairs += [(path, name) for name in re.findall(r"`([\w.]+)`", inner) if path.endswith(".py")]
    assert len(pairs) > 20
    wrong = sorted({(path, name) for path, name in pairs if path.endswith(".py") and not _defined(path, name)})
    assert not wrong, f"docs/architecture.md names symbols not found in their files: {wrong}"
