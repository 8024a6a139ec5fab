"""Per-call launches: what a compiled plan needs besides q, k, v and the outputs.

    forward_launcher(plan)    -> launch(q, k, v, out, lse, softmax_scale[, *score_mods])
                                 (a packed batch's plan: launch(q, k, v, out, lse, cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, softmax_scale, *score_mods))
    backward_launcher(plan)   -> launch(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale[, *score_mods])
    backward_varlen_launcher(plan) -> launch(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, *score_mods)
    decode_launcher(plan)     -> launch(q, k_cache, v_cache, out, lse, cache_seqlens, seqlen_new,
                                        batch_idx, block_table, leftpad, softmax_scale, num_splits[, *score_mods])

A plan with score modifications (dispatch: `mods`) takes their runtime values last: window left,
window right, softcap, ALiBi slopes, None for each the plan leaves out (api._score_mods).

The sm90 forward: a persistent non-causal kernel cuts the tiles at the end of its walk into pieces
along the keys (kernels/sm90/tile_scheduler.py: tail_plan). Per call that takes a float32 workspace
for the pieces' O and LSE, from torch's caching allocator, and one counter per split tile. A
persistent kernel with the dynamic schedule takes one more counter, its next unit. The kernel
leaves every counter at zero: they are allocated once per (device, stream, problem shape), the
shape's tail plan after them, and reused (the last _KEPT_PLANS of them). A causal kernel with a
planned tail (planned_tail) takes its walk plan in the counters' place: made once per (device,
problem shape) and kept.

The sm90 fp32 forward (split TF32 on wgmma): a float32 workspace per call for the K_lo, V^T and
V^T_lo operands that its prepass writes (kernels/sm90/fwd_tf32_prep.py), from torch's caching
allocator.

The sm80 backward: three launches (preprocess, main, postprocess: dispatch.BackwardPlan) around a
float32 dQ accumulator; with grouped-query attention the main kernel writes per-query-head fp32
dK / dV and the groups are summed here (a fixed-order torch reduction, so deterministic mode stays
bit-reproducible).
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Callable

import torch

from . import dispatch
from .dispatch import BackwardPlan, DecodePlan, Plan
from .kernels.common.layouts import STAT_ROW_PAD, dq_accum_row, round_up
from .kernels.sm90.config import Sm90FwdConfig, Sm90Tf32FwdConfig
from .kernels.sm90.fwd_tf32_prep import padded_seqlen_k
from .kernels.sm90.tile_scheduler import TailPlan, plan_walk, tail_plan, tail_work


def forward_launcher(plan: Plan) -> Callable:
    """`launch(q, k, v, out, lse, softmax_scale[, *score_mods])` for a forward plan: compiles (or
    loads) its kernel and adds the per-call arguments that kernel takes beyond these."""
    compiled = plan.compiled()
    if isinstance(plan.config, Sm90Tf32FwdConfig):
        return sm90_tf32_forward_launcher(compiled)
    if isinstance(plan.config, Sm90FwdConfig):
        if plan.config.varlen:
            return sm90_varlen_forward_launcher(compiled, plan.config)
        return sm90_forward_launcher(compiled, plan.config)
    return compiled


_KEPT_PLANS = 256
_counters: OrderedDict[tuple, tuple[TailPlan | None, torch.Tensor]] = OrderedDict()
_unused: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def _counters_for(device: torch.device, num_sms: int, plan: TailPlan | None = None,
                  plan_key: tuple = ()) -> torch.Tensor:
    """The zeroed counters (TailPlan.plan_offset of them) and after them the words of `plan`, kept
    per (device, stream, plan_key) while the plan is the same (the last _KEPT_PLANS keys)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, stream, *plan_key)
    kept = _counters.get(key)
    if kept is None or kept[0] is not plan:
        words = [0] * TailPlan.plan_offset(num_sms) + (plan.words(plan_key[0]) if plan is not None else [])
        kept = _counters[key] = (plan, torch.tensor(words, dtype=torch.int32, device=device))
        # Bounded, as _tail_plan is: one small tensor per problem shape would otherwise stay for
        # good. A dropped tensor's memory goes back to its stream's pool, so a kernel still queued
        # on that stream finishes with it before anything else gets it.
        if len(_counters) > _KEPT_PLANS:
            del _counters[next(iter(_counters))]
    else:
        _counters.move_to_end(key)
    return kept[1]


