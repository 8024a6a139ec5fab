"""Host side of the sm90 forward: the tail split's plan and the workspace for one call.

A persistent non-causal kernel cuts the tiles at the end of its walk into pieces along the keys
(kernels/sm90/fwd.py, `tail_plan`). Per call that takes a float32 workspace for the pieces' O
and LSE, from torch's caching allocator, and one counter per split tile. A persistent kernel with
the dynamic schedule takes one more counter, its next unit. The kernel leaves every counter at
zero: they are allocated once per (device, stream, problem shape), the shape's tail plan after
them, and reused (the last _KEPT_PLANS of them). A causal kernel with a planned tail
(`planned_tail`) takes its walk plan in the counters' place: made once per (device, problem
shape) and kept.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Callable

import torch

from .kernels.sm90.fwd import FlashAttnFwdSm90, TailPlan

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
    plan = FlashAttnFwdSm90.plan_walk(seqlen_q, seqlen_k, num_heads_batch, tile_m, tile_n, num_sms)
    return torch.tensor(plan, dtype=torch.int32, device=torch.device("cuda", device_index))


def launcher(compiled, config: dict) -> Callable:
    """`launch(q, k, v, out, lse, softmax_scale)` for a compiled FlashAttnFwdSm90 with init
    arguments `config`: plans the tail split of this call and passes its workspace."""
    tile_m, tile_n, head_dim = config["tile_m"], config["tile_n"], config["head_dim"]
    num_sms = config.get("num_sms", 0)
    # What the kernel takes in its workspace slots, as its own __init__ decides it.
    kernel = FlashAttnFwdSm90(**config)
    splits_tail, counts_units, plans_tail = kernel.splits_tail, kernel.dynamic_schedule, kernel.planned_tail

    def launch(q, k, v, out, lse, softmax_scale):
        plan, whole_tiles = None, 0
        if splits_tail:
            batch, seqlen_q, heads, _ = q.shape
            plan_key = (-(-seqlen_q // tile_m) * heads * batch, -(-k.shape[1] // tile_n), num_sms,
                        FlashAttnFwdSm90.tail_work(seqlen_q, tile_m, heads * batch), counts_units)
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
        compiled(q, k, v, out, lse, *workspace, softmax_scale, whole_tiles, len(plan.units) if plan else 0)

    return launch


@lru_cache(maxsize=_KEPT_PLANS)
def _tail_plan(num_tiles: int, num_n_blocks: int, num_sms: int, work_tiles: int, dynamic_schedule: bool):
    return FlashAttnFwdSm90.tail_plan(num_tiles, num_n_blocks, num_sms, work_tiles, dynamic_schedule)
