"""The library `cute-flash export` builds, on the GPU: forward and backward through ctypes against
float64 attention ([B, H, N, D] tensors and any strides through the `_ex` functions; grouped-query
and multi-query backward; the deterministic backward's bit-identical gradients), and the examples
(a C program, a ctypes script) built and run as a user would."""

import ctypes
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_flash import device, export

from ..c_abi import Tensor, declare
from .common import assert_backward_accurate, assert_forward_accurate, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")]

REPO = Path(__file__).resolve().parents[2]
BF16, F32 = 1, 2
NOT_EXPORTED = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """bf16, d64, causal and not, forward and backward, for this GPU's target; the backward for
    kv_heads == heads and kv_heads < heads, each unordered and deterministic."""
    out = tmp_path_factory.mktemp("c-abi")
    export.export_library(out, device.target_arch(), ["bfloat16"], [64], (False, True), ("fwd", "bwd"),
                          jobs=min(6, os.cpu_count() or 1), gqas=(False, True), deterministics=(False, True))
    return out


@pytest.fixture(scope="module")
def lib(exported):
    return declare(ctypes.CDLL(str(exported / export.LIBRARY)))


def ok(lib, code):
    assert code == 0, lib.cuflash_last_error_message().decode()


def stream():
    return torch.cuda.current_stream().cuda_stream


def bhnd(t: torch.Tensor) -> Tensor:
    """The descriptor of a (batch, seqlen, heads, head_dim) view: the C ABI indexes [B, H, N, D]."""
    assert t.stride(3) == 1
    return Tensor(t.data_ptr(), t.stride(0), t.stride(2), t.stride(1))


def stat(lse: torch.Tensor) -> Tensor:
    return Tensor(lse.data_ptr(), lse.stride(0), lse.stride(1), lse.stride(2))


@pytest.mark.parametrize("causal", [False, True])
def test_forward_of_row_major_tensors(lib, causal):
    b, h, n, d = 2, 3, 200, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n), float("nan"), device="cuda")
    ok(lib, lib.cuflash_attention_forward_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                               lse.data_ptr(), b, h, n, d, 1 / math.sqrt(d), causal, stream()))
    torch.cuda.synchronize()
    bshd = lambda t: t.transpose(1, 2)
    assert_forward_accurate(bshd(out), lse, bshd(q), bshd(k), bshd(v), causal)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 300), (300, 100)])
def test_forward_ex_with_grouped_heads_other_key_lengths_and_strides(lib, seqlen_q, seqlen_k):
    b, h, hkv, d = 2, 4, 2, 64
    q = randn(b, seqlen_q, h, d, dtype=torch.bfloat16)  # stored (B, N, H, D)
    k, v = (randn(b, seqlen_k, hkv, d, dtype=torch.bfloat16, transposed=True) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, seqlen_q + 8), float("nan"), device="cuda")[:, :, :seqlen_q]
    ok(lib, lib.cuflash_attention_forward_ex(BF16, bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse), b, h, hkv,
                                             seqlen_q, seqlen_k, d, 1 / math.sqrt(d), 1, stream()))
    torch.cuda.synchronize()
    assert_forward_accurate(out, lse, q, k, v, causal=True)  # bottom-right; rows that see no key: 0 and -inf


@pytest.mark.parametrize("causal", [False, True])
def test_backward_of_row_major_tensors(lib, causal):
    b, h, n, d = 2, 3, 200, 64
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(4))
    lse = torch.empty(b, h, n, device="cuda")
    sizes = (b, h, n, d, 1 / math.sqrt(d), causal, stream())
    ok(lib, lib.cuflash_attention_forward_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                               lse.data_ptr(), *sizes))
    ok(lib, lib.cuflash_attention_backward_bf16(*(t.data_ptr() for t in (dout, q, k, v, out, lse, dq, dk, dv)),
                                                *sizes))
    torch.cuda.synchronize()
    bshd = lambda t: t.transpose(1, 2)
    assert_backward_accurate((bshd(dq), bshd(dk), bshd(dv)), bshd(dout), bshd(q), bshd(k), bshd(v), causal)


