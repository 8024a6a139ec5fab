"""Asserting the library's typed errors: the exception class and its C-ABI code."""

import pytest

import cute_flash


def expect(code, exc_type, fn, *args, **kwargs) -> str:
    """Call fn, which must raise exc_type (a CuteFlashError) with `code`; returns its message."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, cute_flash.CuteFlashError)
    assert info.value.code == code
    return str(info.value)
