"""The layout explorer (cute_flash/explorer, `cute-flash layouts`): its layout algebra against the
DSL's, its bank analysis on layouts whose conflicts are known, its numbers against the kernels'
own for one variant of each kernel family, its pictures, the docs it writes, and the command."""

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils.layout import LayoutEnum

from cute_flash import explorer
from cute_flash.explorer.algebra import Layout, Swizzle, conflicts_of
from cute_flash.explorer.analysis import core_matrix_conflicts, partition_conflicts, tma_box
from cute_flash.explorer.record import Copy, Partition, SmemTensor, dry_run, plain_layout

REPO = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def in_trace(build, arch="sm_80"):
    """build() run inside a DSL trace (a dry-run compile), for DSL objects that need one."""
    out = {}

    @cute.jit
    def traced():
        out["value"] = build()

    with dry_run(arch):
        cute.compile(traced)
    return out["value"]


# ----------------------------------------------------------------------------- algebra


def test_layout_evaluation_matches_the_dsl():
    def build():
        atom_64 = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
        atom_32 = cute.make_composed_layout(cute.make_swizzle(2, 3, 3), 0, cute.make_layout((8, 32), stride=(32, 1)))
        layouts = [
            cute.tile_to_shape(atom_64, (32, 128, 2), (0, 1, 2)),
            cute.tile_to_shape(atom_32, (64, 96), (0, 1)),
            cute.make_layout(((4, 8, 4), ((2, 2), (1, 2))), stride=((128, 1, 16), ((64, 8), (0, 512)))),
            sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (64, 64, 80), cutlass.BFloat16, 2),
        ]
        # plain_layout checks sampled coordinates itself; here every coordinate, by both routes.
        return [(plain_layout(layout), [layout(i) for i in range(cute.size(layout))]) for layout in layouts]

    for layout, expected in in_trace(build):
        assert layout is not None
        assert [layout(i) for i in range(layout.size)] == expected
        assert layout.table().tolist() == expected


def test_tuple_coordinates_split_per_mode():
    layout = Layout(((8, 4), (64, 2)), ((64, 512), (1, 2048)))
    # Row 9 is (1, 1) of the row mode, column 70 is (6, 1) of the column mode.
    assert layout((9, 70)) == 1 * 64 + 1 * 512 + 6 * 1 + 1 * 2048
    assert layout((9, 70)) == layout(9 + 32 * 70)


# ----------------------------------------------------------------------------- bank conflicts


def tile(layout: Layout, shape, pointer_swizzle=None) -> SmemTensor:
    return SmemTensor("t", (), layout, pointer_swizzle, 16, shape)


ROWS_OF_128_BYTES = Layout((8, 64), (64, 1))  # 8 rows of 64 16-bit elements, no swizzle


def test_core_matrices_of_an_unswizzled_tile_conflict_8_ways():
    # Column c of all 8 rows lies in one 16-byte bank group: each 8x8 matrix read takes 8 wavefronts.
    conflicts = core_matrix_conflicts(tile(ROWS_OF_128_BYTES, (8, 64)))
    assert (conflicts.worst, conflicts.wavefronts, conflicts.phases) == (8, 64, 8)
    assert str(conflicts) == "8-way conflicts (8.00 wavefronts per phase)"


def test_core_matrices_of_swizzled_tiles_are_conflict_free():
    elements = Layout((8, 64), (64, 1), Swizzle(3, 3, 3))  # the sm80 kernels' S<3,3,3> on element offsets
    assert core_matrix_conflicts(tile(elements, (8, 64))).free
    # The Hopper kernels put S<3,4,3> on the pointer, where it acts on byte addresses: the same 128-byte swizzle.
    assert core_matrix_conflicts(tile(ROWS_OF_128_BYTES, (8, 64), Swizzle(3, 4, 3))).free
    # On 16-bit element offsets S<3,4,3> would permute 32-byte units by pairs of rows: rows 2k and 2k+1
    # keep their chunk order, so every core matrix meets each bank group twice.
    misread = core_matrix_conflicts(tile(Layout((8, 64), (64, 1), Swizzle(3, 4, 3)), (8, 64)))
    assert misread.worst == 2


