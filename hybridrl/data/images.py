"""Images in prompts, for vision-language models (core/families.py's VISION_FAMILIES; the plan:
docs/design/vision.md): a row's images loaded, sized once to the family's patch grid, and the token
ids and positions both engines see.

A prompt holds one placeholder token per image, which is what vLLM takes: it expands each into the
image's merged patches itself (given already-expanded ids it would expand the first run again, with
no error). `expand` makes the same run here from the image processor's grids, so the trainer's ids
are vLLM's. `rope_positions` gives one sample's multimodal rotary positions as [4, T]: the text
position first (transformers' Qwen-VL models find packed samples from it, where positions restart),
then t, h and w; samples concatenated along T keep their own positions and attend only to themselves.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch


def load(value: Any, base: Path | None = None):
    """A row's image as an RGB PIL image: a path (relative to `base`, the data file's directory), bytes,
    a `datasets` Image feature's dict ({"bytes": ..., "path": ...}) or a PIL image. ValueError in one
    line saying what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # datasets' Image feature, as rows hold it undecoded
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        source: Any = io.BytesIO(value)
        what = f"{len(value)} bytes"
    elif isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() or base is None else base / value
        if not path.is_file():
            raise ValueError(f"image {value!r}: no such file" + (f" (relative to {base})" if base else ""))
        source, what = path, repr(value)
    else:
        raise ValueError(f"an image must be a path, bytes or a datasets Image, not {type(value).__name__}")
    try:
        with Image.open(source) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image {what}: unreadable ({str(e).splitlines()[0]})") from None


def fit(image, factor: int, min_pixels: int, max_pixels: int):
    """`image` resized as the Qwen-VL image processors resize (transformers' smart_resize: each side a
    multiple of `factor` = patch x merge, the area within the pixel bounds), so that their own resize,
    on whichever side runs it, leaves it as it is."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(image.height, image.width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return image if (h, w) == (image.height, image.width) else image.resize((w, h), Image.Resampling.BICUBIC)


def expand(ids: list[int], grid_thw: torch.Tensor, pad: int, merge: int) -> list[int]:
    """The prompt's ids with each image's one placeholder `pad` made a run of its merged patches
    (grid t x h x w / merge^2), as vLLM expands it. ValueError where placeholders and images differ."""
    counts = (grid_thw.prod(-1) // merge**2).tolist() if len(grid_thw) else []
    if ids.count(pad) != len(counts):
        raise ValueError(f"the prompt has {ids.count(pad)} image placeholder(s) for {len(counts)} image(s)")
    runs = iter(counts)
    return [t for x in ids for t in ([pad] * next(runs) if x == pad else [x])]


def rope_positions(model, ids: list[int], grid_thw: torch.Tensor, pad: int) -> torch.Tensor:
    """[4, T] long: the expanded prompt-and-completion `ids`' text positions (0..T-1), then the
    multimodal t, h, w positions the model's own get_rope_index gives them."""
    t = torch.tensor([ids])
    text = torch.arange(len(ids))[None]
    if not (t == pad).any():  # a text-only sample: every row is its text position
        return text.expand(4, -1).clone()
    core = model.model if hasattr(model.model, "get_rope_index") else model
    mm = (t == pad).int()  # 1 marks image tokens (2 would be video)
    pos, _ = core.get_rope_index(t, mm, image_grid_thw=grid_thw)  # [3, 1, T]
    return torch.cat([text, pos[:, 0]], 0)
