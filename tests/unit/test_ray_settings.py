"""cs3ray's Ray Data settings: set for the pipelines inside them, restored when the last one leaves, even when
two overlap and leave in the order they came (two ranks' streams in one process)."""

from __future__ import annotations

import logging

import ray.data

from cs3ray.data.ray_settings import ray_data_settings


def test_overlapping_users_share_one_saved_state_restored_by_the_last():
    ctx, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    before = ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level
    first, second = ray_data_settings(preserve_order=True), ray_data_settings(preserve_order=True)
    first.__enter__()
    second.__enter__()
    assert (ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level) == (True, False,
                                                                                               logging.ERROR)
    first.__exit__(None, None, None)  # not last in, first out: the settings stay while the second runs
    assert ctx.execution_options.preserve_order and logger.level == logging.ERROR
    second.__exit__(None, None, None)
    assert (ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level) == before
    with ray_data_settings(progress_bars=True):  # preparation's bars when asked: the log level is left alone
        assert ctx.enable_progress_bars and logger.level == before[2]
    assert (ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level) == before