# What the sm80 forward's copies are (recorded from the kernel, see the report): 8 threads per
# 128-byte row writing 16 bytes each, and ldmatrix reading 16-byte rows of 8x8 matrices.
GMEM_TO_SMEM = Copy("g2s", (), "CopyG2SOp", 16, 128, (16, 64), Layout(((8, 16), (8, 1)), ((128, 1), (16, 0))),
                    Layout(((8, 16), (8, 1)), ((128, 1), (16, 0))), 8, 8)
LDMATRIX_A = Copy("ldsm", (), "LdMatrix8x8x16bOp", 16, 128, (64, 16), Layout(((16, 2, 4), (8, 1)), ((1, 512, 16), (64, 0))),
                  Layout(((4, 8, 4), ((2, 2, 2), 1)), ((128, 1, 16), ((64, 8, 512), 0))), 8, 8)


def partition(copy: Copy, method: str, tensor: SmemTensor) -> Partition:
    return Partition("p", (), method, "copy", "s", copy, tensor)


@pytest.mark.parametrize("swizzle, writes, reads", [(None, "conflict-free", 8), (Swizzle(3, 3, 3), "conflict-free", 1)])
def test_copies_on_a_64_by_64_tile(swizzle, writes, reads):
    tensor = tile(Layout((64, 64), (64, 1), swizzle), (64, 64))
    # A phase of the 16-byte writes covers one whole row: conflict-free with or without the swizzle.
    assert str(partition_conflicts(partition(GMEM_TO_SMEM, "partition_D", tensor))) == writes
    # A phase of ldmatrix reads one 16-byte column of 8 rows: 8-way without the swizzle.
    assert partition_conflicts(partition(LDMATRIX_A, "partition_S", tensor)).worst == reads


def test_threads_reading_one_word_share_it():
    same_word = [[0, 2, 128, 130]]  # two words of bank 0, each read twice
    assert conflicts_of(np.array(same_word)).worst == 2
    assert conflicts_of(np.array([[0, 4, 8, 124]])).worst == 1


# ----------------------------------------------------------------------------- against the kernels


def recorded(pass_name, arch, head_dim, kind=0):
    label, plan = explorer.kernel_plans(arch, pass_name, "bfloat16", head_dim, False, "long", 132)[kind]
    return plan, explorer.explore(label, plan)


@pytest.fixture(scope="module")
def sm80_forward():
    return recorded("fwd", "sm_80", 128)


def by_name(records, name):
    (found,) = [r for r in records if r.name == name]
    return found


def test_sm80_forward_numbers_are_the_kernels(sm80_forward):
    plan, explored = sm80_forward
    layouts, settings = explored.layouts, plan.settings()
    assert layouts.smem_bytes == plan.kernel_cls.smem_bytes(**settings) == 65536
    assert layouts.threads == settings["num_warps"] * 32
    assert by_name(layouts.smem_tensors, "sQ").shape == (settings["tile_m"], 128)
    assert by_name(layouts.smem_tensors, "sK").shape == (settings["tile_n"], 128, settings["num_stages"])
    mma = by_name(layouts.mmas, "tiled_mma")
    assert mma.tile_mnk == (settings["num_warps"] * 16, 16, 16) and mma.atom_mnk == (16, 8, 16)
    sQ_layout = by_name(layouts.smem_layouts, "sQ_layout")
    assert (sQ_layout.sites[0].path, sQ_layout.sites[0].function) == ("kernels/sm80/fwd.py", "_setup")
    # docs/kernels/sm80-forward.md: the swizzle makes cp.async writes and ldmatrix reads conflict-free.
    copies = {p.name: partition_conflicts(p) for p in layouts.partitions}
    assert {"gmem_thr_copy.partition_D(sQ)", "smem_thr_copy_Q.partition_S(sQ)",
            "smem_thr_copy_V.partition_S(sVt)"} <= set(copies)
    assert all(c.free for c in copies.values()), copies
    assert "sQ_layout = tile_to_shape(...) at kernels/sm80/fwd.py:" in explored.text


