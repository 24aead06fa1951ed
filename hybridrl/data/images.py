"""Images in prompts, for vision-language models (core/families.py's VISION_FAMILIES; the plan:
docs/design/vision.md): a row's images loaded, sized once to the family's patch grid, and the token
ids and positions both engines see.

A prompt holds one placeholder token per image, which is what vLLM takes: it expands each into the
image's merged patches itself (given already-expanded ids it would expand the first run again, with
no error). `expand` makes the same run here from the image processor's grids, so the trainer's ids
are vLLM's. `positions` gives one sample's multimodal rotary positions (t, h, w) as [3, T], the rule
the models' own get_rope_index follows (`rope_positions`, its reference, calls it: [4, T], the text
position first, from which transformers' Qwen-VL models find packed samples where it restarts);
samples concatenated along T keep their own positions and attend only to themselves. `pixels` is
what the trainer's forward takes of a prompt's images: the image processor's patches and grids.
`Vision` is what the data path needs of a model to take images: its placeholder, the patch grid and
the pixel bounds images are fitted to, read from its config.json and preprocessor_config.json.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridrl.core.config import ConfigError
from hybridrl.core.families import VisionFamily, vision_family

if TYPE_CHECKING:  # the data path imports this module; torch loads where positions are computed
    import torch


class Pixels(NamedTuple):
    """One prompt's images as the trainer's model takes them (Vision.pixels)."""

    values: torch.Tensor  # [patches, 3 * temporal * patch^2] float: pixel_values, the image processor's
    grid: torch.Tensor  # [images, 3] long: image_grid_thw
    positions: torch.Tensor  # [3, prompt tokens] long: t, h, w of the expanded prompt
    next: int  # the position of the first token after the prompt (every row of a completion's text)


@dataclass(frozen=True)
class Vision:
    """How a vision-language model takes images: `Vision.of(model, tokenizer)`, None for a text-only
    model. A prompt holds `placeholder` once per image (its `image_token_id` once); each image is
    `fit` to multiples of `factor` within [min_pixels, max_pixels] and becomes `tokens(image)` tokens."""

    family: VisionFamily
    placeholder: str  # image_wrap[0] + image_token + image_wrap[1], what a prompt's text holds per image
    image_token_id: int
    patch: int  # pixels of a patch side
    merge: int  # patches merged per side into one token
    min_pixels: int
    max_pixels: int
    source: str = ""  # the model directory or hub name whose preprocessor_config.json `pixels` follows

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    @classmethod
    def of(cls, model: Any, tokenizer, *, local_files_only: bool = False) -> Vision | None:
        """`model`: a model directory or hub name (its config.json and preprocessor_config.json
        read), or its config (a dict or a transformers config: the pixel bounds are then the
        family's). Values the files do not give are the family's (VisionFamily's defaults). A
        tokenizer that does not encode the placeholder as one image token is a ConfigError."""
        files = isinstance(model, (str, Path))
        conf = _model_json(model, "config.json", local_files_only) if files else None
        if files and conf is None:
            raise ConfigError(f"model {model}: no config.json to read its vision settings from")
        if conf is None:
            conf = model if isinstance(model, dict) else model.to_dict()
        family = vision_family(conf)
        if family is None:  # a text-only model: its preprocessor file (if any) is never asked for
            return None
        pre = (_model_json(model, "preprocessor_config.json", local_files_only) if files else None) or {}
        v = conf.get("vision_config") or {}
        size = pre.get("size") or {}  # transformers 5: {shortest_edge, longest_edge} are the pixel bounds
        placeholder = family.image_wrap[0] + family.image_token + family.image_wrap[1]
        token = conf.get("image_token_id", tokenizer.convert_tokens_to_ids(family.image_token))
        ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
        if ids.count(token) != 1:
            raise ConfigError(
                f"the tokenizer encodes {placeholder!r} as {ids}, not with the model's image token {token} once: "
                f"its tokenizer must hold {family.image_token!r} as a special token (use the model's own)"
            )
        return cls(
            family,
            placeholder,
            token,
            patch=int(pre.get("patch_size") or v.get("patch_size") or family.patch),
            merge=int(pre.get("merge_size") or v.get("spatial_merge_size") or family.merge),
            min_pixels=int(size.get("shortest_edge") or pre.get("min_pixels") or family.min_pixels),
            max_pixels=int(size.get("longest_edge") or pre.get("max_pixels") or family.max_pixels),
            source=str(model) if files else "",
        )

    @functools.cached_property
    def processor(self):
        """The model's image processor, PIL's (no torchvision needed), as vLLM's own reads the model's
        preprocessor_config.json: the same mean, std and patch layout on both engines."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kw = dict(patch_size=self.patch, merge_size=self.merge, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        if self.source:
            return Qwen2VLImageProcessorPil.from_pretrained(self.source, **kw)
        return Qwen2VLImageProcessorPil(**kw)

    def pixels(self, images, ids: list[int]) -> Pixels:
        """A prompt's fitted `images` as the trainer's forward takes them, with the multimodal positions
        of its expanded `ids` (vLLM's) and the position its completion starts at."""
        out = self.processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"]
        want, got = int((grid.prod(-1) // self.merge**2).sum()), list(ids).count(self.image_token_id)
        if got != want:  # the features would not fill the placeholders: transformers would refuse the batch
            raise ValueError(f"the prompt holds {got} image tokens, its images' patches make {want}")
        pos = positions(ids, grid, self.image_token_id, self.merge)
        return Pixels(out["pixel_values"], grid, pos, int(pos.max()) + 1 if pos.numel() else 0)

    def fit(self, image):
        """`image` at the size the model's image processor would give it (`fit`)."""
        return fit(image, self.factor, self.min_pixels, self.max_pixels)

    def tokens(self, image) -> int:
        """The image tokens `image` becomes once fitted: grid (h / patch) x (w / patch) / merge^2."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(
            image.height, image.width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return (h // self.patch) * (w // self.patch) // self.merge**2


def _model_json(model: str | Path, name: str, local_files_only: bool) -> dict | None:
    """A JSON file of a model directory or hub repository (its cache, or the hub as transformers
    would read it); None where it has none."""
    p = Path(model).expanduser()
    if p.is_dir():
        return json.loads((p / name).read_text()) if (p / name).is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(str(model), name, local_files_only=local_files_only)).read_text())
    except Exception:  # noqa: BLE001 - not on the hub, not cached, offline: the file is absent
        return None


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


# vLLM clamps a logit bias to +-100: a placeholder token then has p < e^-90, and both engines add the same
BAN = -100.0


def placeholders(config: Any) -> list[int]:
    """A vision-language model's image and video placeholder ids (config.json's), which a completion
    must not hold: vLLM would not expand them, and the trainer would find more image tokens than
    features. [] for a text-only model."""
    conf = config if isinstance(config, dict) else config.to_dict()
    if vision_family(conf) is None:
        return []
    return [int(conf[k]) for k in ("image_token_id", "video_token_id") if conf.get(k) is not None]


def ban(config: Any, vocab: int) -> torch.Tensor | None:
    """[vocab] float: BAN on the placeholders, 0 elsewhere, the logit bias both engines apply to the
    tokens they sample or score (vLLM's SamplingParams.logit_bias, the log-prob kernels' bias); None
    for a text-only model."""
    import torch

    ids = placeholders(config)
    if not ids:
        return None
    out = torch.zeros(vocab)
    out[ids] = BAN
    return out


def positions(ids: list[int], grid_thw: torch.Tensor, pad: int, merge: int) -> torch.Tensor:
    """[3, T] long: the multimodal rotary positions (t, h, w) of expanded `ids`, as the Qwen-VL
    models' get_rope_index gives them for images: text runs count on in all three rows; an image's
    run of (h / merge) x (w / merge) tokens takes t = start, h = start + row, w = start + column,
    and the text after it resumes at start + max(h, w) / merge."""
    import torch

    grids, out, at = iter(grid_thw.tolist()), [], 0
    for image, run in itertools.groupby(ids, lambda t: t == pad):
        n = len(list(run))
        if not image:
            out.append(torch.arange(at, at + n).expand(3, -1))
            at += n
            continue
        t, h, w = next(grids)
        h, w = h // merge, w // merge
        if t * h * w != n:
            raise ValueError(f"an image run of {n} tokens for a {t}x{h}x{w} grid of merged patches")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out.append(torch.stack([tt, hh, ww]).reshape(3, -1) + at)
        at += max(h, w)
    return torch.cat(out, 1) if out else torch.zeros(3, 0, dtype=torch.long)


def rope_positions(model, ids: list[int], grid_thw: torch.Tensor, pad: int) -> torch.Tensor:
    """[4, T] long: the expanded prompt-and-completion `ids`' text positions (0..T-1), then the
    multimodal t, h, w positions the model's own get_rope_index gives them (`positions`' reference)."""
    import torch

    t = torch.tensor([ids])
    text = torch.arange(len(ids))[None]
    if not (t == pad).any():  # a text-only sample: every row is its text position
        return text.expand(4, -1).clone()
    core = model.model if hasattr(model.model, "get_rope_index") else model
    mm = (t == pad).int()  # 1 marks image tokens (2 would be video)
    pos, _ = core.get_rope_index(t, mm, image_grid_thw=grid_thw)  # [3, 1, T]
    return torch.cat([text, pos[:, 0]], 0)
