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
from typing import Iterable

import numpy as np

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
        return self.apply(x)

    def apply(self, x):
        """The swizzle of an int or of a numpy array of them."""
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
        # Each top-level mode's flattened (sizes, strides), evaluated often.
        object.__setattr__(self, "_modes", tuple((flatten(shape), flatten(stride))
                                                 for shape, stride in zip(self.shape, self.stride)))

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
            pairs = [(flatten(self.shape), flatten(self.stride), coord)]
        else:
            pairs = [(sizes, strides, c) for (sizes, strides), c in zip(self._modes, coord)]
        offset = self.offset
        for sizes, strides, c in pairs:
            last = len(sizes) - 1
            for i, (s, d) in enumerate(zip(sizes, strides)):
                # The last sub-mode takes what is left, as CuTe's crd2idx does.
                offset += (c if i == last else c % s) * d
                c //= s
        return offset

    def table(self) -> np.ndarray:
        """The offsets of every linear coordinate 0 .. size - 1, swizzle applied (as __call__)."""
        index = np.arange(self.size, dtype=np.int64)
        offsets = np.full(self.size, self.offset, dtype=np.int64)
        for s, d in zip(flatten(self.shape), flatten(self.stride)):
            offsets += index % s * d
            index //= s
        return self.swizzle.apply(offsets) if self.swizzle is not None else offsets

    def __call__(self, coord) -> int:
        offset = self.outer_offset(coord)
        return self.swizzle(offset) if self.swizzle is not None else offset

    def unit_stride_mode(self) -> int | None:
        """The first top-level mode that holds a stride-1 sub-mode of more than one element
        (the contiguous one)."""
        for mode, (sizes, strides) in enumerate(self._modes):
            if any(d == 1 and s > 1 for s, d in zip(sizes, strides)):
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


def conflicts_of(phases: np.ndarray) -> Conflicts:
    """Wavefronts of phases given as rows of byte addresses (each element at most 4 bytes, so in
    one bank word): per phase and bank, the distinct words touched (threads reading one word share
    it); a phase takes as many wavefronts as its busiest bank has words."""
    phases = np.asarray(phases, dtype=np.int64)
    if phases.size == 0:
        return Conflicts(0, 0, 0)
    count = phases.shape[0]
    words = phases // BANK_BYTES
    # Distinct (phase, word) pairs, then how many of them fall on each (phase, bank).
    pairs = np.unique(np.arange(count)[:, None] * (1 << 40) + words)
    phase_of, word = pairs >> 40, pairs & ((1 << 40) - 1)
    busy, per_bank = np.unique(phase_of * BANKS + word % BANKS, return_counts=True)
    ways = np.zeros(count, dtype=np.int64)
    np.maximum.at(ways, busy // BANKS, per_bank)
    return Conflicts(int(ways.max()), int(ways.sum()), count)


def chunk_phases(addresses: np.ndarray, elems_per_chunk: int) -> np.ndarray:
    """The core-matrix reads of a tile whose (lines, elements) byte addresses are `addresses`:
    for each 16-byte column and each group of 8 lines, the 8 chunks at that column (one 8x8
    matrix of ldmatrix, ldmatrix.trans or stmatrix, one wgmma core matrix), one row each."""
    lines = addresses.shape[0] - addresses.shape[0] % 8
    chunks = addresses.shape[1] // elems_per_chunk
    blocks = addresses[:lines, :chunks * elems_per_chunk].reshape(lines // 8, 8, chunks, elems_per_chunk)
    return blocks.transpose(0, 2, 1, 3).reshape(-1, 8 * elems_per_chunk)


def partition_phases(tv: Layout, tiler: tuple[int, int], addresses: np.ndarray, access_bytes: int,
                     access_values: int) -> np.ndarray:
    """The phases of a tiled copy applied to a tensor (`partition_S` / `partition_D`), one row of
    byte addresses each: the copy's (thread, value) -> tile layout `tv` repeats over the tensor,
    whose (rows, columns) byte addresses are `addresses`, in tiles of `tiler`; each thread moves
    `access_values` consecutive values (`access_bytes`) per instruction."""
    threads, values = tv.mode_size(0), tv.mode_size(1)
    tile_m, tile_n = tiler
    per_phase = phase_threads(access_bytes)
    offsets = tv.table().reshape(values, threads).T  # [thread, value] -> offset in the tile
    rows, cols = offsets % tile_m, offsets // tile_m
    groups = threads // per_phase, per_phase, values // access_values, access_values
    phases = []
    for rep_n in range(addresses.shape[1] // tile_n):
        for rep_m in range(addresses.shape[0] // tile_m):
            tile = addresses[rows + rep_m * tile_m, cols + rep_n * tile_n].reshape(groups)
            phases.append(tile.transpose(0, 2, 1, 3).reshape(-1, per_phase * access_values))
    return np.concatenate(phases) if phases else np.zeros((0, 0), dtype=np.int64)


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
