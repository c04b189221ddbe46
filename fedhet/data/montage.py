"""Image montages of datasets, for humans checking that a domain looks as intended.

Regenerate the montages in ``docs/images`` with::

    python -m fedhet.data.montage --out docs/images --seed 0
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedhet.data.tensors import TensorData

__all__ = ["montage_array", "save_montage"]

logger = logging.getLogger(__name__)


def montage_array(
    data: TensorData, rows: int = 8, cols: int = 8, gap: int = 2, scale: int = 2
) -> np.ndarray:
    """Tile the first ``rows * cols`` images of ``data`` into one uint8 ``[H, W, 3]`` array.

    Args:
        data: the images (uint8 NCHW, 1 or 3 channels).
        rows: grid rows.
        cols: grid columns.
        gap: white pixels between tiles (before scaling).
        scale: nearest-neighbour upscaling factor, so 32x32 tiles stay crisp in a browser.
    """
    count = min(len(data), rows * cols)
    _, channels, height, width = data.x.shape
    images = data.x[:count].numpy().transpose(0, 2, 3, 1)
    if channels == 1:
        images = np.repeat(images, 3, axis=3)
    grid = np.full(
        (rows * (height + gap) + gap, cols * (width + gap) + gap, 3), 255, dtype=np.uint8
    )
    for index in range(count):
        row, col = divmod(index, cols)
        top, left = gap + row * (height + gap), gap + col * (width + gap)
        grid[top : top + height, left : left + width] = images[index]
    return grid.repeat(scale, axis=0).repeat(scale, axis=1)


def save_montage(
    data: TensorData, path: str | Path, rows: int = 8, cols: int = 8, scale: int = 2
) -> Path:
    """Write a ``rows x cols`` montage of ``data`` as a PNG and return its path.

    PIL is imported here, not at module import, so ``import fedhet.data`` stays light.
    """
    from PIL import Image

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(montage_array(data, rows=rows, cols=cols, scale=scale)).save(target)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    """Write ``digits_<domain>.png`` for every embedded domain and the public photos."""
    from fedhet.data.embedded import load_embedded

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, splits in load_embedded(options.seed).items():
        path = save_montage(splits.train, options.out / f"digits_{name}.png")
        logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