def test_sm90_forward_numbers_are_the_kernels():
    from cute_flash.kernels.sm90.config import SMEM_BYTES, smem_bytes

    plan, explored = recorded("fwd", "sm_90a", 128)
    layouts, config = explored.layouts, plan.config
    fields = {name: (offset, size) for name, offset, size in layouts.storage}
    elem = config.dtype.width // 8
    assert fields["sQ"][1] == config.q_stages * config.tile_m * config.head_dim * elem
    assert fields["sK"][1] == fields["sV"][1] == config.num_stages * config.tile_n * config.head_dim * elem
    # The config's estimate covers the barriers, Q and the K/V ring: the storage up to the end of sV.
    assert sum(fields["sV"]) == smem_bytes(config)
    assert layouts.smem_bytes <= SMEM_BYTES and layouts.threads == config.num_threads
    assert by_name(layouts.mmas, "tiled_mma_qk").tile_mnk == (config.tile_m, config.tile_n, 16)
    assert by_name(layouts.mmas, "tiled_mma_pv").tile_mnk == (config.tile_m, config.head_dim, 16)
    # The TMA boxes of a tile carry what the pipelines expect (tx_bytes_Q, tx_bytes_KV).
    for name, rows in (("tma_atom_Q", config.q_piece_rows), ("tma_atom_K", config.tile_n)):
        tma = by_name(layouts.tmas, name)
        inner, box_rows = tma_box(tma)
        assert inner == 64 and box_rows == rows  # 128-byte rows of 16-bit elements
        assert tma.box_elems * (config.head_dim // inner) == rows * config.head_dim
    assert by_name(layouts.smem_tensors, "sVt").pointer_swizzle == Swizzle(3, 4, 3)
    assert all(core_matrix_conflicts(t).free for t in layouts.smem_tensors if t.elem_bits == 16)


def test_sm80_backward_numbers_are_the_kernels():
    plan, explored = recorded("bwd", "sm_80", 64, kind=1)
    layouts, tiles = explored.layouts, plan.settings()
    m, n = tiles["m_block_size"], tiles["n_block_size"]
    fields = {name: size for name, _offset, size in layouts.storage}
    assert fields["sQ"] == m * 64 * tiles["num_stages_Q"] * 2 and fields["sP"] == fields["sdS"] == m * n * 2
    estimate = plan.kernel_cls.smem_bytes(**tiles)
    # What the launch asks for is the struct, padded to its 1024-byte alignment.
    assert estimate <= layouts.smem_bytes < estimate + 1024
    assert {mma.name for mma in layouts.mmas} == {"tiled_mma_sdp", "tiled_mma_dkv, tiled_mma_dq"}
    assert all(partition_conflicts(p).free for p in layouts.partitions)


def test_the_explorer_follows_the_kernels_own_builders(monkeypatch):
    """The layouts come from the kernel's code, not a copy: with the swizzle taken out of the
    sm80 forward's smem atom, the explorer reports ldmatrix's 8-way conflicts."""
    import cute_flash.kernels.sm80.fwd as sm80_fwd

    def unswizzled_atom(dtype, k_dim):
        return cute.make_composed_layout(cute.make_swizzle(0, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))

    monkeypatch.setattr(sm80_fwd, "smem_layout_atom", unswizzled_atom)
    _plan, explored = recorded("fwd", "sm_80", 128)
    copies = {p.name: partition_conflicts(p) for p in explored.layouts.partitions}
    assert copies["smem_thr_copy_Q.partition_S(sQ)"].worst == 8
    assert copies["gmem_thr_copy.partition_D(sQ)"].free  # whole 128-byte lines: no swizzle needed
    assert core_matrix_conflicts(by_name(explored.layouts.smem_tensors, "sQ")).worst == 8


# ----------------------------------------------------------------------------- pictures


def cell_group(svg_text: str) -> ET.Element:
    (group,) = [g for g in ET.fromstring(svg_text).iter(f"{SVG}g") if g.get("id") == "cells"]
    return group


def cells(svg_text: str) -> list[str]:
    """The cells' rectangles: one M ... z run of a <path> each."""
    return [rect for path in cell_group(svg_text).findall(f"{SVG}path") for rect in path.get("d").split("z") if rect]


def test_pictures_render(sm80_forward):
    _plan, explored = sm80_forward
    drawn = explorer.pictures(explored.layouts)
    expected_cells = {
        "smem-sQ.svg": 8 * 16,  # 8 lines of 128 elements: 16 chunks each
        "mma-tiled_mma-A.svg": 16 * 8,  # one warp's first 16 x 8 block
        "mma-tiled_mma-B.svg": 16 * 8,  # B is N x K = 16 x 16 per tiled-MMA tile (the N permutation)
        "mma-tiled_mma-C.svg": 16 * 8,
        "mma-tiled_mma-warps.svg": (64 // 8) * (16 // 8),
        "copy-gmem_tiled_copy_QKV-dst.svg": 16 * 8,  # 128 threads, one 16-byte access each
        "copy-smem_thr_copy_Q-src.svg": 32 * 2,  # rows 0-31 of the 64 x 16 tile, 8-element rows
    }
    for name, count in expected_cells.items():
        assert len(cells(drawn[name])) == count, name
    # sQ's swizzle S<3,3,3>: chunk c of line r sits in bank group c ^ r (first 64-element atom).
    groups = [int(label.text) for label in cell_group(drawn["smem-sQ.svg"]).iter(f"{SVG}tspan")]
    assert [groups[r * 16 + c] for r in range(8) for c in range(8)] == [c ^ r for r in range(8) for c in range(8)]


def test_docs_are_current(tmp_path):
    """docs/layouts/ holds what `cute-flash layouts --docs docs/layouts` writes (checked for the
    sm80 forward's folder), and docs/layouts.md embeds every picture there."""
    folder = REPO / "docs" / "layouts"
    (variant,) = [v for v in explorer.DOC_VARIANTS if v[0] == "sm80-fwd-bf16-d128"]
    for path in explorer.write_docs(tmp_path, [variant]):
        committed = folder / path.relative_to(tmp_path)
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run cute-flash layouts --docs docs/layouts"
    page = (REPO / "docs" / "layouts.md").read_text()
    pictures = sorted(str(p.relative_to(REPO / "docs")) for p in folder.glob("*/*.svg"))
    assert pictures and all(f"]({p})" in page for p in pictures)
    assert {v[0] for v in explorer.DOC_VARIANTS} == {p.name for p in folder.iterdir()}


# ----------------------------------------------------------------------------- the command


def test_layouts_command(capsys, tmp_path):
    from cute_flash import cli

    assert cli.main(["layouts", "--arch", "sm_80", "--head-dim", "64", "--causal", "--compile",
                     "--svg", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "forward, bfloat16 d64 causal, length class long, sm80 family, sm_80" in out
    assert "ptxas: " in out and " registers per thread, " in out
    assert "made at kernels/sm80/fwd.py:" in out
    drawn = sorted(p.name for p in (tmp_path / "FlashAttnFwdSm80").iterdir())
    assert "smem-sQ.svg" in drawn and "mma-tiled_mma-C.svg" in drawn


def test_layouts_usage_error(capsys):
    from cute_flash import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["layouts", "--length", "medium"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'medium' is not a length class; use one of short, short_512" in err
