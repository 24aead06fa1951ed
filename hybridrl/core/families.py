"""Each mixture-of-experts family hybridrl trains, in one place: what its config.json calls the experts,
transformers' classes for it, how vLLM names its weights, and how its router weighs the chosen experts.

Every module that asks "is this a mixture-of-experts model, and of which family?" reads this table:
models.moe_family (the refusal of other families), shape.Shape (what the plan counts),
routing (which routers replay), deepspeed_compat (the ZeRO-3 leaf blocks), vllm_compat (the names
vLLM loads) and the recipe (LoRA's targets). A new family is a row here; tests/test_moe.py runs every
row. transformers stores these families' experts fused per layer (gate_up_proj [E, 2I, H],
down_proj [E, H, I]); others (DeepSeek-V2/V3, gpt-oss, Llama 4, Jamba, ...) have other expert
layouts, shared or dense layers, biases or quantized experts that nothing here has checked.

The vision-language families (VISION_FAMILIES, below) are a table of their own: the tower and projector
a hand-off may leave out, the placeholder a prompt holds per image, the class the memory plan builds on the
meta device to count the tower (shape.Tower). tests/test_vision.py runs every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEFamily:
    model_type: str  # config.json's model_type
    config_class: str  # transformers' config class
    experts_key: str  # the config key counting the routed experts of a layer
    router: str  # transformers' router module (routing replay hooks it)
    block: str  # transformers' mixture-of-experts block (a ZeRO-3 leaf module: all its experts gather at once)
    expert_width_key: str = "moe_intermediate_size"  # one expert's MLP width (else intermediate_size)
    shared_expert: bool = False  # a shared expert beside the routed ones (shared_expert_intermediate_size)
    renormalise: bool | None = None  # True: always renormalise the top-k weights, kept in float32; None: norm_topk_prob
    vllm_block: str = ""  # vLLM's name for the block where it differs from transformers' `mlp` (then per-expert
    #                       w1/w3/w2 tensors, not fused ones: vllm_compat renames and splits the trainer's)
    qk_norm: str = ""  # RMSNorm on the queries and keys: over one head ("head") or over all heads ("all")


FAMILIES = {
    f.model_type: f
    for f in (
        MoEFamily(
            "qwen3_moe", "Qwen3MoeConfig", "num_experts", "Qwen3MoeTopKRouter", "Qwen3MoeSparseMoeBlock", qk_norm="head"
        ),
        MoEFamily(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "num_experts",
            "Qwen2MoeTopKRouter",
            "Qwen2MoeSparseMoeBlock",
            shared_expert=True,
        ),
        MoEFamily(
            "mixtral",
            "MixtralConfig",
            "num_local_experts",
            "MixtralTopKRouter",
            "MixtralSparseMoeBlock",
            expert_width_key="intermediate_size",
            renormalise=True,
            vllm_block="block_sparse_moe",
        ),
        MoEFamily(
            "olmoe",
            "OlmoeConfig",
            "num_experts",
            "OlmoeTopKRouter",
            "OlmoeSparseMoeBlock",
            expert_width_key="intermediate_size",
            qk_norm="all",
        ),
    )
}
# what other families' configs call their expert count: a model of theirs is recognised, and refused
EXPERT_COUNT_KEYS = tuple(sorted({f.experts_key for f in FAMILIES.values()} | {"n_routed_experts", "moe_num_experts"}))
# LoRA on a mixture-of-experts model adapts attention only: the experts are fused parameters, not the
# linear layers peft adapts, and vLLM's MoE LoRA is unchecked here (recipe._moe_lora)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def expert_count(config: Any) -> int:
    """Routed experts per layer of a (text) config, a config.json dict or a transformers config; 0 if none."""
    for key in EXPERT_COUNT_KEYS:
        try:
            n = int(_get(config, key) or 0)
        except (TypeError, ValueError):
            continue
        if n:
            return n
    return 0


def is_moe(config: Any) -> bool:
    """More than one routed expert per layer, by any family's key (a one-expert layer is a dense MLP)."""
    return expert_count(config) > 1


def family_of(config: Any) -> MoEFamily | None:
    """The config's family in FAMILIES; None for a dense model or a family outside the table."""
    return FAMILIES.get(str(_get(config, "model_type") or "")) if is_moe(config) else None


# --- vision-language families ---------------------------------------------------------------------
@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family: a vision tower whose merged patch features replace the prompt's image
    placeholder tokens, and multimodal rotary positions (t, h, w) over them. What a config.json gives
    (patch and merge sizes, the placeholder ids) is read from it; this row holds what it does not."""

    model_type: str  # config.json's model_type
    model_class: str  # transformers' class (AutoModelForImageTextToText's; AutoModelForCausalLM has none)
    tower: str = "model.visual."  # the vision encoder's parameters: frozen by default, not handed off then
    projector: tuple[str, ...] = ("model.visual.merger.",)  # its features -> the text embedding space
    image_token: str = "<|image_pad|>"  # one a prompt holds per image; vLLM and images.expand make it a run
    image_wrap: tuple[str, str] = ("<|vision_start|>", "<|vision_end|>")
    # what a model directory without them takes (data/images.py's Vision): the patch grid, and the
    # pixel bounds of the family's released preprocessor_config.json (min_pixels/max_pixels, or
    # size's shortest_edge/longest_edge)
    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384
    # the text-only model_type its language model is laid out as (what the memory plan counts of it:
    # Qwen2's q/k/v biases, Qwen3's q/k norms); its own text model_type names neither
    text: str = "qwen2"


VISION_FAMILIES = {
    f.model_type: f
    for f in (
        VisionFamily("qwen2_vl", "Qwen2VLForConditionalGeneration"),
        VisionFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
        VisionFamily(
            "qwen3_vl",
            "Qwen3VLForConditionalGeneration",
            projector=("model.visual.merger.", "model.visual.deepstack_merger_list."),
            patch=16,
            min_pixels=256 * 256,
            max_pixels=4096 * 4096,
            text="qwen3",
        ),
    )
}


def vision_family(config: Any) -> VisionFamily | None:
    """The vision-language family of a transformers config (or its dict), None for a text-only model."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return VISION_FAMILIES.get(model_type)
