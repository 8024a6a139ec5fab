"""Every head dim the API accepts (each multiple of 8 up to 256), both dtypes, forward and
backward, on one small ragged shape. The kernels are compiled beforehand by
`python -m tests.gpu.warm_sweep` (scripts/gpu-validate.sh)."""

import pytest
import torch

from .common import (
    SWEEP_HEAD_DIMS,
    assert_backward_accurate,
    assert_forward_accurate,
    randn,
    run_backward,
    run_forward,
    sweep_causal,
)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("head_dim", SWEEP_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_every_head_dim(dtype, head_dim):
    """GQA 4:2, a partial query tile, keys past one block (and, causal, a first row that sees 55)."""
    causal = sweep_causal(head_dim)
    q = randn(2, 77, 4, head_dim, dtype=dtype)
    k, v = (randn(2, 131, 2, head_dim, dtype=dtype) for _ in range(2))
    out, lse = run_forward(q, k, v, causal)
    assert_forward_accurate(out, lse, q, k, v, causal)


@pytest.mark.parametrize("head_dim", SWEEP_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_backward_every_head_dim(dtype, head_dim):
    causal = sweep_causal(head_dim)
    q = randn(2, 77, 3, head_dim, dtype=dtype)
    k, v = (randn(2, 131, 3, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(2, 77, 3, head_dim, dtype=dtype)
    assert_backward_accurate(run_backward(q, k, v, dout, causal), dout, q, k, v, causal)