def test_backward_ex_with_other_key_lengths_and_strides(lib):
    b, h, sq, sk, d = 2, 4, 113, 203, 64
    q, dout = (randn(b, sq, h, d, dtype=torch.bfloat16, transposed=True) for _ in range(2))
    k, v = (randn(b, sk, h, d, dtype=torch.bfloat16) for _ in range(2))
    out, dq = torch.empty_like(q), torch.full_like(q, float("nan"))
    dk, dv = (torch.full((b, h, sk, d), float("nan"), device="cuda", dtype=torch.bfloat16).transpose(1, 2)
              for _ in range(2))
    lse = torch.empty(b, h, sq, device="cuda")
    scale = 1 / math.sqrt(d)
    ok(lib, lib.cuflash_attention_forward_ex(BF16, bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse), b, h, h, sq, sk,
                                             d, scale, 1, stream()))
    ok(lib, lib.cuflash_attention_backward_ex(BF16, bhnd(dout), bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse),
                                              bhnd(dq), bhnd(dk), bhnd(dv), b, h, h, sq, sk, d, scale, 1, 0,
                                              stream()))
    torch.cuda.synchronize()
    assert_backward_accurate((dq, dk, dv), dout, q, k, v, True)


def forward_ex(lib, q, k, v, causal):
    """(out, lse) of (B, N, H, D) views through cuflash_attention_forward_ex."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    ok(lib, lib.cuflash_attention_forward_ex(BF16, bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse), b, h, hkv, sq, sk,
                                             d, 1 / math.sqrt(d), causal, stream()))
    return out, lse


def backward_ex(lib, dout, q, k, v, out, lse, causal, deterministic=0):
    """(dq, dk, dv) through cuflash_attention_backward_ex, in fresh NaN-filled tensors (so any
    element the library leaves unwritten shows), after the work on the stream finished."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    ok(lib, lib.cuflash_attention_backward_ex(BF16, bhnd(dout), bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse),
                                              bhnd(dq), bhnd(dk), bhnd(dv), b, h, hkv, sq, sk, d, 1 / math.sqrt(d),
                                              causal, deterministic, stream()))
    torch.cuda.synchronize()
    return dq, dk, dv


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 203), (300, 100)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa-8:2", "mqa-8:1"])
def test_grouped_query_backward(lib, kv_heads, causal, seqlen_q, seqlen_k):
    """8 query heads on 2 (GQA) or 1 (MQA) key/value heads: each group's dK and dV summed by the
    library's group-sum kernel. (300, 100) causal: the first 200 query rows see no key."""
    b, h, d = 2, 8, 64
    q, dout = (randn(b, seqlen_q, h, d, dtype=torch.bfloat16, transposed=True) for _ in range(2))
    k, v = (randn(b, seqlen_k, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    assert lib.cuflash_backward_variant_exported(BF16, d, int(causal), 1, 0) == 1
    out, lse = forward_ex(lib, q, k, v, causal)
    grads = backward_ex(lib, dout, q, k, v, out, lse, causal)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert_backward_accurate(grads, dout, q, k, v, causal)


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa-8:2"])
def test_the_deterministic_backward_is_bit_identical(lib, kv_heads):
    """deterministic = 1: three backward calls on the same inputs give bitwise-equal dq (whose
    partial sums the key blocks add in turn), dk and dv. 1000 x 1000 causal: up to 8 key blocks
    add to one query block."""
    b, h, n, d = 2, 8, 1000, 64
    q, dout = (randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (randn(b, n, kv_heads, d, dtype=torch.bfloat16, transposed=True) for _ in range(2))
    assert lib.cuflash_backward_variant_exported(BF16, d, 1, int(kv_heads < h), 1) == 1
    out, lse = forward_ex(lib, q, k, v, True)
    runs = [backward_ex(lib, dout, q, k, v, out, lse, True, deterministic=1) for _ in range(3)]
    for other in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(first, again), f"{name} differs between deterministic runs"
    assert_backward_accurate(runs[0], dout, q, k, v, True)


def test_variants_left_out_are_refused_on_the_gpu_too(lib):
    t = torch.zeros(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    lse = torch.zeros(1, 2, 16, device="cuda")
    args = (t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(), lse.data_ptr(), 1, 2, 16, 64, 0.125, 0, stream())
    assert lib.cuflash_attention_forward_f16(*args) == NOT_EXPORTED
    assert lib.cuflash_attention_forward_f32(*args) == NOT_EXPORTED


@pytest.fixture(scope="module")
def lib_fp32(tmp_path_factory):
    """fp32 (split TF32), d64, causal and not, forward and backward (kv_heads == heads and <)."""
    out = tmp_path_factory.mktemp("c-abi-fp32")
    export.export_library(out, device.target_arch(), ["float32"], [64], (False, True), ("fwd", "bwd"),
                          jobs=min(6, os.cpu_count() or 1), gqas=(False, True), deterministics=(False,))
    return declare(ctypes.CDLL(str(out / export.LIBRARY)))


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_forward_and_backward_of_row_major_tensors(lib_fp32, causal):
    b, h, n, d = 2, 3, 150, 64
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float32) for _ in range(4))
    out, dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(4))
    lse = torch.full((b, h, n), float("nan"), device="cuda")
    sizes = (b, h, n, d, 1 / math.sqrt(d), causal, stream())
    ok(lib_fp32, lib_fp32.cuflash_attention_forward_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                        lse.data_ptr(), *sizes))
    ok(lib_fp32, lib_fp32.cuflash_attention_backward_f32(
        *(t.data_ptr() for t in (dout, q, k, v, out, lse, dq, dk, dv)), *sizes))
    torch.cuda.synchronize()
    bshd = lambda t: t.transpose(1, 2)
    assert_forward_accurate(bshd(out), lse, bshd(q), bshd(k), bshd(v), causal)
    assert_backward_accurate((bshd(dq), bshd(dk), bshd(dv)), bshd(dout), bshd(q), bshd(k), bshd(v), causal)


