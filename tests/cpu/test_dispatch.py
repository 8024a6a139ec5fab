"""Dispatch: which kernel serves which GPU, and what the compile key holds."""

import pytest
import cutlass
import torch

from cute_flash import UnsupportedDtypeError, device, dispatch


@pytest.mark.parametrize("capability, target", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"), ((10, 0), "sm_100a")])
def test_compile_targets(capability, target):
    assert device.target_arch_for(capability) == target


def test_families(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_KERNEL_ARCH", raising=False)
    assert device.kernel_family((8, 6)) == "sm80"
    assert device.kernel_family((9, 0)) == "sm90"
    assert device.kernel_family((12, 0)) == "sm80", "newer GPUs without a specialized kernel use the sm80 family"
    monkeypatch.setenv("CUTE_FLASH_KERNEL_ARCH", "sm80")
    assert device.kernel_family((9, 0)) == "sm80"


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_fp32_runs_on_the_sm80_kernels_but_the_hopper_forward(capability):
    """Split TF32 lives in the sm80 kernels, but for the Hopper forward at head dims 64 and 128
    (kernels/sm90/fwd_tf32.py): fp32 plans the sm80 kernels on the H100 for every other head dim
    and for the backward."""
    for head_dim in range(8, 257, 8):
        hopper = capability == (9, 0) and head_dim in (64, 128)
        family = dispatch.plan_forward(capability, torch.float32, head_dim, True, num_sms=132).family
        assert family == ("sm90" if hopper else "sm80")
    backward = dispatch.plan_backward(capability, torch.float32, 128, False)
    assert {backward.pre.family, backward.main.family, backward.post.family} == {"sm80"}
    assert backward.main.config.dtype is cutlass.Float32
    with pytest.raises(UnsupportedDtypeError, match="float32"):
        dispatch.plan_forward(capability, torch.float64, 64, False)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_key_holds_only_code_shaping_values(capability, monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_KERNEL_ARCH", raising=False)
    plan = dispatch.plan_forward(capability, torch.bfloat16, 128, True)
    again = dispatch.plan_forward(capability, torch.bfloat16, 128, True)
    assert plan.key == again.key and plan.arch == device.target_arch_for(capability)
    fields = plan.settings()
    assert fields["head_dim"] == 128 and fields["causal"] is True
    assert not {"batch", "seqlen_q", "seqlen_k", "softmax_scale", "nheads"} & set(fields)
    others = {dispatch.plan_forward(capability, dt, d, c).key for dt in (torch.float16, torch.bfloat16) for d in (64, 72) for c in (False, True)}
    assert len(others) == 8, "dtype, head dim and causal each change the key"


def test_sm90_serves_its_head_dims_and_sm80_the_rest(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_KERNEL_ARCH", raising=False)
    for head_dim in (64, 96, 128, 192, 256):
        assert dispatch.plan_forward((9, 0), torch.float16, head_dim, False).kernel_cls.__name__ == "FlashAttnFwdSm90"
    for head_dim in (8, 40, 72):
        assert dispatch.plan_forward((9, 0), torch.float16, head_dim, False).kernel_cls.__name__ == "FlashAttnFwdSm80"
    assert dispatch.plan_forward((8, 0), torch.float16, 128, False).kernel_cls.__name__ == "FlashAttnFwdSm80"


def test_length_buckets_reach_the_sm90_launch_settings():
    classes = [dispatch.length_class(n, causal) for causal in (False, True)
               for n in (1, 512, 513, 1024, 1025, 2048, 2049, 4096, 4097)]
    assert dispatch.length_classes(False) == ("short", "short_512", "short_2k", "long")
    assert classes == ["short_512", "short_512", "short", "short", "short_2k", "short_2k", "long", "long", "long",
                       "short_512", "short_512", "short", "short", "short_2k", "short_2k", "mid", "mid", "long"]
    short = dispatch.plan_forward((9, 0), torch.bfloat16, 128, True, length="short", num_sms=132).settings()
    long = dispatch.plan_forward((9, 0), torch.bfloat16, 128, True, length="long", num_sms=132).settings()
    assert short["num_sms"] == 132 and short["num_stages"] == 2 and short["tile_order"] == "head"
    # Long causal d128: persistent CTAs taking tiles from the global counter in the L2-grouped order,
    # on the non-causal kernel's 192 x 80 tiles with three K/V stages; mid causal d128 too.
    assert long["num_sms"] == 132 and long["dynamic_schedule"] and long["num_stages"] == 3
    assert long["tile_order"] == "l2" and long.get("q_stages", 1) == 1
    mid = dispatch.plan_forward((9, 0), torch.bfloat16, 128, True, length="mid", num_sms=132).settings()
    for plan in (long, mid):
        assert (plan["tile_m"], plan["tile_n"], plan["num_stages"]) == (192, 80, 3)
        assert not plan.get("wg_epilogue", False) and plan.get("q_stages", 1) == 1
    assert (short["tile_m"], short["tile_n"], short["q_stages"]) == (128, 128, 2)
    # Long non-causal d128: 192 x 80 tiles; d64: next tile's blocks prefetched on short problems,
    # the dynamic schedule on long ones.
    long_full = dispatch.plan_forward((9, 0), torch.bfloat16, 128, False, length="long", num_sms=132).settings()
    # Non-causal "short_2k" (1025-2048 keys): the short settings, but d128 rescales O after the softmax.
    for head_dim in (64, 128, 256):
        short_full, short_2k_full = (dispatch.plan_forward((9, 0), torch.bfloat16, head_dim, False, length=length,
                                                           num_sms=132).settings() for length in ("short", "short_2k"))
        expected = dict(short_full)
        if head_dim == 128:  # short problems keep the DSL's sleeping waits, mid ones spin
            expected["spin_waits"] = True
            assert short_full["spin_waits"] is False and short_2k_full["spin_waits"] is True
        # Up to 1024 keys d128 to d256 take their tiles from the counter (and d256 puts L2 hints on
        # its TMA copies); short_2k walks statically.
        assert short_full.get("dynamic_schedule", False) == (head_dim > 96)
        expected.update(dynamic_schedule=False, cache_hints=False)
        assert short_2k_full == expected
    assert (long_full["tile_m"], long_full["tile_n"], long_full["num_sms"]) == (192, 80, 132)
    assert long_full["dynamic_schedule"]
    for causal in (False, True):
        short64 = dispatch.plan_forward((9, 0), torch.bfloat16, 64, causal, length="short", num_sms=132).settings()
        assert short64["prefetch_next"] and short64["num_sms"] == 132
        assert not short64.get("dynamic_schedule", False)
        long64 = dispatch.plan_forward((9, 0), torch.bfloat16, 64, causal, length="long", num_sms=132).settings()
        assert not long64.get("prefetch_next", False) and long64["dynamic_schedule"]
        assert long64.get("spin_waits", True) == causal and short64.get("spin_waits", True)
        assert long64.get("recompute_epilogue", False) == (not causal)
        assert long64.get("q_by_group", False) == (not causal) and not short64.get("q_by_group", False)
        # Q by warp group at long non-causal d64 in bf16 only (fp16 lost 2-4% with it).
        long64_fp16 = dispatch.plan_forward((9, 0), torch.float16, 64, causal, length="long", num_sms=132).settings()
        assert not long64_fp16.get("q_by_group", False)
        assert not short64.get("recompute_epilogue", False)
        assert short64["wg_epilogue"] and short64["q_stages"] == 2
    # Lazy rescaling on long and mid problems (all causal ones from 2049 keys), but for non-causal d64;
    # the kernel then never rescales O early nor tests row factors for 1.
    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for length in dispatch.length_classes(causal):
                plan = dispatch.plan_forward((9, 0), torch.float16, head_dim, causal, length=length,
                                                  num_sms=132).settings()
                lazy = length in ("mid", "long") and (causal or head_dim > 64)
                # (every long and mid kernel but non-causal d64, besides every stale_max one)
                # stale_max (exponentials before the row maxima) everywhere but long d256 and short
                # causal d64 up to 1k keys; it rescales lazily too.
                stale = not ((length == "long" and head_dim > 192)
                             or (causal and head_dim <= 64 and length in ("short_512", "short")))
                assert plan.get("stale_max", False) == stale, (head_dim, causal, length)
                assert plan["lazy_rescale"] == (lazy or stale)
    # Causal d64 tiles: 128 x 128 up to 2048 keys, 192 x 128 beyond; causal d128 double-buffers Q.
    for length, tile_m in (("short", 128), ("short_2k", 128), ("mid", 192), ("long", 192)):
        plan = dispatch.plan_forward((9, 0), torch.bfloat16, 64, True, length=length, num_sms=132).settings()
        assert plan["tile_m"] == tile_m and plan["num_sms"] == 132
        assert plan.get("dynamic_schedule", False) == (length in ("mid", "long"))
        assert plan.get("q_stages", 1) == (2 if length.startswith("short") else 1)
    # Short and short_2k causal walks (per head, static) take their last rounds from a host plan.
    for head_dim in (64, 96, 128, 192, 256):
        for length in dispatch.length_classes(True):
            plan = dispatch.plan_forward((9, 0), torch.float16, head_dim, True, length=length,
                                              num_sms=132).settings()
            assert plan.get("planned_tail", False) == length.startswith("short") == (plan["tile_order"] == "head")
            assert plan["planned_tail"] == length.startswith("short")
        full = dispatch.plan_forward((9, 0), torch.float16, head_dim, False, length="short", num_sms=132).settings()
        assert not full["planned_tail"]
    # Each warp group's rows of O go out by TMA at short and short_2k d128, and non-causal d64.
    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for length in dispatch.length_classes(causal):
                plan = dispatch.plan_forward((9, 0), torch.bfloat16, head_dim, causal, length=length,
                                                  num_sms=132).settings()
                expected = length.startswith("short") and (head_dim == 128 or (head_dim == 64 and not causal))
                assert plan["wg_tma_store"] == expected, (head_dim, causal, length)
    # L2 eviction priorities on the TMA copies: short causal problems but d96, and short non-causal
    # d256 up to 1024 keys.
    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for length in dispatch.length_classes(causal):
                plan = dispatch.plan_forward((9, 0), torch.bfloat16, head_dim, causal, length=length,
                                                  num_sms=132).settings()
                up_to_2k = length.startswith("short")
                expected = up_to_2k and (head_dim != 96 if causal else head_dim == 256 and length != "short_2k")
                assert plan["cache_hints"] == expected, (head_dim, causal, length)
    # Causal d96 on 192 x 96 tiles from 1025 keys on; causal d256 on 64-column blocks up to 1024 keys.
    for length, d96_tiles, d256_tile_n in (("short", (128, 128), 64), ("short_2k", (192, 96), 80), ("mid", (192, 96), 80)):
        d96, d256 = (dispatch.plan_forward((9, 0), torch.float16, d, True, length=length, num_sms=132).settings()
                     for d in (96, 256))
        assert (d96["tile_m"], d96["tile_n"]) == d96_tiles and d256["tile_n"] == d256_tile_n
        assert d96.get("dynamic_schedule", False) == (length == "mid")
    # 64-column blocks: d192 up to 1024 keys, non-causal d256 up to 512 (causal: 1024); elsewhere
    # short_512 launches the short kernel itself.
    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            tiles = {length: dispatch.plan_forward((9, 0), torch.bfloat16, head_dim, causal, length=length,
                                                        num_sms=132).settings()
                     for length in ("short_512", "short", "short_2k")}
            blocks = {length: plan["tile_n"] for length, plan in tiles.items()}
            if head_dim == 192:
                assert blocks == {"short_512": 64, "short": 64, "short_2k": 112}
            elif head_dim == 256:
                assert blocks == {"short_512": 64, "short": 64 if causal else 80, "short_2k": 80}
            else:
                assert tiles["short_512"] == tiles["short"], (head_dim, causal)
    assert short["q_stages"] == 2 and short["wg_epilogue"] and short["recompute_epilogue"]
    assert not long.get("recompute_epilogue", False)
    for causal in (False, True):
        short256 = dispatch.plan_forward((9, 0), torch.bfloat16, 256, causal, length="short", num_sms=132).settings()
        assert short256.get("recompute_epilogue", False) == (not causal)
        long256 = dispatch.plan_forward((9, 0), torch.bfloat16, 256, causal, length="long", num_sms=132).settings()
        long256_fp16 = dispatch.plan_forward((9, 0), torch.float16, 256, causal, length="long",
                                                  num_sms=132).settings()
        # Q by warp group wherever O goes out per group (short, mid, long d256 but fp16 non-causal).
        assert short256["q_by_group"] and short256["wg_epilogue"]
        # Short d256 stores O from registers; Q goes back early only when non-causal.
        assert short256["o_from_registers"] and short256["release_q_early"] == (not causal)
        assert not long256.get("o_from_registers", False)
        assert long256["q_by_group"] and long256["wg_epilogue"]
        assert long256_fp16.get("q_by_group", False) == causal == long256_fp16.get("wg_epilogue", False)
