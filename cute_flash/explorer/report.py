"""The explorer's text report of one kernel: what it builds, where, and what that costs."""

from __future__ import annotations

from .algebra import per_thread, product
from .analysis import (
    access_bytes, builder_of, core_matrix_conflicts, partition_conflicts, tensor_bytes, tma_box, tma_swizzle_bytes,
)
from .record import KernelLayouts, Mma, Record


def _table(rows: list[tuple], indent: str = "  ") -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _wrap(items: list[str], width: int = 100, indent: str = "  ") -> list[str]:
    lines, line = [], indent
    for item in items:
        if len(line) + len(item) > width and line.strip():
            lines.append(line.rstrip(", "))
            line = indent
        line += item + ", "
    return lines + [line.rstrip(", ")]


class _Report:
    def __init__(self, with_lines: bool):
        self.with_lines = with_lines
        self.lines: list[str] = []

    def at(self, record: Record) -> str:
        return record.where(self.with_lines)

    def section(self, title: str) -> None:
        self.lines += ["", title]

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)


def _operand_text(mma: Mma, operand: str) -> str:
    tv = mma.tv[operand]
    if not per_thread(tv):
        return f"{operand}: the warp group reads it from shared memory (no per-thread partition)"
    return f"{operand}: {tv.mode_size(1)} values per thread, (thread, value) -> tile {tv}"


def report(title: str, settings: dict, layouts: KernelLayouts, kernel_smem_estimate: int | None = None,
           register_split: tuple[int, int] | None = None, compiled=None, with_lines: bool = True) -> str:
    """`title` names the variant; `settings` is the kernel's configuration; the kernel's own
    shared-memory estimate, the sm90 register split and a compile report (registers, spills)
    are shown when given. `with_lines`: give source positions as file:line (else file:function)."""
    r = _Report(with_lines)
    r.add(title, f"kernel {layouts.kernel}, traced for {layouts.arch}")
    r.add(*_wrap([f"{k}={getattr(v, '__name__', v)}" for k, v in sorted(settings.items())]))
    r.add("Source positions are file:line function, innermost first, as the trace met them."
          if with_lines else "Source positions are file: function, innermost first.")

    r.section("Launch and budgets")
    r.add(f"  {layouts.threads} threads per CTA ({layouts.threads // 32} warps); "
          + ", ".join(f"{k} {v}" for k, v in layouts.launch.items() if k != "smem"))
    smem = f"  shared memory: {layouts.smem_bytes} B per CTA (the storage struct the kernel allocates)"
    if kernel_smem_estimate is not None:
        smem += f"; the kernel's smem_bytes(): {kernel_smem_estimate} B"
    r.add(smem)
    if register_split is not None:
        r.add(f"  registers per thread (setmaxnreg): producer warp group {register_split[0]},"
              f" consumer warp groups {register_split[1]}")
    if compiled is not None:
        r.add(f"  ptxas: {compiled.registers} registers per thread, {compiled.spill_bytes} bytes of spill"
              f" ({compiled.seconds:.1f} s to compile)")
    else:
        r.add("  registers: add --compile for what ptxas allocates (a compile takes seconds)")
    if layouts.storage:
        tensors = {}
        for tensor in layouts.smem_tensors:
            tensors.setdefault(tensor.storage_field, []).append(tensor.name)
        r.add("  storage:")
        r.add(*_table([("field", "offset", "bytes", "tensor")] + [
            (name, offset, size, ", ".join(tensors.get(name, []))) for name, offset, size in layouts.storage
        ], indent="    "))

    if layouts.smem_tensors:
        r.section("Shared-memory tensors (bank conflicts of the 8-line x 16-byte reads of ldmatrix, stmatrix and"
                  " wgmma core matrices, stage 0)")
    for tensor in layouts.smem_tensors:
        r.add(f"  {tensor.name}: {'x'.join(map(str, tensor.shape))} of {tensor.elem_bits}-bit elements,"
              f" {tensor_bytes(tensor)} B in storage field {tensor.storage_field}")
        r.add(f"    layout {tensor.layout}", f"    swizzle {tensor.swizzle_text}")
        conflicts = core_matrix_conflicts(tensor)
        if conflicts is not None:
            r.add(f"    core matrices: {conflicts}")
        built = builder_of(tensor, layouts.smem_layouts)
        if built is not None:
            r.add(f"    layout {built.name} = {built.builder}(...) at {r.at(built)}")
        r.add(f"    made at {r.at(tensor)}")

    if layouts.tmas:
        r.section("TMA copies (one box per instruction)")
    for tma in layouts.tmas:
        inner, rows = tma_box(tma)
        per_tile = product(tma.tile) // tma.box_elems
        swizzle = tma_swizzle_bytes(tma)
        r.add(f"  {tma.name}: {tma.op}, tile {' x '.join(map(str, tma.tile))}",
              f"    box {inner} x {rows} elements ({tma.box_elems * tma.elem_bits // 8} B), {per_tile} per tile,"
              f" {f'{swizzle}-byte swizzle' if swizzle else 'no swizzle'}",
              f"    shared-memory side {tma.smem_layout}", f"    built at {r.at(tma)}")

    if layouts.mmas:
        r.section("MMA (tile: what the tiled MMA covers in one step; thread-value layouts map (thread, value)"
                  " to a column-major offset in the operand's tile)")
    for mma in layouts.mmas:
        m, n, k = mma.tile_mnk
        r.add(f"  {mma.name}: {mma.op}",
              f"    atom {'x'.join(map(str, mma.atom_mnk))} on {mma.atom_threads} threads; {mma.threads} threads"
              f" {mma.thr_layout}; tile M x N x K = {m} x {n} x {k}, permutation {mma.permutation}")
        r.add(*(f"    {_operand_text(mma, operand)}" for operand in "ABC"))
        r.add(f"    built at {r.at(mma)}")

    if layouts.copies:
        r.section("Tiled copies")
    for copy in layouts.copies:
        tile = " x ".join(map(str, copy.tiler)) if copy.tiler else "(not a contiguous tile)"
        r.add(f"  {copy.name}: {copy.op}, {copy.threads} threads, tile {tile},"
              f" {copy.src_values * copy.elem_bits // 8} B read / {copy.dst_values * copy.elem_bits // 8} B"
              f" written per thread and instruction", f"    (thread, value) -> source tile {copy.tv_src}",
              f"    (thread, value) -> destination tile {copy.tv_dst}", f"    built at {r.at(copy)}")

    if layouts.partitions:
        r.section("Copies on shared memory (per warp: phases of 32, 16 or 8 threads for accesses of up to 4, 8"
                  " or 16 bytes)")
        r.add(*_table([(p.name, "reads" if p.method == "partition_S" else "writes", f"{access_bytes(p)} B",
                        str(partition_conflicts(p) or "not modelled"), f"{p.copy.name} at {r.at(p)}")
                       for p in layouts.partitions]))

    if layouts.fragments:
        r.section("Register tensors (per thread; what the code asks for: ptxas may keep fewer alive at once)")
        r.add(*_table([(f.name, f"{f.elem} x {f.size}",
                        "predicates" if f.elem_bits == 1 else f"{f.registers} registers", r.at(f))
                       for f in sorted(layouts.fragments, key=lambda f: -f.registers)]))
    if not (layouts.smem_tensors or layouts.mmas or layouts.copies):
        r.add("", "No layouts recorded: this kernel builds no shared-memory tile, MMA or tiled copy.")
    return "\n".join(r.lines) + "\n"
