"""The C ABI without a GPU or CUDA driver: every argument check of the exported library (called
from ctypes and from a C program), what it links, and the shim's views, workspace and launches,
watched through a build of cuflash.c against fake kernels and a fake CUDA runtime."""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cute_flash import cli, export
from cute_flash.errors import ErrorCode

from ..c_abi import Tensor, declare

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")

NOT_EXPORTED = 8
F16, BF16, F32 = 0, 1, 2


def compile_c(*argv, cwd):
    result = subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", *map(str, argv)], cwd=cwd, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def message(lib) -> str:
    return lib.cuflash_last_error_message().decode()


# ----------------------------------------------------------------------------- the header


def test_the_header_carries_the_python_error_codes():
    text = (export.C_ABI_DIR / export.HEADER).read_text()
    for code in ErrorCode:
        name = "CUFLASH_SUCCESS" if code is ErrorCode.SUCCESS else f"CUFLASH_ERROR_{code.name}"
        assert re.search(rf"\b{name} = {int(code)},", text), name
    assert f"CUFLASH_ERROR_VARIANT_NOT_EXPORTED = {NOT_EXPORTED}" in text
    assert export.abi_version() == 2  # 2: cuflash_attention_backward_ex takes `deterministic`


def test_the_api_doc_shows_the_header_as_shipped():
    doc = (export.C_ABI_DIR.parents[1] / "docs" / "api.md").read_text()
    blocks = re.findall(r"```c\n(.*?)```", doc, re.S)
    assert (export.C_ABI_DIR / export.HEADER).read_text() in blocks


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_header_is_plain_c_and_cxx_with_c_linkage(tmp_path):
    source = tmp_path / "use.cc"
    tensor = "const cuflash_tensor*"
    source.write_text('#include "cute_flash.h"\nint (*entry)(const void*, const void*, const void*, void*, float*, '
                      "int, int, int, int, float, int, void*) = cuflash_attention_forward_bf16;\n"
                      f"int (*backward)(int, {', '.join([tensor] * 9)}, int, int, int, int, int, int, float, int, int, "
                      "void*) = cuflash_attention_backward_ex;\n"
                      "int (*exported)(int, int, int, int, int) = cuflash_backward_variant_exported;\n")
    result = subprocess.run(["c++", "-fsyntax-only", "-Wall", "-Werror", "-I", export.C_ABI_DIR, source],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- the shim, with fake kernels

FAKE = r"""
#include <stdlib.h>
#include "cute_flash.h"
#include "cuflash_kernels.h"

/* One argument a fake kernel received. kind: 'B' cf_bshd, 'R' cf_rows, 'F' float, 'S' stream. */
typedef struct { int kernel; int kind; cf_bshd bshd; cf_rows rows; float scalar; void *stream; } seen_arg;
seen_arg seen[64];
int seen_count, launches, launch_order[8], argument_counts[8], init_calls, load_calls;
int current_device, device_major = 9, device_minor = 0, malloc_error, launch_error;
size_t malloc_bytes, memset_bytes;
void *malloc_pointer, *memset_pointer, *freed_pointer;
int memset_value = -1;

int _cudaGetDevice(int *device) { *device = current_device; return 0; }
int _cudaDeviceGetAttribute(int *value, int attribute, int device) {
    *value = attribute == 75 ? device_major : device_minor;
    return 0;
}
int _cudaMallocAsync(void **pointer, size_t bytes, void *stream) {
    if (malloc_error) return malloc_error;
    malloc_bytes = bytes;
    return (*pointer = malloc_pointer = malloc(bytes)) == NULL;
}
int _cudaMemsetAsync(void *pointer, int value, size_t bytes, void *stream) {
    memset_pointer = pointer; memset_value = value; memset_bytes = bytes;
    return 0;
}
int _cudaFreeAsync(void *pointer, void *stream) { freed_pointer = pointer; free(pointer); return 0; }

static void init(void **args) { init_calls++; **(void ***)args[0] = &init_calls; *(int32_t *)args[1] = 0; }
static void load_to_device(void **args) { load_calls++; *(int32_t *)args[2] = 0; }

static void record(int kernel, const char *kinds, void **args, int32_t count) {
    argument_counts[launches] = count;
    launch_order[launches++] = kernel;
    for (int i = 0; kinds[i]; i++) {
        seen_arg *s = &seen[seen_count++];
        s->kernel = kernel;
        s->kind = kinds[i];
        if (kinds[i] == 'B') s->bshd = *(cf_bshd *)args[i];
        if (kinds[i] == 'R') s->rows = *(cf_rows *)args[i];
        if (kinds[i] == 'F') s->scalar = *(float *)args[i];
        if (kinds[i] == 'S') s->stream = *(void **)args[i];
    }
    *(int32_t *)args[count - 1] = launch_error;
}
static void fwd(void **args, int32_t count) { record(0, "BBBBRFS", args, count); }
static void pre(void **args, int32_t count) { record(1, "BBRRRRS", args, count); }
static void main_(void **args, int32_t count) { record(2, "BBBBRRRBBRFS", args, count); }
static void post(void **args, int32_t count) { record(3, "RBFS", args, count); }
static void sum(void **args, int32_t count) { record(4, "BBBBS", args, count); }
static void main_gqa(void **args, int32_t count) { record(5, "BBBBRRRBBRFS", args, count); }
static void main_det(void **args, int32_t count) { record(6, "BBBBRRRBBRFS", args, count); }

static cf_kernel k_fwd = {"fwd", init, load_to_device, fwd, 0, 0}, k_pre = {"pre", init, load_to_device, pre, 0, 0},
                 k_main = {"main", init, load_to_device, main_, 0, 0}, k_post = {"post", init, load_to_device, post, 0, 0},
                 k_sum = {"sum", init, load_to_device, sum, 0, 0},
                 k_main_gqa = {"main/gqa", init, load_to_device, main_gqa, 0, 0},
                 k_main_det = {"main/deterministic", init, load_to_device, main_det, 0, 0};
const cf_forward_variant cf_forward_variants[] = {{CUFLASH_DTYPE_BF16, 64, 0, &k_fwd}, {0, 0, 0, 0}};
/* bf16 d64: non-causal plain and grouped-query, causal deterministic only; d128: grouped-query only. */
const cf_backward_variant cf_backward_variants[] = {
    {CUFLASH_DTYPE_BF16, 64, 0, 0, 0, 128, 64, &k_pre, &k_main, &k_post, 0},
    {CUFLASH_DTYPE_BF16, 64, 0, 1, 0, 128, 64, &k_pre, &k_main_gqa, &k_post, &k_sum},
    {CUFLASH_DTYPE_BF16, 64, 1, 0, 1, 128, 64, &k_pre, &k_main_det, &k_post, 0},
    {CUFLASH_DTYPE_BF16, 128, 0, 1, 0, 64, 128, &k_pre, &k_main_gqa, &k_post, &k_sum},
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
const int cf_target_major = 9, cf_target_minor = 0, cf_target_arch_specific = 1, cf_row_pad = 128;
const char cf_build_info[] = "fake kernels\n";
"""


class Bshd(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_int32 * 3), ("stride", ctypes.c_int64 * 3)]


