"""cute_flash.sdpa without a GPU: registration in torch's flash-attention registry, activation and
restoration of the aten CUDA kernels, and the two kernel replacements called directly (float64
stand-ins for the kernels): torch's layouts, scale, GQA, the outputs torch's meta functions declare,
and every hand-back to torch's own kernel."""

import pytest
import torch

import cute_flash
from cute_flash import sdpa

from .reference_kernels import install

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                                reason=f"torch {torch.__version__} has no flash-attention registry")


class TorchKernel:
    """Stands in for torch's own CUDA kernel (what `torch.library.get_kernel` returns)."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        return "torch's result"


def cuda_kernel_line(op=sdpa.FORWARD_OP):
    return [line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CUDA:")]


def test_registered_on_import():
    assert sdpa.IMPL_NAME in torch.nn.attention.list_flash_attention_impls()


def test_activation_replaces_and_deactivation_restores_the_cuda_kernels(monkeypatch):
    monkeypatch.setattr(torch.library, "get_kernel", lambda op, key: TorchKernel())
    before = {op: cuda_kernel_line(op) for op in (sdpa.FORWARD_OP, sdpa.BACKWARD_OP)}
    assert not sdpa.is_active()
    sdpa.activate()
    try:
        assert sdpa.is_active() and torch.nn.attention.current_flash_attention_impl() == "cute-flash"
        for op in before:
            (line,) = cuda_kernel_line(op)
            assert "cute_flash/sdpa.py" in line
    finally:
        sdpa.deactivate()
    assert not sdpa.is_active() and torch.nn.attention.current_flash_attention_impl() is None
    assert {op: cuda_kernel_line(op) for op in before} == before


def test_torch_activation_by_name_works_too(monkeypatch):
    monkeypatch.setattr(torch.library, "get_kernel", lambda op, key: TorchKernel())
    torch.nn.attention.activate_flash_attention_impl("cute-flash")
    try:
        assert sdpa.is_active()
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert not sdpa.is_active()


def test_torch_without_cuda_kernels_is_a_typed_error(monkeypatch):
    def no_kernel(op, key):
        raise RuntimeError(f"no kernel for {key} for {op}")

    monkeypatch.setattr(torch.library, "get_kernel", no_kernel)
    with pytest.raises(cute_flash.CudaError, match="CUDA build of torch"):
        sdpa.activate()
    assert not sdpa.is_active()


def test_torch_without_the_registry_is_a_typed_error(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    with pytest.raises(cute_flash.MissingDependencyError, match="register_flash_attention_impl") as info:
        sdpa.activate()
    assert isinstance(info.value, ImportError)


def test_enabled_restores_the_previous_impl_and_priority(monkeypatch):
    monkeypatch.setattr(torch.library, "get_kernel", lambda op, key: TorchKernel())
    removed = []

    class Handle:
        def remove(self):
            removed.append(True)

    torch.nn.attention.register_flash_attention_impl("test-previous", register_fn=Handle)
    torch.nn.attention.activate_flash_attention_impl("test-previous")
    priority = torch._C._get_sdp_priority_order()
    try:
        with sdpa.enabled():
            assert sdpa.is_active() and removed == [True]
            assert torch._C._get_sdp_priority_order()[0] == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.nn.attention.current_flash_attention_impl() == "test-previous"
        assert torch._C._get_sdp_priority_order() == priority
        with sdpa.enabled(prefer_flash=False):
            assert sdpa.is_active() and torch._C._get_sdp_priority_order() == priority
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None


KEYSET = torch._C.DispatchKeySet("CUDA")


@pytest.fixture
def kernels(monkeypatch):
    """Stand-in kernels, and every input treated as one the kernels take (CPU, fp32 here)."""
    monkeypatch.setattr(sdpa, "kernel_support_issue", lambda q, k, v, scale: None)
    return install(monkeypatch)


def bhsd(b=2, h=4, hkv=2, sq=6, sk=6, d=8, dtype=torch.float32, seed=0):
    """SDPA's (batch, nheads, seqlen, headdim) inputs, as transposed views of (b, s, h, d) tensors."""
    torch.manual_seed(seed)
    q = torch.randn(b, sq, h, d, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(b, sk, hkv, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


def meta_outputs(op, *args, **kwargs):
    metas = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    return getattr(torch.ops.aten, op)(*metas, **kwargs)


def like_meta(got, meta):
    assert got.shape == meta.shape and got.dtype == meta.dtype and got.stride() == meta.stride()


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_compute_attention_in_torch_layout(kernels, causal):
    q, k, v = bhsd()
    torch_kernels = TorchKernel()
    result = sdpa._forward(torch_kernels, KEYSET, q, k, v, 0.0, causal, False, scale=0.3)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug_mask = result
    meta = meta_outputs(sdpa.FORWARD_OP, q, k, v, 0.0, causal, False, scale=0.3)
    for got, expected in zip((out, lse, rng_state, unused, debug_mask), (meta[0], meta[1], meta[6], meta[7], meta[8])):
        like_meta(got, expected)
    assert (cum_q, cum_k, max_q, max_k) == (None, None, 6, 6)
    (call,) = kernels.forward_calls
    assert call["q"].data_ptr() == q.data_ptr() and call["q"].shape == (2, 6, 4, 8)  # a view, no copy
    assert call["softmax_scale"] == 0.3 and call["causal"] is causal
    ref_out, ref_lse = cute_flash.reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      softmax_scale=0.3, causal=causal)
    torch.testing.assert_close(out, ref_out.transpose(1, 2).float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)

    dout = torch.randn_like(out)
    grads = sdpa._backward(torch_kernels, KEYSET, dout, q, k, v, out, lse, None, None, 6, 6, 0.0, causal,
                           rng_state, unused, scale=0.3)
    meta_grads = meta_outputs(sdpa.BACKWARD_OP, dout, q, k, v, out, lse, None, None, 6, 6, 0.0, causal,
                              rng_state, unused, scale=0.3)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref_out, _ = cute_flash.reference_attention(q64, k64, v64, softmax_scale=0.3, causal=causal)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double().transpose(1, 2))
    for got, meta_grad, ref in zip(grads, meta_grads, ref_grads):
        like_meta(got, meta_grad)
        torch.testing.assert_close(got, ref.transpose(1, 2).float(), rtol=1e-5, atol=1e-5)
    assert kernels.backward_calls[-1] == {"softmax_scale": 0.3, "causal": causal, "deterministic": False}
    assert torch_kernels.calls == []


