"""Checks that a file is a real picture: a PNG that decodes, of a useful size, with something drawn on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path: Path, min_width: int = 400, min_height: int = 250) -> np.ndarray:
    """The decoded RGB(A) pixels of `path`, after asserting it is a non-blank PNG of at least that size."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert path.stat().st_size > 10_000, f"{path} is only {path.stat().st_size} bytes"
    pixels = imread(path)
    height, width = pixels.shape[:2]
    assert width >= min_width and height >= min_height, f"{path} is {width}x{height}"
    rgb = pixels[..., :3]
    # Lines, text and axes on a white background: a blank image would have next to no other pixels.
    assert (rgb.min(-1) < 0.9).mean() > 0.01, f"{path} is blank"
    return rgb


def has_colour(rgb: np.ndarray, colour: tuple[float, float, float], tol: float = 0.15, min_pixels: int = 20) -> bool:
    """True when at least `min_pixels` pixels are within `tol` of `colour` (0-1 RGB; antialiased lines blend)."""
    return int((np.abs(rgb - np.array(colour)).max(-1) < tol).sum()) >= min_pixels
