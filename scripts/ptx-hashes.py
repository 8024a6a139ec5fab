#!/usr/bin/env python3
"""Hash the PTX of every kernel `cute-flash check` builds, to show that a change keeps code identical.

    python scripts/ptx-hashes.py --arch sm_90a,sm_80 --passes fwd,bwd -o after.json [--jobs 16]
    python scripts/ptx-hashes.py --compare before.json after.json

Each kernel (forward per length class, the backward's preprocess, main (with and without GQA) and
postprocess) is compiled for its target without a GPU and its PTX hashed twice: as written, and
with the entry's mangled name replaced (the name spells the kernel's module and class, so a move
of the class changes it and nothing else). `--compare` lists the kernels that one file has and the
other lacks, and those whose PTX differs. Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed

_ENTRY = re.compile(r"\b(kernel_cutlass_kernel_\w+?)(_param_\d+)?\b")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _variants(arch: str, pass_name: str, head_dims):
    gqas = (False, True) if pass_name == "bwd" else (False,)
    return [(arch, pass_name, dtype, head_dim, causal, gqa)
            for dtype in ("float16", "bfloat16") for head_dim in head_dims
            for causal in (False, True) for gqa in gqas]


def _hash_variant(arch, pass_name, dtype, head_dim, causal, gqa):
    from cute_flash.cli import kernel_builds
    from cute_flash.compile_report import compile_report

    args = (arch, pass_name, dtype, head_dim, causal) + ((gqa,) if pass_name == "bwd" else ())
    rows = {}
    for label, _key, build, _expected in kernel_builds(*args):
        if pass_name == "bwd" and (causal or gqa) and "/main/" not in label:
            continue  # the backward's preprocess and postprocess ignore both
        kernel, fake_args = build()
        report = compile_report(kernel, fake_args, arch=arch)
        names = sorted(set(m.group(1) for m in _ENTRY.finditer(report.ptx)))
        renamed = report.ptx
        for i, name in enumerate(names):
            renamed = renamed.replace(name, f"ENTRY{i}")
        rows[f"{arch}:{label}"] = {"ptx": _digest(report.ptx), "ptx_renamed": _digest(renamed),
                                   "registers": report.registers, "spill_bytes": report.spill_bytes}
    return rows


def collect(archs, passes, head_dims, jobs: int) -> dict:
    variants = [v for arch in archs for p in passes for v in _variants(arch, p, head_dims)]
    hashes: dict = {}
    ctx = multiprocessing.get_context("spawn")  # the DSL's compiler state does not survive fork()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_hash_variant, *v) for v in variants]
        for done, future in enumerate(as_completed(futures), 1):
            hashes.update(future.result())
            print(f"\r{done}/{len(futures)} variants, {len(hashes)} kernels", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return dict(sorted(hashes.items()))


def compare(before: dict, after: dict, partial: bool = False) -> int:
    only_before = [] if partial else sorted(set(before) - set(after))
    only_after = sorted(set(after) - set(before))
    renamed = [k for k in sorted(set(before) & set(after))
               if before[k]["ptx"] != after[k]["ptx"] and before[k]["ptx_renamed"] == after[k]["ptx_renamed"]]
    changed = [k for k in sorted(set(before) & set(after)) if before[k]["ptx_renamed"] != after[k]["ptx_renamed"]]
    for title, labels in (("only before", only_before), ("only after", only_after),
                          ("entry name changed, code identical", renamed), ("PTX differs", changed)):
        print(f"{title}: {len(labels)}")
        for label in labels:
            print(f"  {label}")
    same = len(set(before) & set(after)) - len(renamed) - len(changed)
    print(f"identical: {same} of {len(before)} before, {len(after)} after")
    return 1 if only_before or only_after or changed or renamed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90a,sm_80")
    parser.add_argument("--passes", default="fwd,bwd")
    parser.add_argument("--head-dims", default="", help="comma list (default: every head dim `check` builds)")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument("-o", "--out", help="write the hashes here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--partial", action="store_true", help="with --compare: AFTER hashed a subset")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        return compare(before, after, args.partial)
    from cute_flash.validate import SUPPORTED_HEAD_DIMS

    head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else list(SUPPORTED_HEAD_DIMS)
    hashes = collect(args.arch.split(","), args.passes.split(","), head_dims, args.jobs)
    text = json.dumps(hashes, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
