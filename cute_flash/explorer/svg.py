"""Pictures of a kernel's recorded layouts, as small self-contained SVG files.

    smem_svg(tensor)          a shared-memory tile: each 16-byte chunk, coloured by bank group
    tv_svg(mma, operand)      an MMA operand's thread/value map (A, B or C), one 16 x 8 block
    warps_svg(mma)            which warp owns which part of an MMA's accumulator tile
    copy_svg(copy, side)      a tiled copy's thread map, one cell per instruction's access

Every picture shows a window of at most a few hundred cells (the patterns repeat; the title
says which part is shown) and names the layout and the kernel function that builds it. In the
<g id="cells"> of a picture each cell is one rectangle of a <path> ("M x y h w v h h -w z")
and each label line one <text>.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from .algebra import CHUNK_BYTES, Layout, phase_threads, tv_owners
from .analysis import line_mode
from .record import Copy, Mma, Record, SmemTensor

# Eight bank groups of 16 bytes (4 banks each) make up the 128 bytes all 32 banks serve at once.
BANK_GROUPS = 8
BANK_COLORS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5")
TITLE_LINE = 15
MARGIN = 34


def _hue(index: int, count: int) -> str:
    return f"hsl({round(360 * (index % count) / count)},65%,78%)"


class _Picture:
    """A grid of cells under a title, with row and column numbers. The cells of one colour are
    one <path> (a rectangle per cell) and each line of labels one <text>, which keeps a picture
    of a few hundred cells within about 20 KB."""

    def __init__(self, title: list[str], rows: int, cols: int, cell_w: int, cell_h: int,
                 row_name: str, col_name: str, col_step: int = 1, row_step: int = 1):
        self.title, self.rows, self.cols = title, rows, cols
        self.cell_w, self.cell_h, self.col_step, self.row_step = cell_w, cell_h, col_step, row_step
        self.row_name, self.col_name = row_name, col_name
        self.styles: dict[str, str] = {}
        self.cells: dict[str, list[str]] = {}  # class -> its cells' rectangles
        self.labels: dict[float, list[tuple[float, str]]] = {}  # baseline -> (centre, label) on it
        self.legend: list[tuple[str, str]] = []
        self.top = TITLE_LINE * len(title) + 30

    def style(self, css_class: str, fill: str) -> str:
        self.styles[css_class] = fill
        return css_class

    def cell(self, row: int, col: int, css_class: str, label: list[str], height: int = 1, width: int = 1):
        x, y = MARGIN + col * self.cell_w, self.top + row * self.cell_h
        w, h = width * self.cell_w, height * self.cell_h
        self.cells.setdefault(css_class, []).append(f"M{x} {y}h{w}v{h}h-{w}z")
        first = y + h / 2 - 5 * (len(label) - 1) + 3
        for i, text in enumerate(label):
            self.labels.setdefault(first + 10 * i, []).append((x + w / 2, text))

    def render(self) -> str:
        width = MARGIN + self.cols * self.cell_w + 10
        legend_top = self.top + self.rows * self.cell_h + 12
        height = legend_top + (16 if self.legend else 0) + 4
        width = max(width, 7 * max(len(line) for line in self.title) + 20)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="9">',
               "<style>path,rect{stroke:#666;stroke-width:0.5}text{text-anchor:middle}"
               ".t{text-anchor:start;font-size:11px}.a{fill:#666}"
               + "".join(f".{name}{{fill:{fill}}}" for name, fill in sorted(self.styles.items())) + "</style>",
               '<rect width="100%" height="100%" fill="#fff" stroke="none"/>']
        for i, line in enumerate(self.title):
            out.append(f'<text class="t" x="4" y="{14 + TITLE_LINE * i}">{escape(line)}</text>')
        axis_y = self.top - 4
        out.append(f'<text class="t a" x="4" y="{axis_y - 10}">{escape(self.col_name)} →, {escape(self.row_name)} ↓</text>')
        for c in range(0, self.cols, self.col_step):
            out.append(f'<text class="a" x="{MARGIN + (c + 0.5) * self.cell_w:g}" y="{axis_y}">{c}</text>')
        for r in range(0, self.rows, self.row_step):
            out.append(f'<text class="a" x="{MARGIN / 2:g}" y="{self.top + (r + 0.5) * self.cell_h + 3:g}">{r}</text>')
        out.append('<g id="cells">' + "".join(f'<path class="{css_class}" d="{"".join(rects)}"/>'
                                              for css_class, rects in self.cells.items())
                   + "".join(_label_line(y, labels) for y, labels in self.labels.items()) + "</g>")
        x = 4
        for css_class, text in self.legend:
            out.append(f'<rect class="{css_class}" x="{x}" y="{legend_top}" width="10" height="10"/>'
                       f'<text class="t" x="{x + 13}" y="{legend_top + 9}">{escape(text)}</text>')
            x += 20 + 7 * len(text)
        out.append("</svg>")
        return "\n".join(out) + "\n"


def _label_line(y: float, labels: list[tuple[float, str]]) -> str:
    """One line of cell labels: one <text>, a <tspan> per label."""
    return f'<text y="{y:g}">' + "".join(f'<tspan x="{x:g}">{escape(text)}</tspan>' for x, text in labels) + "</text>"


def _made_at(record: Record) -> str:
    """The kernel function that builds a record, without line numbers (pictures in the docs stay
    valid while the lines around them move)."""
    return record.where(with_line=False)


def smem_svg(tensor: SmemTensor, max_lines: int = 8, max_chunks: int = 32) -> str:
    """The first `max_lines` lines (8: one period of a 128-byte swizzle) of stage 0."""
    lines_along = line_mode(tensor)
    elems_per_chunk = CHUNK_BYTES * 8 // tensor.elem_bits
    lines = min(tensor.shape[lines_along], max_lines)
    chunks = min(tensor.shape[1 - lines_along] // elems_per_chunk, max_chunks)
    contiguous = 1 - lines_along
    title = [
        f"{tensor.name}: shared-memory tile {'x'.join(map(str, tensor.shape))} of {tensor.elem_bits}-bit elements"
        f" (lines along mode {lines_along}, 16-byte chunks along mode {contiguous}), stage 0,"
        f" lines 0-{lines - 1}, chunks 0-{chunks - 1}",
        f"layout {tensor.layout}, swizzle {tensor.swizzle_text}",
        f"made at {_made_at(tensor)}",
        "number and colour: the chunk's bank group (its 16 bytes use banks 4g..4g+3);"
        " a line's 8 chunks at one column in 8 different groups = conflict-free ldmatrix / wgmma reads",
    ]
    picture = _Picture(title, lines, chunks, 18, 14, f"line (mode {lines_along})", "16-byte chunk", col_step=1)
    for group in range(BANK_GROUPS):
        picture.legend.append((picture.style(f"b{group}", BANK_COLORS[group]), f"group {group}"))
    addresses = tensor.addresses if lines_along == 0 else tensor.addresses.T
    for line in range(lines):
        for chunk in range(chunks):
            group = int(addresses[line, chunk * elems_per_chunk]) // CHUNK_BYTES % BANK_GROUPS
            picture.cell(line, chunk, f"b{group}", [str(group)])
    return picture.render()


OPERANDS = {"A": ("M", "K"), "B": ("N", "K"), "C": ("M", "N")}


def _operand_extent(mma: Mma, operand: str) -> tuple[int, int]:
    m, n, k = mma.tile_mnk
    return {"A": (m, k), "B": (n, k), "C": (m, n)}[operand]


def tv_svg(mma: Mma, operand: str, max_rows: int = 16, max_cols: int = 8) -> str:
    """The operand's first max_rows x max_cols: one warp's 16 x 8 block of the m16n8k16 and
    wgmma layouts, which repeat it over values, warps and tiles."""
    tv = mma.tv[operand]
    rows, cols = _operand_extent(mma, operand)
    owners = tv_owners(tv, rows, cols)
    shown_rows, shown_cols = min(rows, max_rows), min(cols, max_cols)
    row_name, col_name = OPERANDS[operand]
    title = [
        f"{mma.name}: operand {operand} ({row_name} x {col_name} = {rows} x {cols} per tiled-MMA tile),"
        f" rows 0-{shown_rows - 1}, columns 0-{shown_cols - 1}",
        f"{mma.op}",
        f"(thread, value) -> {row_name}, {col_name}: {tv}",
        f"made at {_made_at(mma)}",
        "cell: thread T and its value index V; colour: the thread's lane",
    ]
    picture = _Picture(title, shown_rows, shown_cols, 30, 24, row_name, col_name)
    for (r, c), (thread, value) in sorted(owners.items()):
        if r < shown_rows and c < shown_cols:
            lane = thread % 32
            picture.cell(r, c, picture.style(f"l{lane}", _hue(lane, 32)), [f"T{thread}", f"V{value}"])
    return picture.render()


def warps_svg(mma: Mma) -> str:
    rows, cols = _operand_extent(mma, "C")
    block = 8 if rows * cols <= 128 * 64 else 16  # at most a few hundred cells
    owners = tv_owners(mma.tv["C"], rows, cols)
    warps = mma.threads // 32
    title = [
        f"{mma.name}: warps over the accumulator tile (M x N = {rows} x {cols}), one cell per {block} x {block} block",
        f"threads {mma.thr_layout}, permutation {mma.permutation}, made at {_made_at(mma)}",
    ]
    picture = _Picture(title, rows // block, cols // block, 24, 14, f"M / {block}", f"N / {block}")
    for r in range(rows // block):
        for c in range(cols // block):
            warp = owners[(r * block, c * block)][0] // 32
            picture.cell(r, c, picture.style(f"w{warp}", _hue(warp, warps)), [f"W{warp}"])
    return picture.render()


def copy_svg(copy: Copy, side: str, max_rows: int = 32, max_cols: int = 64) -> str:
    """`side`: "src" or "dst", the copy's shared-memory side."""
    tv: Layout = copy.tv_src if side == "src" else copy.tv_dst
    values = copy.src_values if side == "src" else copy.dst_values
    rows, cols = copy.tiler
    access = values * copy.elem_bits // 8
    per_phase = phase_threads(access)
    # One thread's consecutive values run down a column (e.g. a transposed read) or along a row.
    down = values > 1 and tv((0, 1)) - tv((0, 0)) == 1
    shown_rows, shown_cols = min(rows, max_rows), min(cols, max_cols)
    title = [
        f"{copy.name}: {copy.op}, tile {rows} x {cols}, rows 0-{shown_rows - 1}, columns 0-{shown_cols - 1},"
        f" {side} side",
        f"(thread, value) -> row, column: {tv}",
        f"made at {_made_at(copy)}",
        f"cell: one thread's {access}-byte access; colour: which of its warp's phases"
        f" ({per_phase} threads each) the thread belongs to",
    ]
    # Elements small enough for long tiles, accesses wide (or tall) enough for their label.
    element = max(7, -(-28 // values))
    picture = _Picture(title, shown_rows, shown_cols, 28 if down else element, element if down else 14, "row",
                       "column", col_step=1 if down else max(1, 56 // element), row_step=max(1, 56 // element) if down else 1)
    phases = max(1, 32 // per_phase)
    for phase in range(phases):
        picture.legend.append((picture.style(f"p{phase}", _hue(phase, phases)), f"phase {phase}"))
    covered = set()
    for thread in range(tv.mode_size(0)):
        for first in range(0, tv.mode_size(1), values):
            index = tv((thread, first))
            r, c = index % rows, index // rows
            if r >= shown_rows or c >= shown_cols or (r, c) in covered:
                continue  # outside the window, or the same elements as another warp's (a broadcast)
            covered.add((r, c))
            span = min(values, (shown_rows - r) if down else (shown_cols - c))
            picture.cell(r, c, f"p{thread % 32 // per_phase}", [f"T{thread}"],
                         height=span if down else 1, width=1 if down else span)
    return picture.render()
