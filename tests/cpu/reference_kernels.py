"""Float64 stand-ins for the kernels (`cute_flash.api.forward` and `backward`), so everything built
on them (autograd, the flash-attn interface, SDPA and transformers routing) runs on the CPU. They
honour the same keyword arguments (`out`, `lse`, `dq`, `dk`, `dv`, `softmax_scale`, `causal`,
`deterministic`, `window_size`, `softcap`, `alibi_slopes`) and record every call."""

from __future__ import annotations

import math

import torch

from cute_flash import reference_attention
from cute_flash.reference import alibi_bias, visible_keys


def _mods(window_size, softcap, alibi_slopes) -> dict:
    """The score modifications of a call, for its record: none when the call has none."""
    if tuple(window_size) == (-1, -1) and softcap == 0.0 and alibi_slopes is None:
        return {}
    return {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes}


def _dropout(dropout_p, rng_state) -> dict:
    """A dropout call's arguments, recorded only when dropout is on."""
    return {"dropout_p": dropout_p, "rng_state": rng_state} if dropout_p else {}


def _keep(q, k, dropout_p, rng_state):
    """The kernels' keep mask of a dropout call (cute_flash.dropout), None without dropout."""
    if not dropout_p:
        return None
    from cute_flash.dropout import dropout_keep_mask

    return dropout_keep_mask(q.shape[0], q.shape[2], q.shape[1], k.shape[1], dropout_p, rng_state)


class ReferenceKernels:
    def __init__(self):
        self.forward_calls: list[dict] = []
        self.backward_calls: list[dict] = []

    def forward(self, q, k, v, *, out=None, lse=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
        self.forward_calls.append({"q": q, "k": k, "v": v, "softmax_scale": softmax_scale, "causal": causal,
                                   **_mods(window_size, softcap, alibi_slopes), **_dropout(dropout_p, rng_state)})
        ref_out, ref_lse = reference_attention(q.detach(), k.detach(), v.detach(), softmax_scale=softmax_scale,
                                               causal=causal, window_size=window_size, softcap=softcap,
                                               alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                               dropout_keep=_keep(q, k, dropout_p, rng_state))
        result_out, result_lse = ref_out.to(q.dtype), ref_lse.float()
        if out is not None:
            out.copy_(result_out)
            result_out = out
        if lse is not None:
            lse.copy_(result_lse)
            result_lse = lse
        return result_out, result_lse

    def backward(self, dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, softmax_scale=None, causal=False,
                 deterministic=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                 rng_state=None):
        """FlashAttention-2's backward equations in float64 (the kernels run below autograd, so the
        stand-in cannot differentiate the reference itself). Like the kernels, it takes P from the
        given `lse` (P = exp(scale * S - lse)) and D = rowsum(dO * O) from the given `out`, never from
        a softmax of its own: a caller that passes the out and lse of a larger attention (ring
        attention passes the merged ones of the whole sequence) gets that attention's gradients."""
        self.backward_calls.append({"softmax_scale": softmax_scale, "causal": causal, "deterministic": deterministic,
                                    **_mods(window_size, softcap, alibi_slopes), **_dropout(dropout_p, rng_state)})
        scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        group = q.shape[2] // k.shape[2]
        qh, doh, oh = (t.double().transpose(1, 2) for t in (q, dout, out))
        kh, vh = (t.double().transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
        scores = qh @ kh.transpose(-1, -2) * scale
        capped = torch.ones_like(scores)  # d(capped score) / d(scaled score)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
            capped = 1 - (scores / softcap) ** 2
        if alibi_slopes is not None:
            scores = scores + alibi_bias(alibi_slopes.reshape(-1, q.shape[2]), q.shape[1], k.shape[1])
        scores = scores.masked_fill(~visible_keys(q.shape[1], k.shape[1], causal, window_size), float("-inf"))
        # A row that sees no key has lse = -inf: exp(-inf - (-inf)) is nan there, and its P is 0.
        probs = torch.exp(scores - lse.double().unsqueeze(-1)).nan_to_num(0.0)
        # Dropout (FlashAttention-2's backward): Z = keep / (1 - p); dV = (P Z)^T dO,
        # dS = P (dP Z - D), D = rowsum(dO O) of the dropped output.
        keep = _keep(q, k, dropout_p, rng_state)
        dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
        dp = doh @ vh.transpose(-1, -2)
        if keep is not None:
            dp = dp * keep / (1.0 - dropout_p)
        ds = probs * (dp - (doh * oh).sum(-1, keepdim=True)) * capped
        grads = [(ds @ kh) * scale, (ds.transpose(-1, -2) @ qh) * scale, dropped.transpose(-1, -2) @ doh]

        def per_kv_head(t):
            b, h, s, d = t.shape
            return t.view(b, h // group, group, s, d).sum(2)

        grads = [grads[0].transpose(1, 2), per_kv_head(grads[1]).transpose(1, 2), per_kv_head(grads[2]).transpose(1, 2)]
        results = []
        for given, grad, like in zip((dq, dk, dv), grads, (q, k, v)):
            grad = grad.to(like.dtype)
            if given is not None:
                given.copy_(grad)
                grad = given
            results.append(grad)
        return tuple(results)


def install(monkeypatch) -> ReferenceKernels:
    from cute_flash import api  # the CuTe DSL comes with it: only for the tests that patch it

    kernels = ReferenceKernels()
    monkeypatch.setattr(api, "forward", kernels.forward)
    monkeypatch.setattr(api, "backward", kernels.backward)
    return kernels


class ReferenceVarlenKernels(ReferenceKernels):
    """Stand-ins for `cute_flash.varlen.forward_varlen` and `backward_varlen` (packed sequences),
    sequence by sequence through the dense stand-ins above; rows of no sequence get out = 0,
    lse = -inf, and gradients 0 (or keep a given gradient's values), as the kernels leave them."""

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                       causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, check_values=True):
        from cute_flash.reference import reference_varlen_attention

        self.forward_calls.append({"q": q, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                                   "max_seqlen": (max_seqlen_q, max_seqlen_k), "softmax_scale": softmax_scale,
                                   "causal": causal, **_mods(window_size, softcap, alibi_slopes)})
        out, lse = reference_varlen_attention(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k,
                                              softmax_scale, causal, window_size, softcap, alibi_slopes)
        return out.to(q.dtype), lse.float()

    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        dq=None, dk=None, dv=None, softmax_scale=None, causal=False, deterministic=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, check_values=True):
        grads = [torch.zeros_like(t) if given is None else given for t, given in ((q, dq), (k, dk), (v, dv))]
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(starts_q) - 1):
            rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
                grads[0][rows_q] = 0  # no score: every gradient of the sequence is zero
                grads[1][rows_k] = 0
                grads[2][rows_k] = 0
                continue
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            seq = self.backward(dout[rows_q][None], q[rows_q][None], k[rows_k][None], v[rows_k][None],
                                out[rows_q][None], lse[:, rows_q][None], softmax_scale=softmax_scale, causal=causal,
                                deterministic=deterministic, window_size=window_size, softcap=softcap,
                                alibi_slopes=slopes)
            for grad, rows, part in zip(grads, (rows_q, rows_k, rows_k), seq):
                grad[rows] = part[0]
        return tuple(grads)


def install_varlen(monkeypatch) -> ReferenceVarlenKernels:
    from cute_flash import varlen

    kernels = ReferenceVarlenKernels()
    monkeypatch.setattr(varlen, "forward_varlen", kernels.forward_varlen)
    monkeypatch.setattr(varlen, "backward_varlen", kernels.backward_varlen)
    return kernels