class Rows(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_int32 * 3), ("stride", ctypes.c_int64 * 2)]


class Seen(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_int), ("kind", ctypes.c_int), ("bshd", Bshd), ("rows", Rows),
                ("scalar", ctypes.c_float), ("stream", ctypes.c_void_p)]


class FakeLibrary:
    """cuflash.c over recording kernels (the forward of bf16, d64, non-causal; the backward
    variants of FAKE's table) and a CUDA runtime that allocates host memory. Fresh per test: the
    shim keeps load state. Built once (`build`), loaded per test from a copy: the dynamic loader
    gives a file it has not seen before its own, zeroed state."""

    @staticmethod
    def build(folder) -> Path:
        (folder / "fake.c").write_text(FAKE)
        # -Bsymbolic: the shim calls these fakes even where the process has loaded the DSL's runtime,
        # which defines the same symbols.
        compile_c("-shared", "-fPIC", "-Wl,-Bsymbolic", "-I", export.C_ABI_DIR, export.C_ABI_DIR / "cuflash.c",
                  "fake.c", "-o", "libfake.so", "-lpthread", "-lm", cwd=folder)
        return folder / "libfake.so"

    def __init__(self, built: Path, folder: Path):
        shutil.copy2(built, folder / built.name)
        self.lib = declare(ctypes.CDLL(str(folder / built.name)))

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def int(self, name) -> ctypes.c_int:
        return ctypes.c_int.in_dll(self.lib, name)

    def pointer(self, name) -> int:
        return ctypes.c_void_p.in_dll(self.lib, name).value

    def seen(self, kernel=None) -> list:
        args = (Seen * 64).in_dll(self.lib, "seen")[: self.int("seen_count").value]
        return [a for a in args if kernel is None or a.kernel == kernel]


@pytest.fixture(scope="module")
def fake_build(tmp_path_factory) -> Path:
    return FakeLibrary.build(tmp_path_factory.mktemp("fake"))


@pytest.fixture
def fake(fake_build, tmp_path):
    return FakeLibrary(fake_build, tmp_path)


def bshd(arg):
    assert chr(arg.kind) == "B"
    return arg.bshd.data, tuple(arg.bshd.shape), tuple(arg.bshd.stride)


def rows(arg):
    assert chr(arg.kind) == "R"
    return arg.rows.data, tuple(arg.rows.shape), tuple(arg.rows.stride)


ADDRESS = 1 << 20  # 16-byte aligned; never dereferenced by the fake kernels


def test_row_major_tensors_reach_the_kernel_as_bshd_views(fake):
    b, h, n, d = 2, 3, 5, 64
    q, k, v, o, lse = (ADDRESS * i for i in range(1, 6))
    assert fake.cuflash_attention_forward_bf16(q, k, v, o, lse, b, h, n, d, 0.125, 0, 0x5EED) == 0
    args = fake.seen(0)
    strides = (h * n * d, d, n * d)  # batch, seq, head of [B, H, N, D] storage
    assert [bshd(a) for a in args[:4]] == [(p, (b, n, h), strides) for p in (q, k, v, o)]
    assert rows(args[4]) == (lse, (b, h, n), (h * n, n))
    assert args[5].scalar == 0.125 and args[6].stream == 0x5EED
    assert fake.int("argument_counts").value == 8  # 7 arguments and the status


def test_any_strides_grouped_heads_and_other_key_lengths(fake):
    b, h, hkv, sq, sk, d = 2, 4, 1, 3, 7, 64
    # q and out stored (B, N, H, D); k and v [B, Hkv, N, D] with room between batches.
    q = Tensor(ADDRESS, sq * h * d, d, h * d)
    kv = Tensor(2 * ADDRESS, hkv * sk * d + 64, sk * d, d)
    lse = Tensor(3 * ADDRESS, h * sq + 4, sq, 1)
    assert fake.cuflash_attention_forward_ex(BF16, q, kv, kv, q, lse, b, h, hkv, sq, sk, d, 0.5, 0, None) == 0
    args = fake.seen(0)
    assert bshd(args[0]) == (ADDRESS, (b, sq, h), (sq * h * d, h * d, d))
    # An extent of 1 is never stepped over: its stride becomes one the kernels' layout takes.
    assert bshd(args[1]) == (2 * ADDRESS, (b, sk, hkv), (hkv * sk * d + 64, d, 8))
    assert rows(args[4]) == (3 * ADDRESS, (b, h, sq), (h * sq + 4, sq))


def align(nbytes):
    return (nbytes + 255) // 256 * 256  # the shim's workspace regions start on 256 bytes


def launch_order(fake) -> list:
    return list((ctypes.c_int * 8).in_dll(fake.lib, "launch_order"))[:fake.int("launches").value]


