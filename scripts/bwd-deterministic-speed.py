"""Backward TFLOP/s with and without deterministic=True (and their ratio), bf16, paper shapes; run on the GPU:
    python scripts/bwd-deterministic-speed.py
"""
import os, torch, triton
import cute_flash
from cute_flash import api
rows = []
for hd, seqlen, causal in ((64, 8192, False), (64, 8192, True), (128, 8192, False), (128, 8192, True), (128, 2048, False)):
    b, h = 16384 // seqlen, 2048 // hd
    q, k, v, do = (torch.randn(b, seqlen, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cute_flash.forward(q, k, v, causal=causal)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    flops = 2.5 * 4 * b * h * seqlen * seqlen * hd * (0.5 if causal else 1.0)
    res = []
    for det in (False, True):
        fn = lambda: cute_flash.backward(do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=causal, deterministic=det)
        ms = min(triton.testing.do_bench(fn, warmup=50, rep=300) for _ in range(2))
        res.append(flops / ms / 1e9)
    rows.append((hd, seqlen, causal, *res))
print("hd seqlen causal  bwd TF/s  deterministic TF/s  ratio")
for hd, s, c, a, d in rows:
    print(f"{hd:3d} {s:6d} {str(c):5s} {a:8.1f} {d:8.1f} {d/a:6.3f}")
