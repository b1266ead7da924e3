"""The compression section: explained, defaults off, and combinations that cannot work refused in one sentence."""

import pytest

from cs3ray.config import ConfigError, explain, load_config


def test_compression_fields_are_explained_and_off_by_default():
    rows = {name: desc for name, _, desc in explain()}
    for field in ("codec", "density", "error_feedback", "warmup_steps", "hierarchical"):
        assert rows[f"compression.{field}"]
    c = load_config(None, []).compression
    assert (c.codec, c.density, c.error_feedback, c.warmup_steps, c.hierarchical) == ("none", 0.1, True, 0, False)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("codec", ["bf16", "int8", "int4_sparse"])
def test_every_codec_works_with_every_data_parallel_strategy(strategy, codec):
    cfg = load_config(None, [f"compression.codec={codec}", f"parallel.strategy={strategy}"])
    assert cfg.compression.codec == codec


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("codec", ["none", "int8", "int4_sparse"])
def test_hierarchical_sync_is_accepted_with_every_data_parallel_strategy(strategy, codec):
    cfg = load_config(None, [f"compression.codec={codec}", f"parallel.strategy={strategy}", "compression.hierarchical=true"])
    assert cfg.compression.hierarchical


@pytest.mark.parametrize("overrides,needle", [
    (["compression.codec=int8", "cluster.fault_tolerance=replicas"], "cannot be used with cluster.fault_tolerance"),
    (["compression.codec=int8", "compression.hierarchical=true", "parallel.tp=2", "cluster.workers=2"],
     "compression.hierarchical=true needs parallel.tp=1"),
    (["compression.hierarchical=true", "cluster.fault_tolerance=replicas"], "compression.hierarchical=true cannot"),
    (["compression.codec=int8", "compression.hierarchical=true", "cluster.use_gpu=true"],
     "compression.hierarchical=true cannot be used with cluster.use_gpu"),
    (["compression.codec=zstd"], "compression.codec"),
    (["compression.density=0"], "compression.density"),
    (["compression.density=1.5"], "compression.density"),
    (["compression.warmup_steps=-1"], "compression.warmup_steps"),
])
def test_impossible_compression_settings_are_one_clear_sentence(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