def test_the_backward_workspace_and_its_three_launches(fake):
    b, h, n, d = 2, 3, 200, 64
    dout, q, k, v, o, lse, dq, dk, dv = (ADDRESS * i for i in range(1, 10))
    assert fake.cuflash_attention_backward_bf16(dout, q, k, v, o, lse, dq, dk, dv, b, h, n, d, 0.25, 0, 0x5EED) == 0
    assert launch_order(fake) == [1, 2, 3]
    assert list((ctypes.c_int * 8).in_dll(fake.lib, "argument_counts"))[:3] == [8, 13, 5]
    base = fake.pointer("malloc_pointer")
    stat_rows = 256  # 200 rows padded to 128
    stat_bytes = align(b * h * stat_rows * 4)
    accum = 2 * 128 * 64  # two query blocks of 128 rows, head dim padded to 64
    assert ctypes.c_size_t.in_dll(fake.lib, "malloc_bytes").value == 2 * stat_bytes + b * h * accum * 4
    lse_log2 = (base, (b, h, stat_rows), (h * stat_rows, stat_rows))
    dpsum = (base + stat_bytes, (b, h, stat_rows), (h * stat_rows, stat_rows))
    dq_accum = (base + 2 * stat_bytes, (b, h, accum), (h * accum, accum))
    # nothing to zero: the preprocess zeroes dQ's accumulator (no semaphore without deterministic)
    assert fake.pointer("memset_pointer") is None and fake.int("memset_value").value == -1
    assert fake.pointer("freed_pointer") == base

    view = (h * n * d, d, n * d)
    pre = fake.seen(1)
    assert [bshd(a) for a in pre[:2]] == [(o, (b, n, h), view), (dout, (b, n, h), view)]
    assert [rows(a) for a in pre[2:6]] == [(lse, (b, h, n), (h * n, n)), lse_log2, dpsum, dq_accum]
    assert pre[6].stream == 0x5EED
    main = fake.seen(2)
    assert [bshd(a)[0] for a in main[:4]] == [q, k, v, dout]
    assert [rows(a) for a in main[4:7]] == [lse_log2, dpsum, dq_accum]
    assert [bshd(a) for a in main[7:9]] == [(dk, (b, n, h), view), (dv, (b, n, h), view)]
    assert rows(main[9])[1] == (1, 1, 1)  # the unordered kernel never reads its semaphore
    assert main[10].scalar == 0.25 and main[11].stream == 0x5EED
    post = fake.seen(3)
    assert rows(post[0]) == dq_accum and bshd(post[1]) == (dq, (b, n, h), view) and post[2].scalar == 0.25


def bhnd(address, heads, seq, head_dim=64) -> Tensor:
    """A row-major [B, H, N, D] operand."""
    return Tensor(address, heads * seq * head_dim, seq * head_dim, head_dim)


def ex_backward(lib, dtype=BF16, batch=2, heads=8, kv_heads=8, seq_q=200, seq_k=300, head_dim=64, scale=0.25, causal=0,
                deterministic=0, stream=0x5EED, null=None, **replaced):
    """cuflash_attention_backward_ex over row-major operands at ADDRESS * (1..9); `null` names one
    operand passed as NULL, `replaced` operands replaced by other descriptors."""
    names = ("dO", "Q", "K", "V", "O", "L", "dQ", "dK", "dV")
    tensors = {}
    for i, name in enumerate(names, 1):
        kv = name in ("K", "V", "dK", "dV")
        tensors[name] = bhnd(ADDRESS * i, kv_heads if kv else heads, seq_k if kv else seq_q, head_dim)
    tensors["L"] = Tensor(ADDRESS * 6, heads * seq_q, seq_q, 1)
    tensors.update(replaced)
    args = [None if name == null else tensors[name] for name in names]
    return lib.cuflash_attention_backward_ex(dtype, *args, batch, heads, kv_heads, seq_q, seq_k, head_dim, scale, causal,
                                             deterministic, stream)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa-8:2", "mqa-8:1"])
def test_the_grouped_query_backward_sums_fp32_per_head_gradients_per_group(fake, kv_heads):
    b, h, sq, sk, d = 2, 8, 200, 300, 64
    assert ex_backward(fake, batch=b, heads=h, kv_heads=kv_heads, seq_q=sq, seq_k=sk, head_dim=d) == 0, message(fake)
    assert launch_order(fake) == [1, 5, 3, 4]  # pre, the grouped-query main, post, the group sum
    assert list((ctypes.c_int * 8).in_dll(fake.lib, "argument_counts"))[:4] == [8, 13, 5, 6]
    base = fake.pointer("malloc_pointer")
    stat_bytes = align(b * h * 256 * 4)
    accum_bytes = b * h * (2 * 128 * 64) * 4
    dkv_bytes = align(b * sk * h * d * 4)
    assert ctypes.c_size_t.in_dll(fake.lib, "malloc_bytes").value == 2 * stat_bytes + accum_bytes + 2 * dkv_bytes
    # Nothing is zeroed here: the preprocess zeroes dQ's accumulator and the main kernel writes
    # every element of dK / dV's workspace.
    assert fake.pointer("memset_pointer") is None
    assert fake.pointer("freed_pointer") == base

    # The main kernel: K and V of kv_heads heads; dK and dV per query head, fp32, (b, seqlen_k, h)-major.
    per_head = (sk * h * d, h * d, d)
    dk_accum = (base + 2 * stat_bytes + accum_bytes, (b, sk, h), per_head)
    dv_accum = (base + 2 * stat_bytes + accum_bytes + dkv_bytes, (b, sk, h), per_head)
    kv_view = (kv_heads * sk * d, d, sk * d if kv_heads > 1 else 8)  # an extent of 1 gets stride 8
    main = fake.seen(5)
    assert [bshd(a) for a in main[1:3]] == [(ADDRESS * 3, (b, sk, kv_heads), kv_view),
                                            (ADDRESS * 4, (b, sk, kv_heads), kv_view)]
    assert bshd(main[0]) == (ADDRESS * 2, (b, sq, h), (h * sq * d, d, sq * d))
    assert [bshd(a) for a in main[7:9]] == [dk_accum, dv_accum]
    # The group sum: the per-head workspaces into the caller's dK and dV.
    group_sum = fake.seen(4)
    assert [bshd(a) for a in group_sum[:4]] == [dk_accum, dv_accum, (ADDRESS * 8, (b, sk, kv_heads), kv_view),
                                                (ADDRESS * 9, (b, sk, kv_heads), kv_view)]
    assert group_sum[4].stream == 0x5EED
    post = fake.seen(3)
    assert bshd(post[1]) == (ADDRESS * 7, (b, sq, h), (h * sq * d, d, sq * d))


