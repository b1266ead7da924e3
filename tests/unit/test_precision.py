"""Which precision `auto` resolves to on this host, and that a named precision is kept as asked."""

from cs3ray.core.precision import native_bf16, resolve_precision


def test_auto_precision_is_bf16_only_on_bf16_hardware():
    assert resolve_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32")
    assert resolve_precision("fp16", "cpu") == "fp16"  # a named precision is kept as asked
