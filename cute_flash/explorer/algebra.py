"""Layout algebra and shared-memory bank analysis on the host, in plain Python.

The explorer records the kernels' layouts inside a DSL trace (record.py) and turns each one into
a `Layout` here, so that everything after the trace (the analysis, the report, the pictures) runs
without a DSL context and fast enough to evaluate every element of a tile.

A CuTe layout maps a coordinate to an offset: the coordinate of each top-level mode is split over
that mode's flattened shape colexicographically (first sub-mode fastest) and the pieces are
weighted by the strides; a plain integer coordinate is split over all modes the same way. A
composed layout `S<b,m,s> o offset o outer` applies the swizzle to `offset + outer(coord)`. The
recording checks this evaluation against the DSL's own on every layout it records, so the two
cannot drift apart unnoticed.

Shared memory has 32 banks of 4 bytes. A warp's access is served in phases: all 32 threads
together for accesses of up to 4 bytes, half-warps for 8 bytes, quarter-warps (8 threads) for
16 bytes, which is also how `ldmatrix` / `stmatrix` take their 8 row addresses per 8x8 matrix. A
phase whose threads touch k different 4-byte words of one bank takes k wavefronts: a k-way
conflict. Conflict-free means every phase takes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

BANKS = 32
BANK_BYTES = 4
WAVEFRONT_BYTES = BANKS * BANK_BYTES
CHUNK_BYTES = 16  # the 16-byte vector: cp.async, ldmatrix rows, wgmma core-matrix rows


def flatten(nested) -> tuple:
    if isinstance(nested, tuple):
        return tuple(x for item in nested for x in flatten(item))
    return (nested,)


def product(values: Iterable[int]) -> int:
    total = 1
    for v in values:
        total *= v
    return total


@dataclass(frozen=True)
class Swizzle:
    """CuTe's S<bits, base, shift>: XOR the `bits` bits found `shift` above bit `base` into the
    bits from `base` up."""

    bits: int
    base: int
    shift: int

    def __call__(self, x: int) -> int:
        mask = (1 << self.bits) - 1
        if self.shift >= 0:
            return x ^ ((x & (mask << (self.base + self.shift))) >> self.shift)
        return x ^ ((x & (mask << self.base)) << -self.shift)

    def __str__(self) -> str:
        return f"S<{self.bits},{self.base},{self.shift}>"


@dataclass(frozen=True)
class Layout:
    """A static layout: nested (shape, stride), and for a composed layout its swizzle and offset."""

    shape: tuple
    stride: tuple
    swizzle: Swizzle | None = None
    offset: int = 0

    def __post_init__(self):
        if not isinstance(self.shape, tuple):  # a rank-1 layout n:d is the one mode (n,):(d,)
            object.__setattr__(self, "shape", (self.shape,))
            object.__setattr__(self, "stride", (self.stride,))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return product(flatten(self.shape))

    def mode_size(self, mode: int) -> int:
        return product(flatten(self.shape[mode]))

    def outer_offset(self, coord) -> int:
        """The offset before the swizzle."""
        if isinstance(coord, int):
            pairs = [(self.shape, self.stride, coord)]
        else:
            pairs = zip(self.shape, self.stride, coord)
        offset = self.offset
        for shape, stride, c in pairs:
            sizes, strides = flatten(shape), flatten(stride)
            for i, (s, d) in enumerate(zip(sizes, strides)):
                # The last sub-mode takes what is left, as CuTe's crd2idx does.
                digit = c if i == len(sizes) - 1 else c % s
                offset += digit * d
                c //= s
        return offset

    def __call__(self, coord) -> int:
        offset = self.outer_offset(coord)
        return self.swizzle(offset) if self.swizzle is not None else offset

    def unit_stride_mode(self) -> int | None:
        """The first top-level mode that holds a stride-1 sub-mode (the contiguous one)."""
        for mode, stride in enumerate(self.stride):
            if 1 in flatten(stride):
                return mode
        return None

    def __str__(self) -> str:
        body = f"{_text(self.shape)}:{_text(self.stride)}"
        return body if self.swizzle is None else f"{self.swizzle} o {self.offset} o {body}"


def _text(nested) -> str:
    if isinstance(nested, tuple):
        return "(" + ",".join(_text(x) for x in nested) + ")"
    return str(nested)


# ----------------------------------------------------------------------------- bank conflicts


def phase_threads(access_bytes: int) -> int:
    """Threads served together for accesses of this width (see the module docstring)."""
    return BANKS if access_bytes <= BANK_BYTES else WAVEFRONT_BYTES // access_bytes


def phase_ways(accesses: Iterable[Iterable[int]]) -> int:
    """Wavefronts one phase takes: per bank, the distinct 4-byte words its threads touch (threads
    reading the same word share it). `accesses` holds each thread's byte addresses."""
    words_per_bank: dict[int, set[int]] = {}
    for addresses in accesses:
        for address in addresses:
            word = address // BANK_BYTES
            words_per_bank.setdefault(word % BANKS, set()).add(word)
    return max((len(words) for words in words_per_bank.values()), default=0)