def test_the_deterministic_backward_takes_zeroed_counters_per_query_block(fake):
    b, h, sq, sk, d = 2, 3, 300, 300, 64
    assert ex_backward(fake, batch=b, heads=h, kv_heads=h, seq_q=sq, seq_k=sk, causal=1, deterministic=1) == 0
    assert launch_order(fake) == [1, 6, 3]
    base = fake.pointer("malloc_pointer")
    stat_bytes = align(b * h * 384 * 4)
    m_blocks = 3  # 300 rows in blocks of 128
    accum_bytes = b * h * (m_blocks * 128 * 64) * 4
    semaphore = (base + 2 * stat_bytes + accum_bytes, (b, h, m_blocks), (h * m_blocks, m_blocks))
    assert rows(fake.seen(6)[9]) == semaphore
    # Only the counters are zeroed by a memset (the preprocess zeroes dQ's accumulator before them).
    assert fake.pointer("memset_pointer") == base + 2 * stat_bytes + accum_bytes
    assert ctypes.c_size_t.in_dll(fake.lib, "memset_bytes").value == align(b * h * m_blocks * 4)
    assert ctypes.c_size_t.in_dll(fake.lib, "malloc_bytes").value == (2 * stat_bytes + accum_bytes
                                                                      + align(b * h * m_blocks * 4))


SERVED = [  # (causal, kv_heads of 8, head_dim, deterministic): the main kernel that runs, or None: not exported
    (0, 8, 64, 0, 2, ""),
    (0, 2, 64, 0, 5, ""),
    (0, 1, 64, 0, 5, ""),
    (0, 8, 64, 1, None, "no backward kernel for bf16, head_dim 64, causal 0, deterministic in this library"),
    (0, 2, 64, 1, None, "causal 0, kv_heads < heads, deterministic in this library"),
    (1, 8, 64, 1, 6, ""),
    (1, 8, 64, 0, 6, ""),  # the deterministic kernel serves a call that does not ask for it
    (1, 2, 64, 0, None, "no backward kernel for bf16, head_dim 64, causal 1, kv_heads < heads in this library"),
    (0, 8, 128, 0, 5, ""),  # the grouped-query kernel serves kv_heads == heads: groups of one
    (0, 8, 128, 1, None, "head_dim 128, causal 0, deterministic"),
    (1, 8, 128, 0, None, "head_dim 128, causal 1 in this library"),
]


@pytest.mark.parametrize("causal, kv_heads, head_dim, deterministic, main, words", SERVED,
                         ids=[f"causal{c}-kv{k}-d{d}-det{t}" for c, k, d, t, *_ in SERVED])
def test_which_backward_variant_serves_a_call(fake, causal, kv_heads, head_dim, deterministic, main, words):
    code = ex_backward(fake, heads=8, kv_heads=kv_heads, head_dim=head_dim, causal=causal, deterministic=deterministic)
    gqa = int(kv_heads < 8)
    assert fake.cuflash_backward_variant_exported(BF16, head_dim, causal, gqa, deterministic) == (main is not None)
    if main is None:
        assert code == NOT_EXPORTED and words in message(fake)
        assert fake.int("launches").value == 0 and fake.int("load_calls").value == 0
        return
    assert code == 0, message(fake)
    assert launch_order(fake) == ([1, main, 3, 4] if main == 5 else [1, main, 3])
    if main == 5:  # group sum over groups of 8 / kv_heads query heads
        dk_accum, dk = bshd(fake.seen(4)[0]), bshd(fake.seen(4)[2])
        assert (dk_accum[1][2], dk[1][2]) == (8, kv_heads)


def test_variant_queries_take_flags_only(fake):
    assert fake.cuflash_variant_exported(1, BF16, 64, 0) == 1
    assert fake.cuflash_variant_exported(1, BF16, 64, 1) == 1  # served by the deterministic kernel
    assert fake.cuflash_variant_exported(1, BF16, 128, 0) == 1  # served by the grouped-query kernel
    assert fake.cuflash_variant_exported(1, F16, 64, 0) == 0
    assert fake.cuflash_backward_variant_exported(BF16, 64, 0, 2, 0) == 0
    assert fake.cuflash_backward_variant_exported(BF16, 64, 1, 0, -1) == 0


BACKWARD_CHECKS = [  # (arguments of ex_backward, code, words of the message)
    (dict(null="dK"), ErrorCode.NULL_POINTER, "dK is NULL"),
    (dict(null="L"), ErrorCode.NULL_POINTER, "L is NULL"),
    (dict(dV=Tensor(None, 0, 0, 0)), ErrorCode.NULL_POINTER, "dV's data is NULL"),
    (dict(seq_k=0), ErrorCode.INVALID_DIMENSION, "seq_len_k must be positive"),
    (dict(kv_heads=3), ErrorCode.DIMENSION_MISMATCH, "heads (8) must be a multiple of kv_heads (3)"),
    (dict(head_dim=60), ErrorCode.UNSUPPORTED_HEAD_DIM, "head_dim 60"),
    (dict(head_dim=0), ErrorCode.INVALID_DIMENSION, "head_dim must be positive"),
    (dict(deterministic=2), ErrorCode.INVALID_DIMENSION, "deterministic must be 0 or 1, got 2"),
    (dict(deterministic=-1, kv_heads=2), ErrorCode.INVALID_DIMENSION, "deterministic must be 0 or 1"),
    (dict(dtype=F32), NOT_EXPORTED, "no backward kernel for f32, head_dim 64, causal 0"),
    (dict(kv_heads=2, dK=Tensor(ADDRESS * 8, 2 * 300 * 64, 300 * 64, 68)), ErrorCode.INVALID_DIMENSION,
     "dK's seq_stride (68)"),
    (dict(kv_heads=2, dV=Tensor(ADDRESS * 9 + 8, 2 * 300 * 64, 300 * 64, 64)), ErrorCode.INVALID_DIMENSION,
     "dV's data is not 16-byte aligned"),
    (dict(dtype=F16, kv_heads=2), NOT_EXPORTED, "no backward kernel for f16, head_dim 64, causal 0, kv_heads < heads"),
    (dict(kv_heads=4, deterministic=1), NOT_EXPORTED, "kv_heads < heads, deterministic"),
]