def test_fp32_grouped_query_backward_through_ex(lib_fp32):
    b, h, hkv, sq, sk, d = 2, 4, 2, 120, 90, 64
    q, dout = (randn(b, sq, h, d, dtype=torch.float32) for _ in range(2))
    k, v = (randn(b, sk, hkv, d, dtype=torch.float32) for _ in range(2))
    out, dq = torch.empty_like(q), torch.full_like(q, float("nan"))
    dk, dv = (torch.full_like(k, float("nan")) for _ in range(2))
    lse = torch.empty(b, h, sq, device="cuda")
    scale = 1 / math.sqrt(d)
    ok(lib_fp32, lib_fp32.cuflash_attention_forward_ex(F32, bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse), b, h, hkv,
                                                       sq, sk, d, scale, 1, stream()))
    ok(lib_fp32, lib_fp32.cuflash_attention_backward_ex(
        F32, bhnd(dout), bhnd(q), bhnd(k), bhnd(v), bhnd(out), stat(lse), bhnd(dq), bhnd(dk), bhnd(dv), b, h, hkv,
        sq, sk, d, scale, 1, 0, stream()))
    torch.cuda.synchronize()
    assert_forward_accurate(out, lse, q, k, v, causal=True)
    assert_backward_accurate((dq, dk, dv), dout, q, k, v, True)


def _cuda_root() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "include", "cuda.h").is_file():
            return Path(root)
    return None


def test_the_c_example(exported, tmp_path):
    root = _cuda_root()
    if root is None:
        pytest.skip("no CUDA toolkit headers (cuda.h) for the C example")
    stubs = root / "lib64" / "stubs"
    driver = ["-L", stubs, "-lcuda"] if (stubs / "libcuda.so").is_file() else ["-l:libcuda.so.1"]
    build = subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Werror", REPO / "examples" / "c_example.c",
                            "-I", exported, "-L", exported, "-lcute_flash", f"-Wl,-rpath,{exported}",
                            "-I", root / "include", *driver, "-lm", "-o", tmp_path / "c_example"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    run = subprocess.run([tmp_path / "c_example", arrays], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "f32 forward exported: 0" in run.stdout and run.stdout.rstrip().endswith("ok")

    # What the program computed, against float64 attention (the sizes are the example's).
    def load(name, dtype, shape):
        data = bytearray((arrays / f"{name}.bin").read_bytes())
        return torch.frombuffer(data, dtype=dtype).view(shape).cuda()

    q, k, v, dout, out, dq, dk, dv = (load(name, torch.bfloat16, (2, 3, 200, 64)).transpose(1, 2)
                                      for name in ("Q", "K", "V", "dO", "O", "dQ", "dK", "dV"))
    lse = load("L", torch.float32, (2, 3, 200))
    assert_forward_accurate(out, lse, q, k, v, causal=True)
    assert_backward_accurate((dq, dk, dv), dout, q, k, v, True)


def run_ctypes_example(library: Path):
    run = subprocess.run([sys.executable, REPO / "examples" / "ctypes_example.py", library], capture_output=True,
                         text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("ok")


def test_the_ctypes_example(exported):
    run_ctypes_example(exported / export.LIBRARY)


def test_the_statically_linked_runtime(exported, tmp_path):
    """--runtime static: one file, with the toolkit's static CUDA runtime. Run in its own process:
    a process holds one library of a soname."""
    if export.find_static_cudart() is None:
        pytest.skip("no libcudart_static.a (CUDA_HOME)")
    try:
        library = export.link_library(tmp_path, exported / "build", "static")
    except export.ExportError as exc:
        if "was built for CUDA" in str(exc):
            pytest.skip(str(exc))
        raise
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
        assert "cute_dsl_runtime" not in dynamic and "cudart" not in dynamic
    run_ctypes_example(library)