@dataclass(frozen=True)
class Conflicts:
    worst: int  # the most wavefronts one phase took
    wavefronts: int
    phases: int

    @property
    def free(self) -> bool:
        return self.worst <= 1

    def __str__(self) -> str:
        if self.phases == 0:
            return "no accesses"
        if self.free:
            return "conflict-free"
        return f"{self.worst}-way conflicts ({self.wavefronts / self.phases:.2f} wavefronts per phase)"


def conflicts_of(phases: Iterable[list[list[int]]]) -> Conflicts:
    ways = [phase_ways(p) for p in phases]
    return Conflicts(max(ways, default=0), sum(ways), len(ways))


def chunk_phases(address: Callable[[tuple], int], lines: int, chunks: int, elems_per_chunk: int,
                 line_mode: int) -> list[list[list[int]]]:
    """The core-matrix reads of a tile: for each 16-byte column and each group of 8 lines, the 8
    chunks at that column (one 8x8 matrix of ldmatrix, ldmatrix.trans or stmatrix, one wgmma core
    matrix). `address(coord)` is an element's byte address; the lines run along mode `line_mode`
    of the tile and the chunks along the other one."""

    def coord(line: int, element: int) -> tuple[int, int]:
        return (line, element) if line_mode == 0 else (element, line)

    phases = []
    for column in range(chunks):
        first_element = column * elems_per_chunk
        for first_line in range(0, lines - lines % 8, 8):
            phases.append([[address(coord(line, e)) for e in range(first_element, first_element + elems_per_chunk)]
                           for line in range(first_line, first_line + 8)])
    return phases


def partition_phases(tv: Layout, tiler: tuple[int, int], tensor_shape: tuple[int, int],
                     address: Callable[[tuple], int], access_bytes: int, access_values: int) -> list[list[list[int]]]:
    """The phases of a tiled copy applied to a tensor (`partition_S` / `partition_D`): the copy's
    (thread, value) -> tile layout `tv` repeats over the tensor's first two modes in tiles of
    `tiler`; each thread moves `access_values` consecutive values (`access_bytes`) per
    instruction. Elements are at most 4 bytes wide, so each lies in one bank word."""
    threads, values = tv.mode_size(0), tv.mode_size(1)
    tile_m, tile_n = tiler
    per_phase = phase_threads(access_bytes)
    offsets = [[tv((t, v)) for v in range(values)] for t in range(threads)]
    phases = []
    for rep_n in range(tensor_shape[1] // tile_n):
        for rep_m in range(tensor_shape[0] // tile_m):
            for first_value in range(0, values, access_values):
                for first in range(0, threads, per_phase):
                    phase = []
                    for t in range(first, min(first + per_phase, threads)):
                        addresses = []
                        for v in range(first_value, first_value + access_values):
                            index = offsets[t][v]
                            m, n = index % tile_m + rep_m * tile_m, index // tile_m + rep_n * tile_n
                            addresses.append(address((m, n)))
                        phase.append(addresses)
                    phases.append(phase)
    return phases


# ----------------------------------------------------------------------------- thread-value maps


def tv_owners(tv: Layout, rows: int, cols: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(row, col) of a rows x cols tile -> (thread, value) of its first owner, from a (thread,
    value) -> tile offset layout (column-major tile, as CuTe's TV layouts are)."""
    owners: dict[tuple[int, int], tuple[int, int]] = {}
    for t in range(tv.mode_size(0)):
        for v in range(tv.mode_size(1)):
            index = tv((t, v))
            owners.setdefault((index % rows, index // rows), (t, v))
    return owners


def per_thread(tv: Layout) -> bool:
    """Whether the threads of a warp own different parts of the tile (False for an operand a warp
    group reads from shared memory as a whole, e.g. wgmma's B)."""
    return len({tv((t, 0)) for t in range(min(32, tv.mode_size(0)))}) > 1
