"""The layout explorer (`cute-flash layouts`, docs/layouts.md): for the kernels dispatch picks,
every layout they build, from the code that builds it, without a GPU.

    kernel_plans(arch, pass_name, dtype, head_dim, causal, length, ...) -> [(label, Plan)]
    explore(label, plan, compile_kernel=False, with_lines=True) -> Explored (.layouts, .text)
    pictures(layouts) -> {file name: SVG text}
    write_docs(folder) -> [written paths]

record.py traces a plan's kernel (a dry run of the compiler: IR only) and records what the
kernel source asks the DSL for: shared-memory layouts and tensors, MMA atoms and their
thread/value partitions, tiled copies and what they are applied to, TMA atoms, register
fragments, each with the file:line and function that builds it. algebra.py and analysis.py
evaluate those layouts in plain Python (bank conflicts, TMA boxes); report.py and svg.py show
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .record import ExplorerError, KernelLayouts, record

__all__ = ["DOC_VARIANTS", "ExplorerError", "Explored", "explore", "kernel_plans", "pictures", "write_docs"]


def kernel_plans(arch: str, pass_name: str, dtype: str, head_dim: int, causal: bool, length: str = "long",
                 num_sms: int | None = None, gqa: bool = False, deterministic: bool = False) -> list[tuple[str, object]]:
    """(label, plan) of each kernel dispatch runs for this variant on `arch`: the forward kernel
    of the length class, or the backward's preprocess, main and postprocess kernels. `dtype` is
    torch's name (bfloat16, float16)."""
    import torch

    from .. import dispatch
    from ..device import capability_of

    capability, torch_dtype = capability_of(arch), getattr(torch, dtype)
    variant = f"{dtype} d{head_dim} {'causal' if causal else 'non-causal'}"
    if pass_name == "fwd":
        plan = dispatch.plan_forward(capability, torch_dtype, head_dim, causal, length, num_sms)
        return [(f"forward, {variant}, length class {length}, {plan.family} family, {arch}", plan)]
    backward = dispatch.plan_backward(capability, torch_dtype, head_dim, causal, deterministic, gqa)
    flags = "".join(f", {name}" for name, on in (("gqa", gqa), ("deterministic", deterministic)) if on)
    return [(f"backward {kind}, {variant}{flags}, {plan.family} family, {arch}", plan)
            for kind, plan in (("preprocess", backward.pre), ("main", backward.main), ("postprocess", backward.post))]


@dataclass
class Explored:
    layouts: KernelLayouts
    text: str


def explore(label: str, plan, compile_kernel: bool = False, with_lines: bool = True) -> Explored:
    """Record a plan's kernel and write its report; `compile_kernel` adds ptxas's registers and spills."""
    from .report import report

    kernel, fake_args = plan.build()
    layouts = record(kernel, fake_args, plan.arch)
    compiled = None
    if compile_kernel:
        from ..compile_report import compile_report

        compiled = compile_report(*plan.build(), arch=plan.arch)
    estimate = kernel.smem_bytes(**vars(kernel)) if hasattr(kernel, "smem_bytes") else None
    text = report(label, plan.settings(), layouts, estimate, getattr(plan.config, "register_split", None),
                  compiled, with_lines)
    return Explored(layouts, text)


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "+", name).strip("+")


def pictures(layouts: KernelLayouts) -> dict[str, str]:
    """Every picture of a kernel: each 16-bit shared-memory tile, each MMA operand that threads
    own and the MMA's warps, and the shared-memory side of each copy applied to shared memory."""
    from .algebra import per_thread
    from .analysis import line_mode
    from .svg import copy_svg, smem_svg, tv_svg, warps_svg

    out = {}
    for tensor in layouts.smem_tensors:
        if tensor.elem_bits == 16 and line_mode(tensor) is not None:
            out[f"smem-{_file_name(tensor.name)}.svg"] = smem_svg(tensor)
    for mma in layouts.mmas:
        for operand in "ABC":
            if per_thread(mma.tv[operand]):
                out[f"mma-{_file_name(mma.name)}-{operand}.svg"] = tv_svg(mma, operand)
        out[f"mma-{_file_name(mma.name)}-warps.svg"] = warps_svg(mma)
    for partition in layouts.partitions:
        side = "src" if partition.method == "partition_S" else "dst"
        if partition.copy.tiler is not None:
            out.setdefault(f"copy-{_file_name(partition.copy.name)}-{side}.svg", copy_svg(partition.copy, side))
    return out


# The variants docs/layouts.md shows: (folder, pass, arch, dtype, head dim, causal, length class,
# the pictures the page embeds). Reports there give positions as file: function, so that they
# stay true while lines move; tests/cpu/test_layouts.py checks one folder against a fresh run.
DOC_VARIANTS = (
    ("sm80-fwd-bf16-d128", "fwd", "sm_80", "bfloat16", 128, False, "long",
     ("smem-sQ.svg", "copy-smem_thr_copy_Q-src.svg", "mma-tiled_mma-C.svg")),
    ("sm80-bwd-bf16-d64", "bwd", "sm_80", "bfloat16", 64, False, "long",
     ("mma-tiled_mma_sdp-warps.svg", "mma-tiled_mma_dkv+tiled_mma_dq-warps.svg")),
    ("sm90-fwd-bf16-d128", "fwd", "sm_90a", "bfloat16", 128, False, "long",
     ("smem-sVt.svg", "mma-tiled_mma_qk-C.svg", "mma-tiled_mma_pv-A.svg")),
)
DOCS_NUM_SMS = 132  # the persistent Hopper kernels are sized for an H100 SXM in the docs


def write_docs(folder: Path, variants=DOC_VARIANTS) -> list[Path]:
    """Reports and pictures of `variants` under `folder`/<variant>/."""
    written = []
    for name, pass_name, arch, dtype, head_dim, causal, length, picture_names in variants:
        target = Path(folder) / name
        target.mkdir(parents=True, exist_ok=True)
        texts, drawn = [], {}
        for label, plan in kernel_plans(arch, pass_name, dtype, head_dim, causal, length, DOCS_NUM_SMS):
            explored = explore(label, plan, with_lines=False)
            texts.append(explored.text)
            drawn.update(pictures(explored.layouts))
        missing = [p for p in picture_names if p not in drawn]
        if missing:
            raise ExplorerError(f"{name}: no picture {', '.join(missing)} (there are {', '.join(sorted(drawn))})")
        files = {"report.txt": "\n".join(texts)} | {p: drawn[p] for p in picture_names}
        for file_name, text in files.items():
            (target / file_name).write_text(text)
            written.append(target / file_name)
    return written
