"""Which caller tensors kernels address directly, and which get an internal copy."""

import torch

from cute_flash.api import STAT_ALIGN, deliver, kernel_input, kernel_view, output_buffer


def test_strided_views_are_used_as_they_are():
    transposed = torch.randn(2, 4, 200, 72, dtype=torch.float16).transpose(1, 2)
    sliced = torch.randn(2, 190, 2, 128, dtype=torch.float16)[..., :64]
    assert kernel_view(transposed) is transposed and kernel_view(sliced) is sliced


def test_unaddressable_tensors_are_copied():
    misaligned = torch.randn(1, 64, 2, 67, dtype=torch.bfloat16)[..., 3:]
    head_dim_strided = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)[..., ::2]
    for t in (misaligned, head_dim_strided):
        assert kernel_view(t) is None
        copy = kernel_input(t)
        assert copy.is_contiguous() and torch.equal(copy, t)


def test_size_one_modes_get_divisible_strides():
    # torch calls this contiguous, but strides 3 and 5 would break the kernel's divisibility promise
    t = torch.empty(1, 7, 1, 64, dtype=torch.float16).as_strided((1, 7, 1, 64), (3, 64, 5, 1))
    view = kernel_view(t)
    assert view.stride() == (8, 64, 8, 1) and view.data_ptr() == t.data_ptr()


def test_row_statistics_need_only_a_unit_last_stride():
    lse = torch.empty(2, 8, 4)[:, ::2]  # head stride 8 floats: no divisibility is asked of it
    assert kernel_view(lse, STAT_ALIGN) is lse
    assert kernel_view(torch.empty(4, 2).t(), STAT_ALIGN) is None


def test_output_buffer_writes_in_place_or_copies_back():
    given = torch.full((2, 3, 4, 64), 7.0, dtype=torch.float16)
    assert output_buffer(given, lambda: None) is given
    unaddressable = torch.zeros(2, 3, 4, 128, dtype=torch.float16)[..., ::2]
    written = output_buffer(unaddressable, lambda: torch.ones(2, 3, 4, 64, dtype=torch.float16))
    assert written.data_ptr() != unaddressable.data_ptr()
    assert deliver(unaddressable, written) is unaddressable and torch.all(unaddressable == 1)
    assert deliver(None, written) is written
