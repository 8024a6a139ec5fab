"""Context parallelism: ring attention over a sequence sharded across the ranks of a
`torch.distributed` process group.

Every rank holds one shard of q, k and v, shaped `(batch, local_seqlen, nheads, head_dim)` as
`flash_attn_func` takes them. The K/V shards travel around the ring (rank r sends to r + 1 and
receives from r - 1, with P2P operations started before each step's kernel and waited after it,
so the transfer hides behind the compute). At each of the W steps a rank attends its queries to
the K/V shard it holds and merges the partial result into its output by the LSE, in float32.
The backward runs the kernels' backward per step with the merged out and LSE, so that every step
sees the probabilities of the softmax over the whole sequence; dQ stays on its rank, dK and dV
travel around the ring with the K/V they belong to and end at their owner.

Layouts (how the global sequence of length S is split):

* "zigzag": into 2W chunks of S / 2W; rank r holds chunks r and 2W - 1 - r, concatenated. Under a
  causal mask every rank does the same work at every step (`ring_block`).
* "contiguous": into W chunks; rank r holds chunk r. Causal work grows with the rank: rank r
  computes r full blocks and one diagonal block, rank 0 idles for all but the first step.

Every kernel call goes through `cute_flash.api.forward` and `backward`, the public entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .errors import DimensionMismatchError, InvalidDimensionError, UnsupportedArgumentError
from .validate import (
    check_device,
    check_flag,
    check_kernel_dtype,
    check_qkv,
    check_reference_inputs,
    check_softmax_scale,
)

LAYOUTS = ("zigzag", "contiguous")

_KV_TAG, _DKV_TAG = 0, 1
"""Tags of the two streams of messages between neighbours: gloo matches sends to receives by
tag, and a rank has a K/V and a dK/dV receive from the same neighbour pending at once."""

_step_kernels = None
"""What computes each step: None for `cute_flash.api` (the GPU kernels); any object with the
same `forward` and `backward` otherwise. Tests on the CPU put float64 stand-ins here, which
also lifts the kernels' dtype and device rules."""


def _kernels():
    if _step_kernels is not None:
        return _step_kernels
    from . import api  # imports the CuTe DSL: only when a ring really runs

    return api


# --- Which part of which block each step computes ---------------------------------------------------


class RingBlock(NamedTuple):
    """One step's kernel call on one rank: local query rows [q_start, q_stop) against rows
    [k_start, k_stop) of the K/V shard held at that step, with or without the causal mask."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool

    @property
    def work(self) -> float:
        """Score elements computed (a diagonal block counts half, as FLOP conventions do)."""
        area = (self.q_stop - self.q_start) * (self.k_stop - self.k_start)
        return area / 2 if self.causal else float(area)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise UnsupportedArgumentError(
            f"layout={layout!r} is not supported; use one of {', '.join(map(repr, LAYOUTS))}")
    return layout


def ring_block(rank: int, source: int, local_seqlen: int, local_seqlen_k: int, layout: str,
               causal: bool) -> RingBlock | None:
    """What rank `rank` computes while it holds the K/V shard of rank `source` (None: nothing)."""
    full = RingBlock(0, local_seqlen, 0, local_seqlen_k, False)
    if not causal:
        return full
    if source == rank:
        # The shard's own keys: its positions keep the global order (zigzag: chunk r, then the
        # later chunk 2W-1-r), so the local causal mask is the global one.
        return full._replace(causal=True)
    if layout == "contiguous":
        return full if source < rank else None
    half = local_seqlen // 2
    if source < rank:
        # Chunk `source` precedes both of ours, chunk 2W-1-source follows both: all our rows
        # see the first half of the shard, none sees the second.
        return RingBlock(0, local_seqlen, 0, half, False)
    # source > rank: both of its chunks lie between our two; only our later chunk sees them.
    return RingBlock(half, local_seqlen, 0, local_seqlen_k, False)


def ring_steps(rank: int, world_size: int, local_seqlen: int, layout: str = "zigzag",
               causal: bool = True) -> list[RingBlock | None]:
    """The blocks rank `rank` computes, one per step (step s holds the shard of rank r - s)."""
    check_layout(layout)
    return [ring_block(rank, (rank - step) % world_size, local_seqlen, local_seqlen, layout, causal)
            for step in range(world_size)]


# --- The ring -----------------------------------------------------------------------------------------


class _Pending:
    """A tensor on its way from the previous rank; `wait` returns it once it has arrived (on CUDA:
    once the current stream is ordered after the transfer, without blocking the host)."""

    def __init__(self, works, received: torch.Tensor):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:  # the send too: its buffer may be reused once this returns
            work.wait()
        return self.received


class _Ring:
    """This rank's place in the process group's ring."""

    def __init__(self, group):
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.size = None, 0, 1  # one process: plain attention, no messages
            return
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        # P2P operations name peers by their global rank.
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        return (self.rank - step) % self.size

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _Pending:
        """Send `tensor` to the next rank and receive the previous rank's into a new buffer. With
        NCCL the transfer runs on NCCL's own stream, ordered after the work already queued on the
        current stream, so kernels queued next overlap it: no side stream is needed."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return _Pending(dist.batch_isend_irecv(ops), received)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs; a float64 input (the CPU stand-ins) keeps its precision."""
    return torch.promote_types(dtype, torch.float32)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse (views of the accumulators) <- the softmax-weighted union of both parts, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    # A row that no key has reached on either side keeps out = 0, lse = -inf; exp(-inf - (-inf))
    # would be nan there, so its weights are taken against 0 instead (both come out 0).
    base = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)  # (b, h, s) -> (b, s, h, 1)
    new_weight = torch.exp(block_lse - base).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.to(out.dtype) * new_weight)
    lse.copy_(new_lse)