def _unused_workspace(device: torch.device, head_dim: int) -> tuple[torch.Tensor, ...]:
    workspace = _unused.get((device.index, head_dim))
    if workspace is None:
        workspace = _unused[(device.index, head_dim)] = (
            torch.empty(1, 1, head_dim, dtype=torch.float32, device=device),
            torch.empty(1, 1, dtype=torch.float32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
    return workspace


@lru_cache(maxsize=256)
def _walk_plan(device_index: int, seqlen_q: int, seqlen_k: int, num_heads_batch: int, tile_m: int, tile_n: int,
               num_sms: int) -> torch.Tensor:
    plan = plan_walk(seqlen_q, seqlen_k, num_heads_batch, tile_m, tile_n, num_sms)
    return torch.tensor(plan, dtype=torch.int32, device=torch.device("cuda", device_index))


def sm90_forward_launcher(compiled, config: Sm90FwdConfig) -> Callable:
    """`launch(q, k, v, out, lse, softmax_scale[, *score_mods])` for a compiled FlashAttnFwdSm90 of
    `config`: plans the tail split of this call and passes its workspace (and the score
    modifications' values to a kernel with them: its `call_with_mods`)."""
    tile_m, tile_n, head_dim, num_sms = config.tile_m, config.tile_n, config.head_dim, config.num_sms
    # What the kernel takes in its workspace slots.
    splits_tail, counts_units, plans_tail = config.splits_tail, config.dynamic_schedule, config.planned_tail

    def launch(q, k, v, out, lse, softmax_scale, *mods):
        plan, whole_tiles = None, 0
        if splits_tail:
            batch, seqlen_q, heads, _ = q.shape
            plan_key = (-(-seqlen_q // tile_m) * heads * batch, -(-k.shape[1] // tile_n), num_sms,
                        tail_work(seqlen_q, tile_m, heads * batch), counts_units)
            plan = _tail_plan(*plan_key)
            whole_tiles = plan_key[0] if plan is None else plan.whole_tiles(plan_key[0])
        if plan is not None:
            slots = len(plan.units)
            workspace = (
                torch.empty(slots, tile_m, head_dim, dtype=torch.float32, device=q.device),
                torch.empty(slots, tile_m, dtype=torch.float32, device=q.device),
                _counters_for(q.device, num_sms, plan, plan_key),
            )
        else:
            workspace = _unused_workspace(q.device, head_dim)
            if counts_units:
                workspace = workspace[:2] + (_counters_for(q.device, num_sms),)
            elif plans_tail:
                batch, seqlen_q, heads, _ = q.shape
                workspace = workspace[:2] + (
                    _walk_plan(q.device.index, seqlen_q, k.shape[1], heads * batch, tile_m, tile_n, num_sms),)
        compiled(q, k, v, out, lse, *workspace, softmax_scale, whole_tiles, len(plan.units) if plan else 0, *mods)

    return launch


def sm90_tf32_forward_launcher(compiled) -> Callable:
    """`launch(q, k, v, out, lse, softmax_scale)` for a compiled FlashAttnFwdSm90Tf32: the workspace
    its prepass fills (K_lo, and V^T, V^T_lo with keys contiguous, padded to a multiple of 8), from
    torch's caching allocator per call; the compiled function runs the prepass and the forward."""

    def launch(q, k, v, out, lse, softmax_scale):
        batch, seqlen_k, nheads_kv, head_dim = k.shape
        k_lo = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        vt_shape = (batch, nheads_kv, head_dim, padded_seqlen_k(seqlen_k))
        vt = torch.empty(vt_shape, dtype=torch.float32, device=k.device)
        vt_lo = torch.empty(vt_shape, dtype=torch.float32, device=k.device)
        compiled(q, k, v, out, lse, k_lo, vt, vt_lo, softmax_scale)

    return launch


def sm90_varlen_forward_launcher(compiled, config: Sm90FwdConfig) -> Callable:
    """`launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
    *score_mods)` (the sm80 forward's `call_varlen` order) for a compiled FlashAttnFwdSm90 of a
    packed batch: no tail is split, so the workspace is the unused one, with the dynamic
    schedule's counter where the kernel has one."""

    def launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, *mods):
        workspace = _unused_workspace(q.device, config.head_dim)
        if config.dynamic_schedule:
            workspace = workspace[:2] + (_counters_for(q.device, config.num_sms),)
        compiled(q, k, v, out, lse, *workspace, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, *mods)

    return launch


@lru_cache(maxsize=_KEPT_PLANS)
def _tail_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int, dynamic_schedule: bool):
    return tail_plan(num_tiles, num_n_blocks, num_sms, work_tiles, dynamic_schedule)


# Row statistics are padded to a multiple of every m_block size the main kernel may use.
ROW_PAD = 128


def backward_launcher(plan: BackwardPlan) -> Callable:
    """`launch(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)` for a backward plan: compiles
    (or loads) its three kernels; each call writes the gradients into dq, dk, dv."""
    pre, main, post = (p.compiled() for p in (plan.pre, plan.main, plan.post))

    def launch(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, *mods):
        _backward_sm80(pre, main, post, plan, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mods)

    return launch


def _backward_sm80(pre, main, post, plan: BackwardPlan, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale,
                   mods: tuple = ()):
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    device = q.device
    f32 = torch.float32
    m_block = plan.m_block_size
    seqlen_q_pad = round_up(seqlen_q, ROW_PAD)
    lse_log2 = torch.empty(batch, nheads, seqlen_q_pad, dtype=f32, device=device)
    dpsum = torch.empty(batch, nheads, seqlen_q_pad, dtype=f32, device=device)
    num_m_blocks = (seqlen_q + m_block - 1) // m_block
    # zeroed by the preprocess, which reads O and dO row by row anyway
    dq_accum = torch.empty(batch, nheads, num_m_blocks * m_block * dq_accum_row(head_dim), dtype=f32, device=device)
    if plan.deterministic:
        semaphore = torch.zeros(batch, nheads, num_m_blocks, dtype=torch.int32, device=device)
    else:
        semaphore = torch.empty(1, 1, 1, dtype=torch.int32, device=device)  # never read
    if plan.gqa:
        dk_out = torch.empty(batch, seqlen_k, nheads, head_dim, dtype=f32, device=device)
        dv_out = torch.empty(batch, seqlen_k, nheads, head_dim, dtype=f32, device=device)
    else:
        dk_out, dv_out = dk, dv
    # TVM-FFI entry points: torch tensors as they are, the stream is the current torch stream.
    pre(out, dout, lse, lse_log2, dpsum, dq_accum)
    main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, semaphore, softmax_scale, *mods)
    post(dq_accum, dq, softmax_scale)
    if plan.gqa:
        group = nheads // nheads_kv
        dk.copy_(dk_out.view(batch, seqlen_k, nheads_kv, group, head_dim).sum(3))
        dv.copy_(dv_out.view(batch, seqlen_k, nheads_kv, group, head_dim).sum(3))


