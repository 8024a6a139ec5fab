"""Named benchmark suites: which problems are measured, in which passes, with which dtype.

A suite is data only (a list of `Cell`s); `bench.py` decides how to run them. Every cell
here has seqlen_q == seqlen_k, so causal masking is the same whether a library aligns the
causal diagonal top-left (torch SDPA) or bottom-right (cute-flash, FlashAttention >= 2.1), and so
is a sliding window's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

PASSES = ("fwd", "bwd", "fwdbwd")

# FLOPs of a pass relative to the forward pass (FlashAttention-2 paper convention):
# the backward does 5 matmuls to the forward's 2, fwd+bwd is the sum.
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass(frozen=True)
class Cell:
    """One attention problem. `kind` is "speed" (time every pass) or "memory" (peak bytes)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    passes: tuple[str, ...] = ("fwd",)
    kind: str = "speed"
    # flash-attn 2's score modifications: sliding window (left, right; -1 unbounded), softcap (0 off)
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False  # ALiBi with flash-attn's standard slopes (alibi_slopes)
    dropout_p: float = 0.0

    def key(self) -> dict:
        d = asdict(self)
        d.pop("passes")
        # a plain cell's key stays as it was before these fields existed
        if tuple(d["window"]) == (-1, -1):
            d.pop("window")
        for name, off in (("softcap", 0.0), ("alibi", False), ("dropout_p", 0.0)):
            if d[name] == off:
                d.pop(name)
        return d

    def mods(self) -> dict:
        """The cell's score modifications as keyword arguments of a method (perf/methods.py)."""
        mods = {}
        if tuple(self.window) != (-1, -1):
            mods["window"] = tuple(self.window)
        if self.softcap:
            mods["softcap"] = self.softcap
        if self.alibi:
            mods["alibi_slopes"] = alibi_slopes(self.nheads)
        if self.dropout_p:
            mods["dropout_p"] = self.dropout_p
        return mods

    def label(self) -> str:
        c = " causal" if self.causal else ""
        w = f" window={self.window[0]},{self.window[1]}" if tuple(self.window) != (-1, -1) else ""
        cap = f" softcap={self.softcap:g}" if self.softcap else ""
        alibi = " alibi" if self.alibi else ""
        drop = f" dropout={self.dropout_p:g}" if self.dropout_p else ""
        return f"B={self.batch} S={self.seqlen_q} H={self.nheads} D={self.headdim}{c}{w}{cap}{alibi}{drop}"


def alibi_slopes(nheads: int) -> torch.Tensor:
    """ALiBi's slopes for a power-of-two head count, 2^(-8 (h + 1) / nheads), float32 on the GPU."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32,
                        device="cuda" if torch.cuda.is_available() else "cpu")


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> int:
    """(query, key) pairs a row sees under flash-attn 2's bottom-right aligned window (causal sets
    right = 0): the FLOPs of a windowed cell are counted on this band only."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen_q):
        diag = i + seqlen_k - seqlen_q
        lo = 0 if left < 0 else max(0, diag - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diag + right)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(cell: Cell, pass_: str) -> float:
    """Matmul FLOPs: 4*B*H*Sq*Sk*D for the forward (QK^T and PV, 2 FLOPs per MAC),
    halved when causal with Sq == Sk (about half of the score matrix is computed)."""
    if tuple(cell.window) != (-1, -1):  # the visible band only
        fwd = 4.0 * cell.batch * cell.nheads * visible_pairs(cell.seqlen_q, cell.seqlen_k, cell.causal,
                                                             cell.window) * cell.headdim
        return fwd * PASS_FLOP_FACTOR[pass_]
    fwd = 4.0 * cell.batch * cell.nheads * cell.seqlen_q * cell.seqlen_k * cell.headdim
    if cell.causal and cell.seqlen_q == cell.seqlen_k:
        fwd /= 2
    return fwd * PASS_FLOP_FACTOR[pass_]


def attention_min_bytes(cell: Cell, pass_: str, elem_bytes: int) -> float:
    """Compulsory global-memory traffic, for the roofline: forward reads q, k, v and writes o;
    the backward additionally reads o, do and writes dq, dk, dv."""
    q = cell.batch * cell.seqlen_q * cell.nheads * cell.headdim
    kv = cell.batch * cell.seqlen_k * cell.nheads_kv * cell.headdim
    fwd = (2 * q + 2 * kv) * elem_bytes
    bwd = (4 * q + 4 * kv) * elem_bytes
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[pass_]


@dataclass
class Suite:
    name: str
    description: str
    dtype: str  # default; --dtype overrides
    cells: list[Cell] = field(default_factory=list)
    overhead: bool = False  # measure per-call host overhead
    unavailable: str | None = None  # set for a registered suite that cannot run yet
    methods: tuple[str, ...] | None = None  # the methods that take this dtype (default: all); --methods overrides
    accuracy: bool = False  # also each method's max error vs float64 on the cell's first batch element


