"""Which precision `auto` resolves to on this host, and that a named precision is kept as asked."""

from cs3ray.core.precision import native_bf16, resolve_precision


def test_auto_precision_is_bf16_only_on_bf16_hardware():
    assert resolve_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32")
    assert resolve_precision("fp16", "cpu") == "fp16"  # a named precision is kept as asked


def test_a_scaler_resumed_from_another_precision_keeps_its_own_scale():
    from cs3ray.core.precision import LossScaler

    fp32, fp16 = LossScaler(False), LossScaler(True)
    fp16.scale, fp16.skipped = 512.0, 3
    resumed = LossScaler(True)
    resumed.load_state_dict(fp32.state_dict())  # an fp32 run's scale of 1 would leave fp16 training unscaled
    assert resumed.scale == 2.0**16 and resumed.skipped == 0
    resumed.load_state_dict(fp16.state_dict())
    assert (resumed.scale, resumed.skipped) == (512.0, 3)
    back = LossScaler(False)
    back.load_state_dict(fp16.state_dict())
    assert back.scale == 1.0 and back.skipped == 3
    legacy = LossScaler(True)
    legacy.load_state_dict({"scale": 1.0, "clean_steps": 7, "skipped": 0})  # before `enabled` was saved
    assert legacy.scale == 2.0**16
