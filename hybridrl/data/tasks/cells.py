"""The vision-language demo task: "what colour is cell 3?" of a 56x56 image of four coloured cells.

An image is a 2x2 grid of 28x28 cells, each one of six colours (1,296 images); a prompt asks for
the colour of one cell, numbered 1-4 in reading order (5,184 prompts), and the answer is the
colour's name. A cell is exactly one image token of the Qwen2-VL-shaped demo model (14-pixel
patches merged 2x2), so the task asks the model to find the token of a cell and name what the
vision tower saw there. Guessing a colour is right one time in six.

256 of the prompts form a fixed held-out split (a SHA-256 ranking, as for the addition task), the
rest the train split. The shipped model (`hybridrl/demo_model_vision/`, examples/make_vision_demo_model.py)
was warmed up on the train split until its greedy held-out accuracy reached ~25%, so RL has room to
improve; the reward is exact_match (the completion, stripped, is the colour's name).

Usage: hybridrl train --data.path vision   (the demo model warmed on it; the demo's recipe)
    rows = cells.load("heldout")  # [{"prompt": "<image>what colour is cell 3?", "answer": "blue", "images": [PIL]}]
"""

from __future__ import annotations

import hashlib
import itertools
from functools import lru_cache
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parents[2] / "demo_model_vision"
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 180),
    "white": (245, 245, 245),
}
CELL = 28  # pixels of a cell's side: one image token (patch 14, merged 2x2)
NUM_HELDOUT = 256
MAX_NEW_TOKENS = 8  # the longest name (6 characters), EOS, one to spare
_SALT = "hybridrl-cells-v1"  # changing this changes the splits: don't


def prompt_text(cell: int) -> str:
    return f"<image>what colour is cell {cell}?"


def image(colours: tuple[str, ...]):
    """The 2x2 grid of `colours` (four names, reading order) as a 56x56 RGB PIL image."""
    from PIL import Image

    out = Image.new("RGB", (2 * CELL, 2 * CELL))
    for k, name in enumerate(colours):
        out.paste(COLOURS[name], (CELL * (k % 2), CELL * (k // 2), CELL * (k % 2 + 1), CELL * (k // 2 + 1)))
    return out


def _rank(tag: str, key: str) -> str:
    return hashlib.sha256(f"{_SALT}:{tag}:{key}".encode()).hexdigest()


@lru_cache(maxsize=None)
def _splits() -> dict[str, tuple[tuple[tuple[str, ...], int], ...]]:
    items = [(grid, cell) for grid in itertools.product(COLOURS, repeat=4) for cell in range(1, 5)]
    by_rank = sorted(items, key=lambda it: _rank("heldout", f"{it}"))
    heldout = sorted(by_rank[:NUM_HELDOUT])
    train = sorted(by_rank[NUM_HELDOUT:], key=lambda it: _rank("train-order", f"{it}"))
    return {"train": tuple(train), "heldout": tuple(heldout)}


def load(split: str) -> list[dict]:
    """Rows {"prompt", "answer", "images": [PIL image]} of "train" (4,928, fixed shuffled order) or
    "heldout" (256): verl's layout, an `<image>` marker where the image goes."""
    splits = _splits()
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(splits)}")
    return [
        {"prompt": prompt_text(cell), "answer": grid[cell - 1], "images": [image(grid)]} for grid, cell in splits[split]
    ]
