"""The path every kernel call takes, checked with a one-line copy kernel: compile cache →
TVM-FFI entry point → torch tensors with any strides, on the current stream."""

import pytest
import torch

from cute_flash import cache

from ..cpu import tiny_kernel

pytestmark = pytest.mark.gpu


def compiled_copy(head_dim=64):
    from cute_flash.device import target_arch

    return cache.get_or_compile(("tests", "copy", head_dim), tiny_kernel.build(head_dim), target_arch())


@pytest.mark.parametrize("transposed", [False, True])
def test_copy_kernel_through_cache(cache_dir, transposed):
    src = torch.randn(3, 4, 37, 64, device="cuda", dtype=torch.float16)
    src = src.transpose(1, 2) if transposed else src.permute(0, 2, 1, 3).contiguous()
    dst = torch.full_like(src, float("nan"))
    compiled_copy()(src, dst)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


def test_runs_on_the_current_stream(cache_dir):
    src = torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.float16)
    dst = torch.full_like(src, float("nan"))
    kernel = compiled_copy()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy so an ordering bug would show
        kernel(src, dst)
        snapshot = dst.clone()
    torch.cuda.synchronize()
    assert torch.equal(snapshot, src)


def test_wrong_dtype_is_refused_by_the_entry_point(cache_dir):
    kernel = compiled_copy()  # compiled for float16
    src = torch.randn(1, 4, 2, 64, device="cuda", dtype=torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    with pytest.raises(ValueError, match=r"(?s)argument #0.*expected dtype="):
        kernel(src, dst)
    torch.cuda.synchronize()
    assert torch.isnan(dst).all()