def paper_suite() -> Suite:
    """FlashAttention-3 paper, Fig. 5-7: 16k tokens per batch, hidden 2048."""
    cells = []
    for headdim in (64, 128, 256):
        nheads = 2048 // headdim
        for causal in (False, True):
            for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
                cells.append(Cell(16384 // seqlen, seqlen, seqlen, nheads, nheads, headdim, causal, PASSES))
    return Suite("paper", "FA3-paper shapes: batch*seqlen = 16k, hidden 2048, hdim 64/128/256", "bf16", cells, overhead=True)


# The seed project's tables (CuFlash-Attn) give N and batch but not heads; we fix H=8, D=64,
# which keeps the N=64k standard-attention score matrix (8 * 64k^2 * 2 B = 64 GiB) right at the
# edge of an 80 GB part, so its O(N^2) growth is visible until it runs out of memory.
SEED_HEADS = 8
SEED_HEADDIM = 64


def seed_suite() -> Suite:
    cells = [
        Cell(1, n, n, SEED_HEADS, SEED_HEADS, SEED_HEADDIM, False, ("fwd", "fwdbwd"), kind="memory")
        for n in (1024, 4096, 16384, 65536)
    ]
    cells += [
        Cell(b, 1024, 1024, SEED_HEADS, SEED_HEADS, SEED_HEADDIM, True, ("fwd", "fwdbwd"))
        for b in (1, 8, 32)
    ]
    return Suite("seed", "CuFlash-Attn tables: memory at N=1k..64k (B=1,H=8,D=64), speed at B=1/8/32, N=1024 causal", "fp16", cells)


def quick_suite() -> Suite:
    cells = [
        Cell(8, 1024, 1024, 16, 16, 64, False, ("fwd", "bwd")),
        Cell(8, 1024, 1024, 16, 16, 64, True, ("fwd", "bwd")),
        Cell(4, 2048, 2048, 16, 16, 128, True, ("fwd", "bwd")),
        Cell(2, 4096, 4096, 16, 16, 128, False, ("fwd",)),
        Cell(1, 4096, 4096, 8, 8, 64, False, ("fwd",), kind="memory"),
        Cell(1, 16384, 16384, 8, 8, 64, False, ("fwd",), kind="memory"),
    ]
    return Suite("quick", "about one minute of smoke: a few shapes, fwd and bwd", "bf16", cells, overhead=True)


def fp32_suite() -> Suite:
    """fp32 inputs (split TF32) against every torch path that takes fp32, TF32 off in torch."""
    cells = [Cell(4, 4096, 4096, 16, 16, headdim, causal, ("fwd", "bwd"))
             for headdim in (64, 128) for causal in (False, True)]
    return Suite("fp32", "fp32 at B=4 S=4096 H=16, hdim 64/128: ours vs SDPA math / efficient and plain torch, "
                 "with each one's max error vs float64", "fp32", cells,
                 methods=("ours", "standard", "sdpa_math", "sdpa_efficient"), accuracy=True)


def mods_suite() -> Suite:
    """Issue 50's score modifications against the same shapes without them: a 1024-key sliding
    window at 16k causal (TFLOP/s on the visible band) next to dense causal, softcap 50 next to
    no cap at paper shapes (hidden 2048, 16k tokens), ALiBi and dropout 0.1 at 8k."""
    cells = [
        Cell(1, 16384, 16384, 16, 16, 128, True, ("fwd", "bwd"), window=(1024, 0)),
        Cell(1, 16384, 16384, 16, 16, 128, True, ("fwd", "bwd")),
    ]
    for headdim in (64, 128):
        for seqlen in (2048, 8192):
            for causal in (False, True):
                for softcap in (50.0, 0.0):
                    cells.append(Cell(16384 // seqlen, seqlen, seqlen, 2048 // headdim, 2048 // headdim, headdim,
                                      causal, ("fwd", "bwd"), softcap=softcap))
    for headdim in (64, 128):
        for causal in (False, True):
            for extra in (dict(alibi=True), dict(dropout_p=0.1)):
                cells.append(Cell(2, 8192, 8192, 2048 // headdim, 2048 // headdim, headdim, causal, ("fwd", "bwd"),
                                  **extra))
    return Suite("mods", "sliding window 1024 at 16k causal vs dense causal; softcap 50 vs none at paper shapes; "
                 "ALiBi and dropout 0.1 at 8k (beside the 8k cells without them)", "bf16", cells)


def headdims_suite() -> Suite:
    """The head dims outside the paper matrix that the Hopper kernels serve (96, 192): 16 heads,
    batch 2 at 8k, causal and not."""
    cells = [Cell(2, 8192, 8192, 16, 16, headdim, causal, PASSES) for headdim in (96, 192) for causal in (False, True)]
    return Suite("headdims", "head dims 96 and 192 at B=2 S=8192 H=16, causal and not", "bf16", cells)


def decode_suite() -> Suite:
    return Suite("decode", "decode against a KV cache", "bf16",
                 unavailable="KV-cache decode has its own runner: python -m cute_flash.perf decode (perf/decode.py)")


def varlen_suite() -> Suite:
    return Suite("varlen", "packed variable-length batches vs the same tokens padded", "bf16",
                 unavailable="packed batches have their own runner: python -m cute_flash.perf varlen (perf/varlen.py)")


SUITES = {"paper": paper_suite, "seed": seed_suite, "quick": quick_suite, "fp32": fp32_suite, "mods": mods_suite,
          "headdims": headdims_suite, "decode": decode_suite, "varlen": varlen_suite}


def get_suite(name: str) -> Suite:
    try:
        return SUITES[name]()
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}") from None
