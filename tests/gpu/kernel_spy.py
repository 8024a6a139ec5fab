"""Counting the calls that reach cute-flash's kernels (`cute_flash.api.forward` and `backward`),
to tell which implementation served a call routed through torch or transformers."""

from cute_flash import api


def count_kernel_calls(monkeypatch) -> dict[str, int]:
    calls = {"forward": 0, "backward": 0}
    forward, backward = api.forward, api.backward

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        calls["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(api, "forward", counted_forward)
    monkeypatch.setattr(api, "backward", counted_backward)
    return calls