@pytest.mark.parametrize("arguments, code, words", BACKWARD_CHECKS, ids=[c[2] for c in BACKWARD_CHECKS])
def test_every_backward_check_comes_before_cuda(fake, arguments, code, words):
    assert ex_backward(fake, **arguments) == code
    assert words in message(fake)
    assert fake.int("launches").value == 0 and fake.int("load_calls").value == 0
    assert ctypes.c_size_t.in_dll(fake.lib, "malloc_bytes").value == 0


def test_kernels_load_once_and_once_per_device(fake):
    call = lambda: fake.cuflash_attention_forward_bf16(*[ADDRESS] * 5, 1, 1, 8, 64, 1.0, 0, None)
    assert call() == 0 and call() == 0
    assert (fake.int("init_calls").value, fake.int("load_calls").value) == (1, 1)
    fake.int("current_device").value = 1
    assert call() == 0
    assert (fake.int("init_calls").value, fake.int("load_calls").value) == (1, 2)


def test_a_gpu_of_another_target_is_a_cuda_error_before_any_launch(fake):
    fake.int("device_major").value, fake.int("device_minor").value = 8, 0
    assert fake.cuflash_attention_forward_bf16(*[ADDRESS] * 5, 1, 1, 8, 64, 1.0, 0, None) == ErrorCode.CUDA_ERROR
    assert "device 0 is sm_80; this library holds code for sm_90a only" in message(fake)
    assert fake.int("launches").value == 0 and fake.int("load_calls").value == 0


def test_cuda_failures_free_the_workspace_and_map_to_codes(fake):
    grads = [ADDRESS] * 9
    fake.int("malloc_error").value = 2  # cudaErrorMemoryAllocation
    assert fake.cuflash_attention_backward_bf16(*grads, 1, 1, 8, 64, 1.0, 0, None) == ErrorCode.OUT_OF_MEMORY
    assert fake.int("launches").value == 0 and "workspace" in message(fake)
    fake.int("malloc_error").value = 0
    fake.int("launch_error").value = 719
    assert fake.cuflash_attention_backward_bf16(*grads, 1, 1, 8, 64, 1.0, 0, None) == ErrorCode.CUDA_ERROR
    assert fake.int("launches").value == 1 and message(fake) == "pre failed with cudaError_t 719"
    assert fake.pointer("freed_pointer") == fake.pointer("malloc_pointer")


def ex_forward(lib, q=Tensor(ADDRESS, 1024, 256, 64), l=Tensor(ADDRESS, 16, 4, 1), dtype=BF16, heads=4, kv_heads=4,
               head_dim=64, scale=1.0, causal=0, batch=1):
    return lib.cuflash_attention_forward_ex(dtype, q, q, q, q, l, batch, heads, kv_heads, 4, 4, head_dim, scale,
                                            causal, None)


CHECKS = [  # (arguments of ex_forward, code, words of the message)
    (dict(q=None), ErrorCode.NULL_POINTER, "Q is NULL"),
    (dict(q=Tensor(None, 1024, 256, 64)), ErrorCode.NULL_POINTER, "Q's data is NULL"),
    (dict(batch=0), ErrorCode.INVALID_DIMENSION, "batch must be positive"),
    (dict(heads=4, kv_heads=3), ErrorCode.DIMENSION_MISMATCH, "multiple of kv_heads"),
    (dict(head_dim=60), ErrorCode.UNSUPPORTED_HEAD_DIM, "head_dim 60"),
    (dict(head_dim=264), ErrorCode.UNSUPPORTED_HEAD_DIM, "head_dim 264"),
    (dict(scale=-1.0), ErrorCode.INVALID_DIMENSION, "scale"),
    (dict(scale=float("nan")), ErrorCode.INVALID_DIMENSION, "scale"),
    (dict(causal=2), ErrorCode.INVALID_DIMENSION, "causal must be 0 or 1"),
    (dict(dtype=F32), NOT_EXPORTED, "no forward kernel for f32, head_dim 64, causal 0"),
    (dict(dtype=9), ErrorCode.UNSUPPORTED_DTYPE, "unknown dtype 9"),
    (dict(q=Tensor(ADDRESS + 2, 1024, 256, 64)), ErrorCode.INVALID_DIMENSION, "16-byte aligned"),
    (dict(q=Tensor(ADDRESS, 1024, 256, 68)), ErrorCode.INVALID_DIMENSION, "seq_stride (68)"),
    (dict(q=Tensor(ADDRESS, 1024, -256, 64)), ErrorCode.INVALID_DIMENSION, "head_stride (-256)"),
    (dict(l=Tensor(ADDRESS + 2, 16, 4, 1)), ErrorCode.INVALID_DIMENSION, "4-byte aligned"),
    (dict(l=Tensor(ADDRESS, 16, 4, 2)), ErrorCode.INVALID_DIMENSION, "L's seq_stride must be 1"),
    (dict(dtype=F16), NOT_EXPORTED, "no forward kernel for f16, head_dim 64, causal 0"),
    (dict(causal=1), NOT_EXPORTED, "no forward kernel for bf16, head_dim 64, causal 1"),
]


@pytest.mark.parametrize("arguments, code, words", CHECKS, ids=[c[2] for c in CHECKS])
def test_every_check_comes_before_cuda(fake, arguments, code, words):
    assert ex_forward(fake, **arguments) == code
    assert words in message(fake)
    assert fake.int("launches").value == 0 and fake.int("load_calls").value == 0


# ----------------------------------------------------------------------------- a real export