def _ring_forward(q, k, v, ring: _Ring, layout: str, causal: bool, scale: float):
    kernels = _kernels()
    batch, seqlen, nheads, _ = q.shape
    out = torch.zeros(q.shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    lse = torch.full((batch, nheads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # one message per step instead of two
    for step in range(ring.size):
        incoming = ring.pass_on(kv, _KV_TAG) if step < ring.size - 1 else None
        block = ring_block(ring.rank, ring.source(step), seqlen, k.shape[1], layout, causal)
        if block is not None:
            rows, keys = slice(block.q_start, block.q_stop), slice(block.k_start, block.k_stop)
            block_out, block_lse = kernels.forward(q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                                   softmax_scale=scale, causal=block.causal)
            _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, layout: str, causal: bool, scale: float,
                   deterministic: bool):
    kernels = _kernels()
    seqlen = q.shape[1]
    dq = torch.zeros(q.shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    kv = torch.stack((k, v))
    dkv_incoming = None
    for step in range(ring.size):
        kv_incoming = ring.pass_on(kv, _KV_TAG) if step < ring.size - 1 else None
        block = ring_block(ring.rank, ring.source(step), seqlen, k.shape[1], layout, causal)
        if block is not None:
            rows, keys = slice(block.q_start, block.q_stop), slice(block.k_start, block.k_stop)
            block_dq, block_dk, block_dv = kernels.backward(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                softmax_scale=scale, causal=block.causal, deterministic=deterministic)
            dq[:, rows] += block_dq
        # The dK/dV of the shard held now: started here at step 0, else arriving from the previous
        # rank with the contributions of the ranks that held the shard before.
        if dkv_incoming is None:
            dkv = torch.zeros(kv.shape, dtype=_accumulator_dtype(k.dtype), device=k.device)
        else:
            dkv = dkv_incoming.wait()
        if block is not None:
            dkv[0][:, keys] += block_dk
            dkv[1][:, keys] += block_dv
        if ring.size > 1:
            # At the last step the shard held is the next rank's own (r - (W - 1) = r + 1 mod W):
            # this send delivers its finished dK/dV, and what arrives is this rank's.
            dkv_incoming = ring.pass_on(dkv, _DKV_TAG)
        if kv_incoming is not None:
            kv = kv_incoming.wait()
    if dkv_incoming is not None:
        dkv = dkv_incoming.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, causal, scale, deterministic):
        out, lse = _ring_forward(q, k, v, ring, layout, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout, ctx.causal, ctx.scale, ctx.deterministic = ring, layout, causal, scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        # Gradients are materialized (a zero dout when only lse was used): every rank of the ring
        # must take part in the backward's messages, whatever reached its loss.
        q, k, v, out, lse = ctx.saved_tensors
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.layout, ctx.causal, ctx.scale,
                                    deterministic)
        return dq, dk, dv, None, None, None, None, None


def _check_ring_inputs(q, k, v, layout: str, causal: bool) -> None:
    """Every rule before the first message, so that a bad call raises on every rank alike instead
    of leaving the others waiting."""
    check_reference_inputs(q, k, v)  # tensors, ranks, shapes (batch, head dim, GQA heads)
    if _step_kernels is None:
        check_kernel_dtype(check_qkv(q, k, v).dtype)
        check_device({"q": q, "k": k, "v": v})
    if causal and k.shape[1] != q.shape[1]:
        raise DimensionMismatchError(
            f"causal ring attention needs local shards of equal length: q has {q.shape[1]} rows, k and v {k.shape[1]}")
    if layout == "zigzag" and (q.shape[1] % 2 or k.shape[1] % 2):
        raise InvalidDimensionError(
            f"a zigzag shard is two chunks of equal length, so its length must be even: q has {q.shape[1]} rows, "
            f"k and v {k.shape[1]} (the global length must be a multiple of 2 * world_size)")


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = False,
                         softmax_scale: float | None = None, layout: str = "zigzag", deterministic: bool = False,
                         return_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    q: (batch, local_seqlen, nheads, headdim), k, v: (batch, local_seqlen_k, nheads_kv, headdim),
    this rank's shards in `layout` ("zigzag" or "contiguous"; `shard_sequence` makes them). Every
    rank calls it with shards of the same shapes. nheads a multiple of nheads_kv; fp16 or bf16 on
    an sm_80-or-newer GPU, one per rank (NCCL). Causal masking is over the global sequence, with
    equal local lengths for q and k (self-attention). Without an initialized process group (and
    `group=None`) it is plain attention on this process's tensors.

    Returns this rank's `out` (like q); `(out, lse)` with `return_lse=True`, lse (batch, nheads,
    local_seqlen) float32, natural log, not differentiable. Differentiable w.r.t. q, k, v: the
    backward exchanges messages too, so every rank must run it.
    """
    layout = check_layout(layout)
    causal, deterministic = check_flag("causal", causal), check_flag("deterministic", deterministic)
    return_lse = check_flag("return_lse", return_lse)
    _check_ring_inputs(q, k, v, layout, causal)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = _RingAttention.apply(q, k, v, _Ring(group), layout, causal, scale, deterministic)
    return (out, lse) if return_lse else out


# --- Sharding a sequence ----------------------------------------------------------------------------


def check_sequence_split(length: int, world_size: int, layout: str = "zigzag") -> int:
    """How many equal chunks a sequence of `length` is cut into for `world_size` ranks; a typed
    error when it cannot be."""
    check_layout(layout)
    pieces = 2 * world_size if layout == "zigzag" else world_size
    if length % pieces:
        raise InvalidDimensionError(
            f"a sequence of length {length} cannot be split for {world_size} ranks in the {layout} layout: "
            f"its length must be a multiple of {pieces}")
    return pieces


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str = "zigzag") -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` along `dim` (a new tensor; differentiable)."""
    layout = check_layout(layout)
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise InvalidDimensionError(f"need 0 <= rank < world_size, got rank {rank!r}, world_size {world_size!r}")
    chunks = x.chunk(check_sequence_split(x.shape[dim], world_size, layout), dim)
    if layout == "contiguous":
        return chunks[rank].clone(memory_format=torch.contiguous_format)
    return torch.cat((chunks[rank], chunks[2 * world_size - 1 - rank]), dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order (inverse of `shard_sequence`)."""
    layout = check_layout(layout)
    if len(shards) == 0:
        raise InvalidDimensionError("unshard_sequence needs at least one shard")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1:
        raise DimensionMismatchError(f"shards must have equal lengths along dim {dim}, got {sorted(lengths)}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    if lengths.pop() % 2:
        raise InvalidDimensionError("zigzag shards hold two chunks of equal length: their length must be even")
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Chunks `rank` and 2W - 1 - `rank` of `x` cut into 2W chunks along `dim`, concatenated."""
    return shard_sequence(x, dim, rank, world_size, "zigzag")


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    return unshard_sequence(shards, dim, "zigzag")


def gather_sequence(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Every rank's shard `x` gathered into the full sequence, on every rank (not differentiable)."""
    layout = check_layout(layout)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return x  # one process, as in ring_flash_attn_func: the shard is the sequence
    size = dist.get_world_size(group)
    shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim, layout)
