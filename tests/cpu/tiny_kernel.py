"""A one-line CuTe kernel, small enough to compile in a fraction of a second, for cache tests."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from cute_flash.tensors import fake_bshd, fake_stream


class CopyKernel:
    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mDst: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mSrc, mDst).launch(grid=(mSrc.shape[1], mSrc.shape[2], mSrc.shape[0]), block=(self.head_dim, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mDst: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        s, h, b = cute.arch.block_idx()
        mDst[b, s, h, tidx] = mSrc[b, s, h, tidx]


def build(head_dim: int = 64):
    return lambda: (CopyKernel(head_dim), (fake_bshd(cutlass.Float16, head_dim), fake_bshd(cutlass.Float16, head_dim), fake_stream()))


KEY = ("tests.tiny_kernel", "copy", 64)


if __name__ == "__main__":
    # Child process of the cache tests: look the kernel up and report where it came from.
    import json
    import time

    from cute_flash import cache

    start = time.perf_counter()
    cache.get_or_compile(KEY, build(), "sm_80")
    print(json.dumps({**cache.stats, "seconds": time.perf_counter() - start}))