def backward_varlen_launcher(plan: BackwardPlan) -> Callable:
    """`launch(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, *score_mods)` for a packed variable-length backward plan (the three
    kernels' `call_varlen`): q, dq (total_q, nheads, hd), k, v, dk, dv (total_k, nheads_kv, hd),
    lse (nheads, total_q). Row statistics and the dQ sums live in packed buffers where sequence b
    starts at kernels.common.layouts.packed_stat_offset; the dQ semaphores stay per (sequence, head,
    query block of the longest sequence). Rows of dq, dk, dv outside every sequence keep their values."""
    pre, main, post = (p.compiled() for p in (plan.pre, plan.main, plan.post))

    def launch(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softmax_scale, *mods):
        total_q, nheads, head_dim = q.shape
        total_k, nheads_kv = k.shape[0], k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        device, f32 = q.device, torch.float32
        # Rounded up so that the rows' stride suits a TMA descriptor (the Hopper kernel's loads).
        rows = round_up(total_q + STAT_ROW_PAD * batch, STAT_ROW_PAD)
        lse_log2 = torch.empty(1, nheads, rows, dtype=f32, device=device)
        dpsum = torch.empty(1, nheads, rows, dtype=f32, device=device)
        # each sequence's rows zeroed by the preprocess; rows between sequences are never read
        dq_accum = torch.empty(1, nheads, rows * dq_accum_row(head_dim), dtype=f32, device=device)
        if plan.deterministic:
            m_blocks = -(-max_seqlen_q // plan.m_block_size)
            semaphore = torch.zeros(batch, nheads, m_blocks, dtype=torch.int32, device=device)
        else:
            semaphore = torch.empty(1, 1, 1, dtype=torch.int32, device=device)  # never read
        if plan.gqa:
            dk_out = torch.empty(1, total_k, nheads, head_dim, dtype=f32, device=device)
            dv_out = torch.empty(1, total_k, nheads, head_dim, dtype=f32, device=device)
        else:
            dk_out, dv_out = dk[None], dv[None]
        pre(out[None], dout[None], lse[None], lse_log2, dpsum, dq_accum, cu_seqlens_q, max_seqlen_q)
        main(q[None], k[None], v[None], dout[None], lse_log2, dpsum, dq_accum, dk_out, dv_out, semaphore,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, *mods)
        post(dq_accum, dq[None], cu_seqlens_q, max_seqlen_q, softmax_scale)
        if plan.gqa:
            # Rows before the first sequence were never written: they keep dk / dv's values.
            inside = (torch.arange(total_k, device=device) >= cu_seqlens_k[0])[:, None, None]
            group = nheads // nheads_kv
            for grad, per_head in ((dk, dk_out), (dv, dv_out)):
                summed = per_head.view(total_k, nheads_kv, group, head_dim).sum(2)
                grad.copy_(torch.where(inside, summed.to(grad.dtype), grad))

    return launch


_decode_unused: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def _decode_placeholders(device: torch.device, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Tensors for the decode kernel's arguments a call does not use (the split workspace with one
    split, the batch index of a paged cache, the block table of a contiguous one): never read."""
    kept = _decode_unused.get((device.index, head_dim))
    if kept is None:
        kept = _decode_unused[(device.index, head_dim)] = (
            torch.empty(1, 1, 1, head_dim, dtype=torch.float32, device=device),
            torch.empty(1, 1, 1, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, 1, dtype=torch.int32, device=device),
        )
    return kept


def decode_launcher(plan: DecodePlan) -> Callable:
    """`launch(q, k_cache, v_cache, out, lse, cache_seqlens, seqlen_new, batch_idx, block_table,
    leftpad, softmax_scale, num_splits, *mod_args)` for a decode plan: with more than one split the
    kernel writes fp32 pieces into a workspace from torch's caching allocator and the combine kernel
    merges them into out and lse. batch_idx / block_table may be None where the cache kind does not
    use them, leftpad (cache_leftpad) where the plan has none; mod_args (window sides, softcap,
    slopes: api._score_mods) only for a plan with mods."""
    main = plan.main.compiled()
    # every merge up front, so no later call compiles or loads a kernel (as one inside a CUDA graph capture would)
    combines = {shape: merge.compiled() for shape, merge in plan.combines.items()}

    def launch(q, k_cache, v_cache, out, lse, cache_seqlens, seqlen_new, batch_idx, block_table, leftpad,
               softmax_scale, num_splits, *mod_args):
        o_unused, lse_unused, index_unused, table_unused = _decode_placeholders(q.device, q.shape[3])
        batch_idx = index_unused if batch_idx is None else batch_idx
        block_table = table_unused if block_table is None else block_table
        if num_splits == 1:
            main(q, k_cache, v_cache, out, lse, o_unused, lse_unused, cache_seqlens, batch_idx, block_table,
                 leftpad, seqlen_new, softmax_scale, 1, *mod_args)
            return
        batch, seqlen_q, nheads, head_dim = q.shape
        o_pieces = torch.empty(num_splits * batch, seqlen_q, nheads, head_dim, dtype=torch.float32, device=q.device)
        lse_pieces = torch.empty(num_splits * batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
        main(q, k_cache, v_cache, out, lse, o_pieces, lse_pieces, cache_seqlens, batch_idx, block_table,
             leftpad, seqlen_new, softmax_scale, num_splits, *mod_args)
        combines[dispatch.decode_merge_shape(batch * seqlen_q * nheads, num_splits)](
            o_pieces, lse_pieces, out, lse, num_splits)

    return launch
