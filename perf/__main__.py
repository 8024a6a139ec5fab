"""`python -m cute_flash.perf bench|dashboard ...`."""

from __future__ import annotations

import sys

USAGE = "usage: python -m cute_flash.perf {bench,dashboard} [options]  (--help after either for its options)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("bench", "dashboard"):
        print(USAGE, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "bench":
        from .bench import main as run
    else:
        from .dashboard import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
