"""Vision-language building blocks (hybridrl/data/images.py, core/families.py's VISION_FAMILIES) on a
tiny model of every family row, built from a config (tests/helpers/vision.py): the ids the trainer
makes are the processor's grid, the positions are the model's own, and a packed row of several
samples with several images equals each sample alone. No engine starts."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from hybridrl.core.families import VISION_FAMILIES, vision_family
from hybridrl.data import images

from helpers.vision import PAD, image_processor, tiny_vlm

pytestmark = pytest.mark.fast
FAMILIES = sorted(VISION_FAMILIES)


def picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_row_names_its_model_tower_and_projector(model_type):
    model = tiny_vlm(model_type)
    row = vision_family(model.config)
    assert row is VISION_FAMILIES[model_type] and type(model).__name__ == row.model_class
    names = [n for n, _ in model.named_parameters()]
    tower = [n for n in names if n.startswith(row.tower)]
    assert tower and all(any(n.startswith(p) for n in tower) for p in row.projector)
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in names if n not in tower)
    assert vision_family({"model_type": "qwen2"}) is None


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_packed_row_of_samples_with_images_equals_each_sample_alone(model_type):
    """Two samples, one with one image and one with two, each expanded (images.expand) and given its
    own [4, T] positions (images.rope_positions, equal to those the model computes itself), packed
    into one row: every position's hidden state is the sample's alone, to 1e-5 in float32."""
    model = tiny_vlm(model_type)
    ip = image_processor(model)
    v = model.config.vision_config
    f = v.patch_size * v.spatial_merge_size
    samples = [
        ([1, 3, PAD, 4, 7, 8, 9, 10], [picture(2 * f, 2 * f, 0)]),
        ([1, 3, PAD, 4, 11, 3, PAD, 4, 12, 13, 14], [picture(2 * f, 4 * f, 1), picture(2 * f, 2 * f, 2)]),
    ]
    alone, parts = [], []
    for collapsed, imgs in samples:
        out = ip(images=imgs, return_tensors="pt")
        ids = images.expand(collapsed, out["image_grid_thw"], PAD, v.spatial_merge_size)
        assert ids.count(PAD) == int(out["image_grid_thw"].prod(-1).sum()) // v.spatial_merge_size**2
        pos = images.rope_positions(model, ids, out["image_grid_thw"], PAD)
        inputs = dict(
            input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"]
        )
        with torch.no_grad():
            h = model.model(**inputs, position_ids=pos[:, None], use_cache=False).last_hidden_state[0]
            mm = (inputs["input_ids"] == PAD).int()  # 1: image tokens, what the model computes its positions from
            own = model.model(**inputs, mm_token_type_ids=mm, use_cache=False)
        torch.testing.assert_close(h, own.last_hidden_state[0], rtol=1e-5, atol=1e-5)  # our positions, its own
        alone.append(h)
        parts.append((ids, pos, out))
    packed = dict(
        input_ids=torch.tensor([[t for ids, _, _ in parts for t in ids]]),
        position_ids=torch.cat([pos for _, pos, _ in parts], 1)[:, None],  # [4, 1, L]
        pixel_values=torch.cat([o["pixel_values"] for *_, o in parts]),
        image_grid_thw=torch.cat([o["image_grid_thw"] for *_, o in parts]),
    )
    with torch.no_grad():
        h = model.model(**packed, use_cache=False).last_hidden_state[0]
    torch.testing.assert_close(h, torch.cat(alone), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_images_are_sized_once_to_the_patch_grid(model_type):
    """images.fit resizes as the processor would, so the processor's own resize is the identity."""
    model = tiny_vlm(model_type)
    ip, v = image_processor(model), model.config.vision_config
    f = v.patch_size * v.spatial_merge_size
    lo, hi = ip.size["shortest_edge"], ip.size["longest_edge"]  # the pixel bounds
    im = images.fit(picture(50, 130, 3), f, lo, hi)
    assert im.height % f == 0 and im.width % f == 0
    grid = ip(images=[im], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert grid == [1, im.height // v.patch_size, im.width // v.patch_size]
    assert images.fit(im, f, lo, hi) is im


def test_an_image_loads_from_a_path_bytes_or_a_datasets_feature_and_fails_in_one_line(tmp_path):
    buf = io.BytesIO()
    picture(8, 8, 4).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    want = np.asarray(picture(8, 8, 4))
    for value in ("a.png", str(tmp_path / "a.png"), buf.getvalue(), {"bytes": buf.getvalue(), "path": None}):
        assert (np.asarray(images.load(value, tmp_path)) == want).all()
    (tmp_path / "bad.png").write_bytes(b"not an image")
    for value, why in (("missing.png", "no such file"), ("bad.png", "unreadable"), (3, "must be a path")):
        with pytest.raises(ValueError, match=why) as e:
            images.load(value, tmp_path)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) for 1 image\(s\)"):
        images.expand([PAD, 1, PAD], torch.tensor([[1, 4, 4]]), PAD, 2)