def test_backward_is_deterministic_under_torch_deterministic_mode(kernels):
    q, k, v = bhsd()
    out, lse, *_ = sdpa._forward(TorchKernel(), KEYSET, q, k, v, 0.0, False, False, scale=None)
    torch.use_deterministic_algorithms(True)
    try:
        sdpa._backward(TorchKernel(), KEYSET, out, q, k, v, out, lse, None, None, 6, 6, 0.0, False, None, None)
    finally:
        torch.use_deterministic_algorithms(False)
    assert kernels.backward_calls[-1]["deterministic"] is True
    assert kernels.forward_calls[-1]["softmax_scale"] is None  # the kernels' default: 1/sqrt(headdim)


HANDED_BACK = [
    ("dropout", dict(dropout_p=0.1)),
    ("causal, seqlen_q != seqlen_k", dict(is_causal=True, sk=9)),
    ("return_debug_mask", dict(return_debug_mask=True)),
]


@pytest.mark.parametrize("name, case", HANDED_BACK, ids=[c[0] for c in HANDED_BACK])
def test_calls_the_kernels_cannot_serve_go_to_torch(kernels, name, case):
    q, k, v = bhsd(sk=case.get("sk", 6))
    dropout_p, is_causal = case.get("dropout_p", 0.0), case.get("is_causal", False)
    debug = case.get("return_debug_mask", False)
    torch_kernel = TorchKernel()
    assert sdpa._forward(torch_kernel, KEYSET, q, k, v, dropout_p, is_causal, debug, scale=0.3) == "torch's result"
    assert torch_kernel.calls == [(KEYSET, (q, k, v, dropout_p, is_causal, debug), {"scale": 0.3})]
    assert kernels.forward_calls == []
    if debug:
        return  # its backward needs only out and lse: ours (see the module's notes)
    args = (q, q, k, v, q, torch.zeros(2, 4, 6), None, None, 6, k.shape[2], dropout_p, is_causal, None, None)
    assert sdpa._backward(torch_kernel, KEYSET, *args, scale=0.3) == "torch's result"
    assert torch_kernel.calls[-1] == (KEYSET, args, {"scale": 0.3})
    assert kernels.backward_calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_without_a_kernel_go_to_torch(monkeypatch, dtype):
    """Unpatched support check on the CPU: no CUDA device, so torch's kernel runs."""
    calls = install(monkeypatch)
    q, k, v = bhsd(dtype=dtype)
    torch_kernel = TorchKernel()
    assert sdpa._forward(torch_kernel, KEYSET, q, k, v, 0.0, False, False, scale=0.3) == "torch's result"
    assert calls.forward_calls == [] and len(torch_kernel.calls) == 1


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan")])
def test_scales_the_kernels_do_not_take_go_to_torch(monkeypatch, scale):
    from cute_flash import validate

    monkeypatch.setattr(validate, "check_device", lambda tensors: torch.device("cuda", 0))
    monkeypatch.setattr(validate, "check_kernel_dtype", lambda dtype: None)
    calls = install(monkeypatch)
    q, k, v = bhsd()
    assert validate.kernel_support_issue(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3) is None
    torch_kernel = TorchKernel()
    assert sdpa._forward(torch_kernel, KEYSET, q, k, v, 0.0, False, False, scale=scale) == "torch's result"
    assert calls.forward_calls == []
