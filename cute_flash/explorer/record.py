"""Record the layouts, atoms and partitions a kernel builds, by tracing it as the compiler does.

    record(kernel, fake_args, arch) -> KernelLayouts

The kernel object (a plan's `build()`) is traced with the DSL's dry run for the compile target
`arch`: `__call__` and the device kernel run as for a compile and build their IR, and nothing is
lowered or compiled, so no GPU is needed and a trace takes a few seconds. For the duration of the
trace the DSL functions that build layouts, atoms, copies, shared-memory tensors and register
fragments (BUILDERS) are wrapped: each result a kernel source file asks for is noted with its
call sites (file:line function, innermost first, kernel files only) and the name it is assigned
to. What `__call__` hands the device kernel is named by the kernel's parameters. So the explorer
shows what the kernel builds, where, with no copy of the kernel's arguments and no change to it.

DSL objects live only as long as their trace, so everything is turned into plain data
(algebra.Layout and the records below) while it runs; every layout so turned is checked against
the DSL's own evaluation at sampled coordinates. The wrappers are installed process-wide for the
trace: one trace at a time per process (as for the DSL's compile settings).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import numpy as np
from cutlass.cute import atom as cute_atom
from cutlass.cute.nvgpu import cpasync

from .algebra import Layout, Swizzle, flatten, product

KERNELS_DIR = Path(__import__("cute_flash.kernels", fromlist=["_"]).__file__).resolve().parent
# Sites are shown relative to the folder that holds `kernels/`: kernels/sm80/fwd.py.
SITE_ROOT = KERNELS_DIR.parent
# Layouts are checked against the DSL at this many coordinates (spread over the domain).
CHECKED_COORDINATES = 48


class ExplorerError(RuntimeError):
    """The explorer could not read a kernel the way it expects (a DSL change, most likely)."""


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    function: str

    def text(self, with_line: bool = True) -> str:
        return f"{self.path}:{self.line} {self.function}" if with_line else f"{self.path}: {self.function}"


@dataclass
class Record:
    name: str
    sites: tuple[Site, ...]  # innermost first

    def where(self, with_line: bool = True) -> str:
        return " <- ".join(site.text(with_line) for site in self.sites)


@dataclass
class SmemLayout(Record):
    """A layout built for shared memory (`__call__`'s tile_to_shape, make_smem_layout_a/b)."""

    builder: str
    layout: Layout


@dataclass
class SmemTensor(Record):
    """A shared-memory tensor the kernel makes from its storage (`storage.X.get_tensor`), or one
    a copy is applied to. A swizzle on the pointer acts on byte addresses, one in a composed
    layout on element offsets."""

    layout: Layout
    pointer_swizzle: Swizzle | None
    elem_bits: int
    shape: tuple
    storage_field: str | None = None

    @functools.cached_property
    def addresses(self) -> np.ndarray:
        """[row, column] -> byte address of stage 0 (further modes at 0), from the buffer's
        1024-byte aligned base: all that bank mapping needs."""
        rows, cols = self.shape[0], self.shape[1] if len(self.shape) > 1 else 1
        offsets = self.layout.table()[:rows * cols].reshape(cols, rows).T
        addresses = offsets * self.elem_bits // 8
        return self.pointer_swizzle.apply(addresses) if self.pointer_swizzle is not None else addresses

    @property
    def swizzle_text(self) -> str:
        if self.pointer_swizzle is not None:
            return f"{self.pointer_swizzle} on byte addresses"
        if self.layout.swizzle is not None:
            return f"{self.layout.swizzle} on element offsets"
        return "none"


@dataclass
class Mma(Record):
    op: str
    atom_mnk: tuple
    atom_threads: int
    threads: int
    tile_mnk: tuple
    thr_layout: str
    permutation: str
    tv: dict[str, Layout]  # "A": (thread, value) -> (M, K) tile, "B": -> (N, K), "C": -> (M, N)


@dataclass
class Copy(Record):
    op: str
    elem_bits: int
    threads: int
    tiler: tuple | None  # (rows, cols) of one copy tile; None when a tiler mode is not contiguous
    tv_src: Layout
    tv_dst: Layout
    src_values: int  # values one thread moves per instruction, source side
    dst_values: int


@dataclass
class Tma(Record):
    op: str
    tile: tuple  # the CTA tile the atom copies
    box_elems: int  # elements one TMA instruction moves
    elem_bits: int
    smem_layout: Layout


@dataclass
class Partition(Record):
    """A tiled copy applied to a shared-memory tensor (partition_S: read, partition_D: write)."""

    method: str
    copy_expr: str
    tensor_expr: str
    copy: Copy
    tensor: SmemTensor


@dataclass
class Fragment(Record):
    """A register tensor (per thread)."""

    elem: str
    elem_bits: int
    size: int

    @property
    def registers(self) -> int:
        return -(-self.size * self.elem_bits // 32)


@dataclass
class KernelLayouts:
    kernel: str
    arch: str
    threads: int
    smem_bytes: int
    storage: list[tuple[str, int, int]]  # (field, offset, bytes)
    launch: dict[str, str]
    smem_layouts: list[SmemLayout] = field(default_factory=list)
    smem_tensors: list[SmemTensor] = field(default_factory=list)
    mmas: list[Mma] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    tmas: list[Tma] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)
    fragments: list[Fragment] = field(default_factory=list)


# ----------------------------------------------------------------------------- source sites


@functools.lru_cache(maxsize=None)
def _simple_statements(path: str) -> tuple[ast.stmt, ...]:
    """The statements of a kernel source file that hold no others."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    return tuple(node for node in ast.walk(tree) if isinstance(node, ast.stmt) and not hasattr(node, "body"))


@functools.lru_cache(maxsize=None)
def _statement(path: str, line: int) -> ast.stmt | None:
    """The innermost simple statement of a kernel source file that spans `line`."""
    spanning = [node for node in _simple_statements(path) if node.lineno <= line <= (node.end_lineno or node.lineno)]
    return max(spanning, key=lambda node: node.lineno, default=None)


def _assigned_name(path: str, line: int) -> str | None:
    statement = _statement(path, line)
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
        if isinstance(target, ast.Tuple):  # tma_atom_Q, tma_Q = make_tiled_tma_atom(...)
            target = target.elts[0]
        return ast.unparse(target)
    return None


def _method_call(path: str, line: int, method: str) -> ast.Call | None:
    """The call `<something>.method(...)` made on `line` of a kernel source file."""
    statement = _statement(path, line)
    if statement is None:
        return None
    calls = [node for node in ast.walk(statement) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == method]
    calls.sort(key=lambda node: abs(node.lineno - line))
    return calls[0] if calls else None


def _in_kernels(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(KERNELS_DIR)


# The DSL runs the bodies of dynamic if / while / for statements as functions of these names,
# called from the line of the statement they stand for; Python runs a comprehension as <listcomp>.
_GENERATED_BODY = re.compile(r"_(block|region|body)_\d+$|^<\w+>$")


def _sites(frame) -> tuple[tuple[Site, ...], list[tuple[str, int]]]:
    """The kernel-source frames from `frame` outward, up to the kernel's entry points; a
    statement body the DSL runs as a function of its own (or a comprehension) counts as part of
    its function."""
    sites, raw = [], []
    inner_line = None
    while frame is not None:
        code = frame.f_code
        if _in_kernels(code.co_filename):
            if _GENERATED_BODY.search(code.co_name):
                inner_line = inner_line or frame.f_lineno
            else:
                path = str(Path(code.co_filename).resolve())
                line = inner_line or frame.f_lineno
                inner_line = None
                sites.append(Site(str(Path(path).relative_to(SITE_ROOT)), line, code.co_name))
                raw.append((path, line))
                # the device kernel, or the host code: `__call__`, or the `launch` that a kernel's
                # entry points share (kernels/sm80: `__call__` and `call_with_mods`)
                if code.co_name in ("kernel", "__call__", "launch"):
                    break
        frame = frame.f_back
    return tuple(sites), raw


# ----------------------------------------------------------------------------- DSL -> plain


def _static(values) -> bool:
    return all(isinstance(v, int) for v in flatten(values))


def plain_layout(obj) -> Layout | None:
    """A static DSL layout (plain or composed with a swizzle) as an algebra.Layout, checked
    against the DSL's evaluation; None for a layout with dynamic or non-integer parts."""
    if isinstance(obj, cute.ComposedLayout):
        inner, outer = obj.inner, obj.outer
        if not (isinstance(inner, cute.Swizzle) and isinstance(obj.offset, int)
                and isinstance(outer, cute.Layout)):
            return None
        swizzle = Swizzle(inner.num_bits, inner.num_base, inner.num_shift)
        shape, stride, offset = outer.shape, outer.stride, obj.offset
    elif isinstance(obj, cute.Layout):
        swizzle, shape, stride, offset = None, obj.shape, obj.stride, 0
    else:
        return None
    if not (_static(shape) and _static(stride)):
        return None
    layout = Layout(shape, stride, swizzle, offset)
    size = layout.size
    for i in sorted({*range(0, size, max(1, size // CHECKED_COORDINATES)), size - 1}):
        if obj(i) != layout(i):
            raise ExplorerError(f"layout {obj} gives {obj(i)} at {i}; the explorer computes {layout(i)}")
    return layout


# The pointer type prints as ptr<bf16, smem, align<1024>, S<3,4,3>> when it carries a swizzle.
_POINTER_SWIZZLE = re.compile(r"S<(-?\d+),(-?\d+),(-?\d+)>")


def _memspace(tensor):
    """A tensor's memory space; None for a coordinate tensor, which has none."""
    try:
        return tensor.memspace
    except (AttributeError, ValueError):
        return None


def _smem_tensor(tensor, name: str, sites, storage_field: str | None = None) -> SmemTensor | None:
    if _memspace(tensor) != cute.AddressSpace.smem:
        return None
    layout = plain_layout(tensor.layout)
    if layout is None:
        return None
    match = _POINTER_SWIZZLE.search(str(tensor.iterator))
    swizzle = Swizzle(*map(int, match.groups())) if match else None
    return SmemTensor(name, sites, layout, swizzle, tensor.element_type.width, flatten_top(layout),
                      storage_field)


def flatten_top(layout: Layout) -> tuple:
    return tuple(layout.mode_size(m) for m in range(layout.rank))


def _field_text(value) -> str | None:
    if isinstance(value, (bool, int, str, tuple)):
        return str(value)
    if isinstance(value, type):  # an element type
        return value.__name__
    return getattr(value, "name", None)  # an enum


def _op_text(op) -> str:
    """An atom's operation with its settings: LdMatrix8x8x16bOp(transpose=True, num_matrices=4)."""
    fields = [(k, _field_text(v)) for k, v in vars(op).items() if not k.startswith("_")]
    text = ", ".join(f"{k}={v}" for k, v in fields if v is not None)
    return f"{type(op).__name__}({text})"


def _tiler(tiled_copy) -> tuple | None:
    modes = [plain_layout(mode) for mode in tiled_copy.tiler_mn]
    if any(m is None or m.stride != (1,) and m.size > 1 for m in modes):
        return None
    return tuple(m.size for m in modes)


def _copy(tiled_copy, name: str, sites) -> Copy:
    return Copy(
        name, sites, _op_text(tiled_copy.op), tiled_copy.value_type.width, tiled_copy.size,
        _tiler(tiled_copy), plain_layout(tiled_copy.layout_src_tv_tiled),
        plain_layout(tiled_copy.layout_dst_tv_tiled),
        cute.size(tiled_copy.layout_src_tv, mode=[1]), cute.size(tiled_copy.layout_dst_tv, mode=[1]),
    )


def _mma(tiled_mma, name: str, sites) -> Mma:
    return Mma(
        name, sites, _op_text(tiled_mma.op), tuple(tiled_mma.shape_mnk),
        cute.size(tiled_mma.thr_id), tiled_mma.size, tuple(tiled_mma.get_tile_size(i) for i in range(3)),
        str(tiled_mma.thr_layout_vmnk), str(tiled_mma.permutation_mnk),
        {"A": plain_layout(tiled_mma.tv_layout_A_tiled), "B": plain_layout(tiled_mma.tv_layout_B_tiled),
         "C": plain_layout(tiled_mma.tv_layout_C_tiled)},
    )


def _storage(shared_storage) -> list[tuple[str, int, int]]:
    fields = []
    for name, offset in shared_storage._offsets.items():
        member = shared_storage._annotations[name]
        if isinstance(member, cute.struct._AlignMeta):
            member = member.dtype
        if isinstance(member, cute.struct._MemRangeMeta):
            size = member.size_in_bytes
        elif isinstance(member, cute.struct):
            size = member.__sizeof__()
        else:
            size = max(1, member.width // 8)
        fields.append((name, offset, size))
    return fields


# ----------------------------------------------------------------------------- the recording


class _Recorder:
    def __init__(self):
        self.out = KernelLayouts("", "", 0, 0, [], {})
        self.by_object: dict[int, Record] = {}
        self.keep: list[Any] = []  # the DSL objects behind by_object, alive until the trace ends
        self.seen: dict[tuple, Record] = {}

    def name(self, raw, sites) -> str:
        for path, line in raw:
            name = _assigned_name(path, line)
            if name:
                return name
        return sites[0].function

    def note(self, kind: str, builder: str, args, kwargs, result, frame) -> None:
        sites, raw = _sites(frame)
        record = getattr(self, f"_{kind}")(builder, args, kwargs, result, self.name(raw, sites), sites, raw)
        if record is None:
            return
        # The same call traced again (an unrolled loop, another branch) is noted once.
        key = (kind, sites[0], repr(dataclasses.replace(record, name="", sites=())))
        if key in self.seen:
            record = self.seen[key]
        else:
            self.seen[key] = record
            getattr(self.out, _LISTS[kind]).append(record)
        target = result[0] if kind == "tma" else result
        self.by_object[id(target)] = record
        self.keep.append(target)

    # One handler per kind: the plain record of a result, or None for one the explorer skips.

    def _smem_layout(self, builder, args, kwargs, result, name, sites, raw):
        layout = plain_layout(result)
        return SmemLayout(name, sites, builder, layout) if layout is not None else None

    def _mma(self, builder, args, kwargs, result, name, sites, raw):
        return _mma(result, name, sites)

    def _copy(self, builder, args, kwargs, result, name, sites, raw):
        return _copy(result, name, sites)

    def _tma(self, builder, args, kwargs, result, name, sites, raw):
        bound = inspect.signature(cpasync.make_tiled_tma_atom).bind(*args, **kwargs).arguments
        tma_atom = result[0]
        return Tma(name, sites, _op_text(bound["op"]), tuple(flatten(bound["cta_tiler"])),
                   cute.size(tma_atom.layout_src_tv), tma_atom.value_type.width,
                   plain_layout(bound["smem_layout_"]))

    def _smem_tensor(self, builder, args, kwargs, result, name, sites, raw):
        call = _method_call(*raw[0], "get_tensor")
        storage_field = call.func.value.attr if call and isinstance(call.func.value, ast.Attribute) else None
        return _smem_tensor(result, name, sites, storage_field)

    def _partition(self, builder, args, kwargs, result, name, sites, raw):
        thr_copy, tensor = args[0], args[1]
        call = _method_call(*raw[0], builder)
        copy_expr = ast.unparse(call.func.value) if call else "?"
        tensor_expr = ast.unparse(call.args[0]) if call and call.args else "?"
        smem = _smem_tensor(tensor, tensor_expr, sites)
        if smem is None:
            return None
        copy = self._known_copy(_copy(thr_copy, copy_expr, sites))
        return Partition(f"{copy_expr}.{builder}({tensor_expr})", sites, builder, copy_expr, tensor_expr, copy, smem)

    def _known_copy(self, copy: Copy) -> Copy:
        """The recorded tiled copy a thread slice comes from: the same op and layouts, by
        preference under the name the slice was assigned to (`s2r = make_tiled_copy_A(...).get_slice(t)`)."""
        same = [known for known in self.out.copies
                if (known.op, known.tiler, known.tv_src, known.tv_dst) == (copy.op, copy.tiler, copy.tv_src, copy.tv_dst)]
        same.sort(key=lambda known: known.name != copy.name)
        return same[0] if same else copy

    def _fragment(self, builder, args, kwargs, result, name, sites, raw):
        if _memspace(result) != cute.AddressSpace.rmem:
            return None
        size = cute.size(result)
        if not isinstance(size, int):
            return None
        elem = result.element_type
        return Fragment(name, sites, elem.__name__, elem.width, size)


# Which KernelLayouts list each kind of record goes to.
_LISTS = {"smem_layout": "smem_layouts", "mma": "mmas", "copy": "copies", "tma": "tmas",
          "smem_tensor": "smem_tensors", "partition": "partitions", "fragment": "fragments"}


# (owner, attribute, kind): what the wrappers record. `owner` is where kernel code finds it.
BUILDERS = (
    (cute, "tile_to_shape", "smem_layout"),
    (sm90_utils, "make_smem_layout_a", "smem_layout"),
    (sm90_utils, "make_smem_layout_b", "smem_layout"),
    (cute, "make_tiled_mma", "mma"),
    (sm90_utils, "make_trivial_tiled_mma", "mma"),
    (cute, "make_tiled_copy_tv", "copy"),
    (cute, "make_tiled_copy_A", "copy"),
    (cute, "make_tiled_copy_B", "copy"),
    (cute, "make_tiled_copy_C", "copy"),
    (cpasync, "make_tiled_tma_atom", "tma"),
    (cute.struct._MemRangeData, "get_tensor", "smem_tensor"),
    (cute_atom.ThrCopy, "partition_S", "partition"),
    (cute_atom.ThrCopy, "partition_D", "partition"),
    (cute, "make_rmem_tensor", "fragment"),
    (cute, "make_rmem_tensor_like", "fragment"),
    (cute, "make_fragment_like", "fragment"),
    (cute_atom.MmaAtom, "make_fragment_A", "fragment"),
    (cute_atom.MmaAtom, "make_fragment_B", "fragment"),
    (cute_atom.MmaAtom, "make_fragment_C", "fragment"),
)


@contextlib.contextmanager
def _wrapped_builders(recorder: _Recorder):
    originals = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
                 for owner, name, _ in BUILDERS]
    try:
        for (owner, name, kind), (_, _, real) in zip(BUILDERS, originals):
            setattr(owner, name, _wrapper(recorder, real, name, kind))
        yield
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)


def _wrapper(recorder: _Recorder, real, name: str, kind: str):
    @functools.wraps(real)
    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        caller = sys._getframe(1)
        if _in_kernels(caller.f_code.co_filename):
            recorder.note(kind, name, args, kwargs, result, caller)
        return result

    return recorded


@contextlib.contextmanager
def dry_run(arch: str):
    """IR only, for `arch` (the DSL reads its settings once at import; set them per trace)."""
    from cutlass.cutlass_dsl import CuTeDSL

    env = CuTeDSL._get_dsl().envar
    saved = env._arch, env.dryrun
    env.arch, env.dryrun = arch, True
    try:
        yield
    finally:
        env.arch, env.dryrun = saved


def record(kernel, fake_args: tuple, arch: str) -> KernelLayouts:
    """See the module docstring. `kernel` is left as it was."""
    recorder = _Recorder()
    out = recorder.out
    out.kernel, out.arch = type(kernel).__qualname__, arch
    device_kernel = kernel.kernel
    parameters = inspect.signature(device_kernel)

    class Launch:
        """Stands for the device kernel's launcher: names `__call__`'s objects by the kernel's
        parameters once the body is traced."""

        def __init__(self, *args, **kwargs):
            self.bound = parameters.bind(*args, **kwargs).arguments
            self.launcher = device_kernel(*args, **kwargs)

        def launch(self, **settings):
            result = self.launcher.launch(**settings)
            out.threads = product(int(v) for v in settings["block"])
            named: dict[int, list[str]] = {}
            for name, value in self.bound.items():
                known = recorder.by_object.get(id(value))
                if known is not None:
                    # Equal objects are one record: tiled_mma_dkv, tiled_mma_dq
                    named.setdefault(id(known), []).append(name)
                    known.name = ", ".join(named[id(known)])
                elif isinstance(value, cute.struct):
                    out.storage = _storage(value)
                    out.smem_bytes = value.size_in_bytes()
            out.launch = {key: str(value) for key, value in settings.items() if key not in ("stream", "block")}
            if isinstance(settings.get("smem"), int):
                out.smem_bytes = settings["smem"]
            return result

    kernel.kernel = Launch
    try:
        with _wrapped_builders(recorder), dry_run(arch):
            cute.compile(kernel, *fake_args)
    finally:
        del kernel.kernel  # the class's own method again
    recorder.keep.clear()
    if not out.threads:
        raise ExplorerError(f"{out.kernel}: the trace reached no kernel launch")
    return out
