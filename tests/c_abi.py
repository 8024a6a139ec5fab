"""ctypes declarations of the C library's entry points (cute_flash/c_abi/cute_flash.h), shared by
the CPU and GPU tests of `cute-flash export`."""

import ctypes


class Tensor(ctypes.Structure):
    """`cuflash_tensor`: a device pointer and element strides of batch, head and sequence."""
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
                ("seq_stride", ctypes.c_int64)]


def declare(lib):
    """Argument and result types of every entry point the tests call, on a loaded library."""
    for name in ("cuflash_error_string", "cuflash_last_error_message", "cuflash_build_info"):
        getattr(lib, name).restype = ctypes.c_char_p
    dims = [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    for dtype in ("f16", "bf16", "f32"):
        getattr(lib, f"cuflash_attention_forward_{dtype}").argtypes = [ctypes.c_void_p] * 5 + dims
        getattr(lib, f"cuflash_attention_backward_{dtype}").argtypes = [ctypes.c_void_p] * 9 + dims
    ex_dims = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.cuflash_attention_forward_ex.argtypes = [ctypes.c_int] + [ctypes.POINTER(Tensor)] * 5 + ex_dims
    # ... causal, deterministic, stream
    lib.cuflash_attention_backward_ex.argtypes = [ctypes.c_int] + [ctypes.POINTER(Tensor)] * 9 + ex_dims[:-1] + [
        ctypes.c_int, ctypes.c_void_p]
    return lib
