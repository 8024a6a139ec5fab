"""`python -m cute_flash.perf bench|dashboard|cp|decode|varlen ...`."""

from __future__ import annotations

import sys

COMMANDS = ("bench", "dashboard", "cp", "decode", "varlen")
USAGE = ("usage: python -m cute_flash.perf {bench,dashboard,cp,decode,varlen} [options]  (--help after any for its options; "
         "cp on several GPUs: torchrun --nproc_per_node=N -m cute_flash.perf.cp)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "bench":
        from .bench import main as run
    elif argv[0] == "dashboard":
        from .dashboard import main as run
    elif argv[0] == "decode":
        from .decode import main as run
    elif argv[0] == "varlen":
        from .varlen import main as run
    else:
        from .cp import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
