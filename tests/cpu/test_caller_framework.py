"""`forward` and `backward` hand results back in the caller's framework: how `api.to_caller`
picks the framework and keeps the memory (numpy stands in for CuPy and JAX on the CPU)."""

import sys
import types

import numpy as np
import pytest
import torch

from cute_flash.api import to_caller


def test_torch_callers_get_the_tensor_itself():
    result = torch.zeros(3)
    assert to_caller(torch.ones(3), None, result) is result


def test_an_output_the_caller_passed_comes_back_as_passed():
    given = np.zeros(3, dtype=np.float32)
    assert to_caller(np.ones(3), given, torch.zeros(3)) is given


@pytest.mark.skipif(not hasattr(np.ndarray, "__array_namespace__"), reason="numpy without the array API")
def test_other_frameworks_get_their_own_array_over_the_same_memory():
    result = torch.arange(6, dtype=torch.float32)
    got = to_caller(np.ones(3), None, result)
    assert type(got) is np.ndarray and got.__array_interface__["data"][0] == result.data_ptr()
    result[0] = 42
    assert got[0] == 42


def test_without_an_array_namespace_the_package_s_from_dlpack_is_used(monkeypatch):
    seen = []
    framework = types.ModuleType("someframework")
    framework.from_dlpack = lambda tensor: seen.append(tensor) or "array"
    monkeypatch.setitem(sys.modules, "someframework", framework)
    caller_type = type("Array", (), {"__module__": "someframework.core"})
    result = torch.zeros(2)
    assert to_caller(caller_type(), None, result) == "array" and seen == [result]
