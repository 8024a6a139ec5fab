"""What the explorer derives from a kernel's recorded layouts: bank conflicts, TMA boxes, the
builder behind each shared-memory tensor. Host-side arithmetic over record.py's records."""

from __future__ import annotations

import dataclasses

from .algebra import CHUNK_BYTES, Conflicts, chunk_phases, conflicts_of, flatten, partition_phases
from .record import Partition, SmemLayout, SmemTensor, Tma


def line_mode(tensor: SmemTensor) -> int | None:
    """Which of a tile's two modes its lines run along (the other one is contiguous): 0 for a
    row-major (K-major) tile, 1 for a column-major one such as V^T; None when neither is."""
    contiguous = tensor.layout.unit_stride_mode()
    if tensor.layout.rank < 2 or contiguous not in (0, 1):
        return None
    return 1 - contiguous


def core_matrix_conflicts(tensor: SmemTensor) -> Conflicts | None:
    """The 8-line x 16-byte reads every ldmatrix / stmatrix matrix and every wgmma core matrix
    makes, over the first stage of the tile; None for a tensor that is not a 16-bit tile."""
    lines_along = line_mode(tensor)
    if lines_along is None or tensor.elem_bits != 16:
        return None
    addresses = tensor.addresses if lines_along == 0 else tensor.addresses.T
    return conflicts_of(chunk_phases(addresses, CHUNK_BYTES * 8 // tensor.elem_bits))


def copy_side(partition: Partition) -> tuple:
    """(thread-value layout, values per instruction) of the copy's shared-memory side."""
    copy = partition.copy
    if partition.method == "partition_S":
        return copy.tv_src, copy.src_values
    return copy.tv_dst, copy.dst_values


def access_bytes(partition: Partition) -> int:
    return copy_side(partition)[1] * partition.copy.elem_bits // 8


def partition_conflicts(partition: Partition) -> Conflicts | None:
    """Bank conflicts of a tiled copy on its shared-memory tensor; None when the copy's tile is
    not a contiguous block of the tensor or larger than it (the explorer does not model that)."""
    copy, tensor = partition.copy, partition.tensor
    if copy.tiler is None or tensor.layout.rank < 2 or any(t > s for t, s in zip(copy.tiler, tensor.shape)):
        return None
    tv, values = copy_side(partition)
    return conflicts_of(partition_phases(tv, copy.tiler, tensor.addresses, access_bytes(partition), values))


def builder_of(tensor: SmemTensor, layouts: list[SmemLayout]) -> SmemLayout | None:
    """The recorded layout a shared-memory tensor was made from: the same layout, or its outer
    layout with the swizzle moved onto the pointer (`get_tensor(layout.outer, swizzle=layout.inner)`)."""
    as_composed = dataclasses.replace(tensor.layout, swizzle=tensor.pointer_swizzle) if tensor.pointer_swizzle else None
    for built in layouts:
        if built.layout in (tensor.layout, as_composed):
            return built
    return None


def tma_swizzle_bytes(tma: Tma) -> int:
    """The TMA swizzle span: S<b,4,3> on byte addresses permutes 16-byte chunks within 2^b * 16
    bytes (128 for b = 3); 0 for none."""
    swizzle = tma.smem_layout.swizzle
    return 0 if swizzle is None or swizzle.bits == 0 else (1 << swizzle.bits) * CHUNK_BYTES


def tma_box(tma: Tma) -> tuple[int, int]:
    """(contiguous extent, rows) of one TMA box: the box runs along the smem layout's stride-1
    sub-mode as far as it is contiguous."""
    layout = tma.smem_layout
    mode = layout.unit_stride_mode()
    inner = 1
    if mode is not None:
        for size, stride in zip(flatten(layout.shape[mode]), flatten(layout.stride[mode])):
            if stride == 1 and size > 1:
                inner = size
                break
    return inner, tma.box_elems // inner


def tensor_bytes(tensor: SmemTensor) -> int:
    """Bytes a shared-memory tensor spans (its cosize), all stages."""
    layout = tensor.layout
    cosize = 1 + sum((s - 1) * d for s, d in zip(flatten(layout.shape), flatten(layout.stride)))
    return cosize * tensor.elem_bits // 8