EXPORT_ONE = ["export", "--arch", "sm_80", "--dtypes", "bf16", "--head-dims", "64", "--causal", "no", "--passes",
              "fwd,bwd", "--gqa", "yes", "--deterministic", "yes", "--jobs", "1"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`cute-flash export` of one forward variant (bf16, d64, non-causal) and one backward variant
    (the same, grouped-query and deterministic: five kernels with the group sum) for sm_80."""
    out = tmp_path_factory.mktemp("export")
    assert cli.main(EXPORT_ONE + ["-o", str(out)]) == 0
    return out


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="no binutils (nm, readelf)")
def test_the_library_exports_the_c_abi_only_and_needs_no_cuda_toolkit_or_python(exported):
    symbols = subprocess.run(["nm", "-D", "--defined-only", exported / export.LIBRARY], capture_output=True,
                             text=True, check=True).stdout.split()
    names = {s for s in symbols if s.startswith(("cuflash", "_mlir", "cfk", "cf_"))}
    assert names == {f"cuflash_{n}" for n in (
        "abi_version", "error_string", "last_error_message", "build_info", "variant_exported",
        "backward_variant_exported",
        "attention_forward_f16", "attention_forward_bf16", "attention_forward_f32", "attention_forward_ex",
        "attention_backward_f16", "attention_backward_bf16", "attention_backward_f32", "attention_backward_ex")}
    dynamic = subprocess.run(["readelf", "-d", exported / export.LIBRARY], capture_output=True, text=True,
                             check=True).stdout
    needed = set(re.findall(r"NEEDED.*\[(.*)\]", dynamic))
    assert export.SHARED_RUNTIME in needed
    assert not {n for n in needed if re.match(r"lib(cuda|cudart|python|torch)", n)}, needed
    assert "$ORIGIN" in dynamic and (exported / export.SHARED_RUNTIME).is_file()
    assert (exported / "cute_flash.h").read_text() == (export.C_ABI_DIR / export.HEADER).read_text()


@pytest.fixture(scope="module")
def library(exported):
    return declare(ctypes.CDLL(str(exported / export.LIBRARY)))


def test_ctypes_sees_every_check_of_the_real_library(library):
    p = ADDRESS
    assert library.cuflash_abi_version() == 2
    info = library.cuflash_build_info().decode()
    assert "target sm_80" in info and "C ABI version 2" in info
    assert "forward bf16 head_dim=64 causal=0\n" in info
    assert "backward bf16 head_dim=64 causal=0 gqa=1 deterministic=1\n" in info
    assert library.cuflash_variant_exported(0, BF16, 64, 0) == 1
    # The one backward variant serves every call of its dtype, head dim and causal flag.
    assert library.cuflash_variant_exported(1, BF16, 64, 0) == 1
    assert [library.cuflash_backward_variant_exported(BF16, 64, 0, g, d) for g in (0, 1) for d in (0, 1)] == [1] * 4
    assert library.cuflash_backward_variant_exported(BF16, 64, 1, 1, 1) == 0
    assert library.cuflash_backward_variant_exported(F16, 64, 0, 1, 1) == 0
    fwd = library.cuflash_attention_forward_bf16
    assert fwd(None, p, p, p, p, 1, 2, 16, 64, 0.125, 0, None) == ErrorCode.NULL_POINTER
    assert fwd(p, p, p, p, p, 1, 2, 16, 60, 0.125, 0, None) == ErrorCode.UNSUPPORTED_HEAD_DIM
    assert fwd(p, p, p, p, p, 1, -2, 16, 64, 0.125, 0, None) == ErrorCode.INVALID_DIMENSION
    assert library.cuflash_attention_forward_f32(p, p, p, p, p, 1, 2, 16, 64, 0.125, 0, None) == NOT_EXPORTED
    assert library.cuflash_attention_forward_f16(p, p, p, p, p, 1, 2, 16, 64, 0.125, 0, None) == NOT_EXPORTED
    assert fwd(p, p, p, p, p, 1, 2, 16, 64, 0.125, 1, None) == NOT_EXPORTED
    bwd = library.cuflash_attention_backward_bf16
    assert bwd(*[p] * 7, None, p, 1, 2, 16, 64, 0.125, 0, None) == ErrorCode.NULL_POINTER
    assert bwd(*[p] * 9, 1, 2, 16, 60, 0.125, 0, None) == ErrorCode.UNSUPPORTED_HEAD_DIM
    assert bwd(*[p] * 9, 1, 2, 16, 64, 0.125, 1, None) == NOT_EXPORTED
    assert library.cuflash_attention_backward_f16(*[p] * 9, 1, 2, 16, 64, 0.125, 0, None) == NOT_EXPORTED
    assert ex_backward(library, kv_heads=2, null="dV") == ErrorCode.NULL_POINTER
    assert ex_backward(library, kv_heads=2, head_dim=72 + 4) == ErrorCode.UNSUPPORTED_HEAD_DIM
    assert ex_backward(library, kv_heads=2, deterministic=2) == ErrorCode.INVALID_DIMENSION
    assert ex_backward(library, kv_heads=2, deterministic=1, causal=1) == NOT_EXPORTED
    assert "causal 1, kv_heads < heads, deterministic" in message(library)
    assert ex_forward(library, heads=4, kv_heads=3) == ErrorCode.DIMENSION_MISMATCH
    assert [library.cuflash_error_string(c).decode() for c in (0, 3, 8, 99)] == [
        "success", "null pointer", "variant not exported into this library", "unknown error code"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the call would run")
def test_a_valid_call_without_a_gpu_is_a_cuda_error(library):
    assert library.cuflash_attention_forward_bf16(*[ADDRESS] * 5, 1, 2, 16, 64, 0.125, 0, None) == ErrorCode.CUDA_ERROR
    assert "cudaGetDevice failed" in message(library)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the call would run")
@pytest.mark.parametrize("kv_heads, deterministic", [(8, 0), (2, 0), (1, 1), (8, 1)])
def test_backward_calls_the_library_serves_pass_every_check(library, kv_heads, deterministic):
    """Grouped-query and deterministic calls are accepted: they get as far as CUDA, which is absent here."""
    assert ex_backward(library, kv_heads=kv_heads, deterministic=deterministic) == ErrorCode.CUDA_ERROR
    assert "cudaGetDevice failed" in message(library)


C_PROGRAM = r"""
#include <stdio.h>
#include "cute_flash.h"

#define EXPECT(call, code)                                                                       \
    do {                                                                                         \
        int got = (call);                                                                        \
        if (got != (code)) {                                                                     \
            printf("%s: %d (%s: %s), expected %d\n", #call, got, cuflash_error_string(got),      \
                   cuflash_last_error_message(), (code));                                        \
            return 1;                                                                            \
        }                                                                                        \
    } while (0)

int main(void) {
    /* Each call below fails its checks before CUDA, so an address stands in for device memory. */
    void *p = (void *)(1 << 20);
    float *l = p;
    cuflash_tensor t = {p, 2 * 16 * 64, 16 * 64, 64}, stat = {p, 32, 16, 1};
    if (cuflash_abi_version() != CUFLASH_ABI_VERSION || CUFLASH_ABI_VERSION != 2) return 2;
    if (cuflash_backward_variant_exported(CUFLASH_DTYPE_BF16, 64, 0, 1, 1) != 1) return 3;
    EXPECT(cuflash_attention_forward_bf16(NULL, p, p, p, l, 1, 2, 16, 64, 0.125f, 0, NULL), CUFLASH_ERROR_NULL_POINTER);
    EXPECT(cuflash_attention_forward_bf16(p, p, p, p, l, 0, 2, 16, 64, 0.125f, 0, NULL), CUFLASH_ERROR_INVALID_DIMENSION);
    EXPECT(cuflash_attention_forward_bf16(p, p, p, p, l, 1, 2, 16, 72 + 1, 0.125f, 0, NULL), CUFLASH_ERROR_UNSUPPORTED_HEAD_DIM);
    EXPECT(cuflash_attention_forward_f32(l, l, l, l, l, 1, 2, 16, 64, 0.125f, 0, NULL), CUFLASH_ERROR_VARIANT_NOT_EXPORTED);
    EXPECT(cuflash_attention_forward_f16(p, p, p, p, l, 1, 2, 16, 64, 0.125f, 0, NULL), CUFLASH_ERROR_VARIANT_NOT_EXPORTED);
    EXPECT(cuflash_attention_backward_bf16(p, p, p, p, p, l, p, p, p, 1, 2, 16, 64, 0.125f, 1, NULL),
           CUFLASH_ERROR_VARIANT_NOT_EXPORTED);
    EXPECT(cuflash_attention_forward_ex(CUFLASH_DTYPE_BF16, &t, &t, &t, &t, &stat, 1, 3, 2, 16, 16, 64, 0.125f, 0, NULL),
           CUFLASH_ERROR_DIMENSION_MISMATCH);
    EXPECT(cuflash_attention_forward_ex(CUFLASH_DTYPE_BF16, &t, NULL, &t, &t, &stat, 1, 2, 2, 16, 16, 64, 0.125f, 0, NULL),
           CUFLASH_ERROR_NULL_POINTER);
    /* The backward of 2 query heads on 1 kv head. */
    EXPECT(cuflash_attention_backward_ex(CUFLASH_DTYPE_BF16, &t, &t, &t, &t, &t, &stat, &t, NULL, &t, 1, 2, 1, 16, 16,
                                         64, 0.125f, 0, 1, NULL), CUFLASH_ERROR_NULL_POINTER);
    EXPECT(cuflash_attention_backward_ex(CUFLASH_DTYPE_BF16, &t, &t, &t, &t, &t, &stat, &t, &t, &t, 1, 2, 1, 16, 16,
                                         56 + 4, 0.125f, 0, 1, NULL), CUFLASH_ERROR_UNSUPPORTED_HEAD_DIM);
    EXPECT(cuflash_attention_backward_ex(CUFLASH_DTYPE_BF16, &t, &t, &t, &t, &t, &stat, &t, &t, &t, 1, 2, 1, 16, 16,
                                         64, 0.125f, 0, 2, NULL), CUFLASH_ERROR_INVALID_DIMENSION);
    EXPECT(cuflash_attention_backward_ex(CUFLASH_DTYPE_F16, &t, &t, &t, &t, &t, &stat, &t, &t, &t, 1, 2, 1, 16, 16,
                                         64, 0.125f, 0, 1, NULL), CUFLASH_ERROR_VARIANT_NOT_EXPORTED);
    printf("%s", cuflash_build_info());
    return 0;
}
"""


def test_a_c_program_links_the_library_and_gets_every_check(exported, tmp_path):
    (tmp_path / "checks.c").write_text(C_PROGRAM)
    compile_c("checks.c", "-I", exported, "-L", exported, "-lcute_flash", f"-Wl,-rpath,{exported}", "-o", "checks",
              cwd=tmp_path)
    result = subprocess.run([tmp_path / "checks"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "forward bf16 head_dim=64 causal=0" in result.stdout
    assert "backward bf16 head_dim=64 causal=0 gqa=1 deterministic=1" in result.stdout


def test_a_kernel_whose_signature_changed_fails_the_export(exported):
    (header,) = (exported / "build").glob("cfk_fwd_*.h")
    text, prefix = header.read_text(), header.stem
    assert export.check_dsl_header(text, prefix, export.LAUNCH_ARGUMENTS["fwd"]).startswith(f"_mlir_{prefix}__mlir_ciface_")
    swapped = text.replace("mQ, mK, mV", "mK, mQ, mV")
    with pytest.raises(export.ExportError, match="the kernel takes"):
        export.check_dsl_header(swapped, prefix, export.LAUNCH_ARGUMENTS["fwd"])
    narrower = re.sub(r"(int64_t dynamic_strides\[)3(\];\s*\} " + prefix + "_Tensor_mQ_t)", r"\g<1>2\2", text)
    assert narrower != text
    with pytest.raises(export.ExportError, match="mQ's descriptor"):
        export.check_dsl_header(narrower, prefix, export.LAUNCH_ARGUMENTS["fwd"])


def test_every_backward_kernel_takes_what_the_shim_passes(exported):
    for role in ("pre", "main", "post", "sum"):
        (header,) = (exported / "build").glob(f"cfk_{role}_*.h")
        assert export.check_dsl_header(header.read_text(), header.stem, export.LAUNCH_ARGUMENTS[role])


def test_the_default_export_holds_both_backward_forms_and_shares_kernels():
    jobs, forward, backward = export.kernel_jobs("sm_80", ["bfloat16"], [64], (False, True), ("fwd", "bwd"))
    # One preprocess, postprocess and group sum serve all four backward variants.
    assert sorted(job.role for job in jobs) == ["fwd"] * 2 + ["main"] * 4 + ["post", "pre", "sum"]
    assert set(backward) == {("bfloat16", 64, causal, gqa, False) for causal in (False, True) for gqa in (False, True)}
    assert set(backward["bfloat16", 64, True, True, False]) == {"pre", "main", "post", "sum"}
    assert set(backward["bfloat16", 64, True, False, False]) == {"pre", "main", "post"}
    labels = {job.label for job in jobs if job.role == "main"}
    assert labels == {"main/bf16/d64/full", "main/bf16/d64/causal", "main/bf16/d64/full/gqa", "main/bf16/d64/causal/gqa"}
    _, _, deterministic = export.kernel_jobs("sm_80", ["bfloat16"], [64], (False,), ("bwd",), (False,), (True,))
    assert set(deterministic) == {("bfloat16", 64, False, False, True)}


def test_fp32_kernels_take_what_the_shim_passes(tmp_path):
    """fp32 (split TF32) variants: the sm80 kernels compiled for fp32 take the descriptors cuflash.c
    builds (the same as the 16-bit kernels'), and the table lists them under CUFLASH_DTYPE_F32."""
    jobs, forward, backward = export.kernel_jobs("sm_80", ["float32"], [64], (False,), ("fwd", "bwd"), (True,), (False,))
    assert set(forward) == {("float32", 64, False)} and set(backward) == {("float32", 64, False, True, False)}
    assert {job.label for job in jobs} == {"fwd/f32/d64/full", "pre/f32/d64", "main/f32/d64/full/gqa", "post/f32/d64",
                                           "sum/f32/d64"}
    kernels = {job.prefix: export.export_kernel("sm_80", job, str(tmp_path)) for job in jobs}
    table = export.kernel_table("sm_80", kernels, forward, backward)
    m_block = export.plan_of("sm_80", "main", "float32", 64, False, True).settings()["m_block_size"]
    assert "{CUFLASH_DTYPE_F32, 64, 0, &" in table and f"{{CUFLASH_DTYPE_F32, 64, 0, 1, 0, {m_block}, 64, &" in table


@pytest.mark.parametrize("flags, gqas, deterministics", [
    ([], (False, True), (False,)),
    (["--gqa", "yes", "--deterministic", "both"], (True,), (False, True)),
    (["--gqa", "no", "--deterministic", "yes"], (False,), (True,)),
])
def test_export_flags_choose_the_backward_variants(tmp_path, monkeypatch, flags, gqas, deterministics):
    chosen = {}

    def record(out, arch, *args, gqas, deterministics, **kwargs):
        chosen.update(gqas=gqas, deterministics=deterministics)
        return export.Export(tmp_path / export.LIBRARY, tmp_path / export.HEADER, tmp_path, 0, 0.0)

    monkeypatch.setattr(export, "export_library", record)
    assert cli.main(["export", "--arch", "sm_80", "--dtypes", "bf16", "--head-dims", "64", *flags,
                     "-o", str(tmp_path)]) == 0
    assert chosen == dict(gqas=gqas, deterministics=deterministics)


@pytest.mark.parametrize("argv, words", [
    (["export", "--arch", "sm_80"], "the following arguments are required: -o/--out"),
    (["export", "--arch", "sm_75", "-o", "x"], "the CuTe DSL cannot target sm_75"),
    (["export", "--dtypes", "int8", "-o", "x"], "'int8' is not an element type"),
    (["export", "--causal", "maybe", "-o", "x"], "invalid choice: 'maybe'"),
    (["export", "--passes", "decode", "-o", "x"], "the C library holds the forward and the backward"),
    (["export", "--gqa", "1", "-o", "x"], "invalid choice: '1'"),
    (["export", "--deterministic", "true", "-o", "x"], "invalid choice: 'true'"),
])
def test_export_usage_errors_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, words", [
    (["--cc", "no-such-cc"], "no C compiler 'no-such-cc' on PATH"),
    (["--runtime", "static"], "--runtime static needs libcudart_static.a"),
])
def test_what_the_link_needs_is_checked_before_compiling(tmp_path, monkeypatch, capsys, extra, words):
    monkeypatch.setattr(export, "find_static_cudart", lambda: None)
    monkeypatch.setattr(export, "export_kernel", lambda *args: pytest.fail("compiled before the check"))
    assert cli.main(EXPORT_ONE + extra + ["-o", str(tmp_path)]) == 1
    assert f"cute-flash export: error: {words}" in capsys.readouterr().err


@pytest.mark.parametrize("version, fits", [(12080, True), (13000, False)])
def test_the_static_cuda_runtime_must_match_the_dsl_runtimes_cuda(tmp_path, monkeypatch, version, fits):
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "lib64").mkdir()
    (toolkit / "include" / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {version}\n")
    (toolkit / "lib64" / "libcudart_static.a").write_bytes(b"")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setattr(export, "dsl_library_dir", lambda: tmp_path / "cu12" / "lib")
    if fits:
        assert toolkit / "lib64" / "libcudart_static.a" in export._runtime_arguments("static", tmp_path, None)
    else:
        with pytest.raises(export.ExportError, match="is CUDA 13's, the DSL's runtime .* was built for CUDA 12"):
            export._runtime_arguments("static", tmp_path, None)


def test_a_failed_compile_names_its_kernel(tmp_path, monkeypatch, capsys):
    def broken(arch, job, build_dir):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(export, "export_kernel", broken)
    assert cli.main(EXPORT_ONE + ["-o", str(tmp_path)]) == 1
    assert "cute-flash export: error: fwd/bf16/d64/full: compile failed: RuntimeError: ptxas died" in capsys.readouterr().err

