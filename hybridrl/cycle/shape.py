"""A model's shape for the memory plan, from its config.json alone (no weights, no tokenizer).

`Shape` is what plan.py's arithmetic needs of a decoder-only model (layers, widths, heads,
vocabulary, the experts of a mixture-of-experts layer) and what each engine holds of it: the
trainer's parameters tensor by tensor, vLLM's per tensor-parallel rank. A vision-language model's
vision tower is a `Tower` beside it, counted on the family's class built on the meta device (the
one part that imports transformers, and only for such a model). `read_config` finds the
config.json of a directory, of a shipped real model (hybridrl/model_configs) or in the Hugging Face
cache; `info_of` gives the recipe's models.ModelInfo from it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from hybridrl.core import families
from hybridrl.core.config import ConfigError

# config.json of real models (no weights), for planning offline
CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"


# mixture-of-experts layouts the plan counts: core/families.py's (transformers' and vLLM's classes for them
# agree on the weights)
MOE_TYPES = tuple(families.FAMILIES)
# RMSNorms on the queries and keys: over one head (Qwen3) or over all heads (OLMo)
QK_NORM = {"qwen3": "head", "olmo2": "all", **{k: f.qk_norm for k, f in families.FAMILIES.items() if f.qk_norm}}


@dataclass(frozen=True)
class Tower:
    """A vision-language model's vision tower (VisionFamily.tower, `model.visual.*`) as the plan counts it:
    its tensors, exact (`Tower.of` builds the family's class on the meta device, so no family needs a
    formula of its own), and the largest image it sizes for, one at the family's max_pixels (the
    released preprocessor_config.json's: what vLLM's profile encodes, and the most a fitted image holds)."""

    tensors: tuple[int, ...]  # every tower tensor's elements
    projector: int  # the merger(s)' parameters (VisionFamily.projector): its features -> the text embedding
    blocks: int
    width: int  # a patch's features inside the tower
    held: int  # elements per patch one block holds (activations)
    patch_in: int  # a patch's pixel values: channels x temporal patch x patch x patch
    merge: int  # patches per image token (spatial_merge_size squared)
    outputs: int  # values per image token handed to the language model: its hidden size x the mergers
    image_tokens: int  # tokens of one image at max_pixels

    @property
    def params(self) -> int:
        return sum(self.tensors)

    def activations(self, patches: int, b: int, train: str = "off", ckpt: bool = False) -> int:
        """Bytes of the tower's forward on `patches` patches (the features it hands on are the caller's):
        the processor's float32 pixel values and their cast, and one block's working set, estimated as
        every output of its modules alive at once beside its input and the attention's output (not
        measured; attention is flash or memory-efficient, so no patch x patch scores). Frozen
        (model.train_vision off) it runs without gradients, a block at a time; a trained projector
        saves about one block's worth for its backward; a trained tower saves every block's (with
        gradient checkpointing each block's input, and one block recomputed)."""
        block = patches * self.held * b
        saved = {
            "off": 0,
            "projector": block,
            "all": patches * self.width * b * self.blocks if ckpt else block * self.blocks,
        }[train]
        return patches * self.patch_in * (4 + b) + block + saved

    @staticmethod
    def of(conf: dict) -> "Tower":
        return _tower(json.dumps(conf, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _tower(conf_json: str) -> Tower:
    """Tower.of, once per config (the plan reads a shape per decision). The tensor names are those of
    transformers' Qwen-VL classes (patch_embed, blocks.N, the family's projector prefixes)."""
    conf = json.loads(conf_json)
    family = families.vision_family(conf)
    try:
        from transformers import AutoConfig

        from hybridrl.core.models import meta_model

        model = meta_model(AutoConfig.for_model(**conf))
    except Exception as e:  # noqa: BLE001 - an unbuildable config is the plan's one line, whatever the cause
        raise ConfigError(
            f"the memory plan cannot build {family.model_class} on the meta device to count its vision tower: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    shapes = {n: p.shape for n, p in model.named_parameters() if n.startswith(family.tower)}
    embed = shapes[family.tower + "patch_embed.proj.weight"]  # [width, channels, t, patch, patch]
    width, blocks = embed[0], family.tower + "blocks."
    # a block's module outputs: each weight's first dimension (a linear's outputs, a norm's width)
    held = sum(s[0] for n, s in shapes.items() if n.startswith(blocks + "0.") and n.endswith(".weight")) + 2 * width
    v, text = conf["vision_config"], conf.get("text_config") or conf
    patch, merge = int(v.get("patch_size") or family.patch), int(v.get("spatial_merge_size") or family.merge)
    return Tower(
        tensors=tuple(s.numel() for s in shapes.values()),
        projector=sum(s.numel() for n, s in shapes.items() if n.startswith(family.projector)),
        blocks=len({n[len(blocks) :].split(".")[0] for n in shapes if n.startswith(blocks)}),
        width=width,
        held=held,
        patch_in=embed[1:].numel(),
        merge=merge**2,
        # Qwen3-VL's deepstack mergers add their features to the first layers' hidden states
        outputs=int(text["hidden_size"]) * (1 + len(v.get("deepstack_visual_indexes") or ())),
        # vLLM's profile factorises max_pixels into the most merged patches an image may have
        image_tokens=family.max_pixels // (patch * merge) ** 2,
    )


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder-only model's config.json. A mixture-of-experts layer holds
    `experts` MLPs of width `expert_intermediate` (every one counts for weights, gradients,
    optimizer states and vLLM's weights), a router (hidden x experts) and, in Qwen2-MoE, a shared
    expert; each token runs `top_k` of them (what counts for activations and compute)."""

    layers: int
    hidden: int
    intermediate: int  # the dense layers' MLP width
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False  # the LM head shares the embedding's weights
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry biases
    qk_norm: int = 0  # weights of the query and key RMSNorms in one layer (Qwen3: 2 x head_dim)
    experts: int = 0  # routed experts in each mixture-of-experts layer (0: a dense model)
    top_k: int = 0  # experts each token is routed to
    expert_intermediate: int = 0  # one expert's MLP width
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert's width (0: none)
    moe_layers: int = 0  # how many of the layers are mixture-of-experts (the rest are dense)
    vision: Tower | None = None  # a vision-language model's vision tower

    @classmethod
    def from_config(cls, conf: dict) -> "Shape":
        text = conf.get("text_config") or conf  # multimodal configs nest the language model's
        try:
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            layers = int(text["num_hidden_layers"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or hidden // heads)
            family = families.vision_family(conf)
            kind = family.text if family else text.get("model_type", "")
            experts = families.expert_count(text)
            moe: dict = {}
            if families.is_moe(text):
                fam = families.family_of(text)
                if fam is None:
                    raise ConfigError(
                        f"the memory plan does not know the experts of model_type {kind!r} (it counts "
                        f"{', '.join(MOE_TYPES)})"
                    )
                step = int(text.get("decoder_sparse_step") or 1)
                dense = {int(i) for i in text.get("mlp_only_layers") or ()}
                moe = dict(
                    experts=experts,
                    top_k=int(text["num_experts_per_tok"]),
                    expert_intermediate=int(text.get(fam.expert_width_key) or text["intermediate_size"]),
                    shared_intermediate=int(fam.shared_expert and text.get("shared_expert_intermediate_size") or 0),
                    moe_layers=sum(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                )
            norm = QK_NORM.get(kind)
            qk_norm = 2 * head_dim if norm == "head" else (heads + kv_heads) * head_dim if norm == "all" else 0
            return cls(
                layers=layers,
                hidden=hidden,
                intermediate=int(text.get("intermediate_size") or 4 * hidden),
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                vocab=int(text["vocab_size"]),
                tied=bool(conf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                qkv_bias=bool(text.get("attention_bias", text.get("qkv_bias", kind in ("qwen2", "qwen2_moe")))),
                qk_norm=qk_norm,
                vision=Tower.of(conf) if family else None,
                **moe,
            )
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"the model's config.json has no usable {e} for the memory plan") from None

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def _attention_params(self) -> int:
        h, kv, q = self.hidden, self.kv_dim, self.q_dim
        return h * q + 2 * h * kv + q * h + (q + 2 * kv) * self.qkv_bias + self.qk_norm + 2 * h  # + two RMSNorms

    def _moe_mlp_params(self, experts: int) -> int:
        """A mixture-of-experts MLP with `experts` of its experts: those experts, the router, the shared expert
        and its one-output gate."""
        h = self.hidden
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return experts * 3 * h * self.expert_intermediate + self.experts * h + shared

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (a mixture-of-experts layer, all its experts, where there is one):
        what ZeRO-3 gathers and the backward's weight gradients of a layer hold."""
        mlp = self._moe_mlp_params(self.experts) if self.moe_layers else 3 * self.hidden * self.intermediate
        return self._attention_params() + mlp

    @property
    def vision_params(self) -> int:
        return self.vision.params if self.vision else 0

    def _params(self, experts: int) -> int:
        embed = self.vocab * self.hidden
        dense = self.layers - self.moe_layers
        body = self.layers * self._attention_params() + dense * 3 * self.hidden * self.intermediate
        return embed * (1 if self.tied else 2) + body + self.moe_layers * self._moe_mlp_params(experts) + self.hidden

    @property
    def params(self) -> int:
        """Every parameter, every expert and the vision tower included: weights, gradients, optimizer
        states, vLLM's weights."""
        return self._params(self.experts) + self.vision_params

    def vllm_rank_params(self, tp: int) -> int:
        """The parameters one rank of a vLLM engine of tensor-parallel size `tp` holds, as vLLM lays them
        out: q, o, the MLPs, the embedding and the LM head split over the ranks, every expert split on its
        MLP width (vLLM's default for these MoE families: expert parallelism off; with it, whole experts
        per rank hold as much); the key/value heads split while there are as many as ranks, else one
        per rank (replicated); the norms, the router and the shared expert's gate whole on every rank;
        a vision tower split over the ranks (vLLM's mm_encoder_tp_mode "weights", its default: its few
        MiB of norms and patch embedding counted split too). tp = 1: `params`."""
        h, m, e, s = self.hidden, self.intermediate, self.expert_intermediate, self.shared_intermediate
        q, kv = self.q_dim // tp, self.head_dim * max(1, self.kv_heads // tp)
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv) * self.qkv_bias + self.qk_norm + 2 * h
        moe = self.experts * 3 * h * e // tp + self.experts * h + (3 * h * s // tp + h if s else 0)
        dense = self.layers - self.moe_layers
        body = self.layers * attn + dense * 3 * h * m // tp + self.moe_layers * moe
        return self.vocab * h // tp * (1 if self.tied else 2) + body + h + self.vision_params // tp

    @property
    def active_params(self) -> int:
        """The parameters one token runs through (top_k experts of each mixture-of-experts layer, the router,
        the shared expert): what sets the compute per token. A dense model's are all of them, less its
        vision tower (which runs on an image's patches, not on its tokens)."""
        return self._params(self.top_k)

    @property
    def mlp_width(self) -> int:
        """The MLP width one token runs through in the widest layer (top_k experts and the shared expert)."""
        if not self.moe_layers:
            return self.intermediate
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """An adapter of rank r on each targeted projection: r x (inputs + outputs). MLP targets count
        the dense layers' MLPs and Qwen2-MoE's shared expert, not the routed experts (PEFT 0.21 can wrap
        their fused parameters; whether hybridrl's LoRA does is the MoE hand-off's to say): a
        small undercount of the adapter's gradients and Adam states, never of the frozen weights."""
        h, kv, q = self.hidden, self.kv_dim, self.q_dim
        attn = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
        mlp = {"gate_proj": 1, "up_proj": 1, "down_proj": 1}
        widths = (self.layers - self.moe_layers) * (h + self.intermediate) + self.moe_layers * (
            h + self.shared_intermediate
        ) * bool(self.shared_intermediate)
        names = [t.split(".")[-1] for t in targets]
        return rank * (self.layers * sum(attn.get(n, 0) for n in names) + widths * sum(n in mlp for n in names))

    def layer_activations(self, b: int, moe: bool | None = None) -> int:
        """Bytes autograd saves per token in one decoder layer (module docstring); the widest layer
        unless `moe` says which kind. A mixture-of-experts layer saves, for each of the token's top_k
        experts, the MLP's four widths, the token's gathered input and the expert's output (2 b
        hidden) and a few int64 indices, and the router's float32 probabilities (4 x experts);
        q/k norms (Qwen3, OLMoE) save their float32 input and their output. Counted on transformers
        5's Qwen3, Qwen3-MoE and Qwen2-MoE (grouped_mm experts, sdpa): within 1% per layer."""
        moe = bool(self.moe_layers) if moe is None else moe
        # the query-wide two (rotated queries, attention output) equal hidden-wide ones where heads x head_dim
        # == hidden (Qwen2, Llama), not in Qwen3
        common = (
            (4 * b + 8) * self.hidden
            + 2 * b * (self.q_dim + self.kv_dim)
            + (4 + b) * (self.q_dim + self.kv_dim) * bool(self.qk_norm)
        )
        if not moe:
            return common + 4 * b * self.intermediate
        shared = (4 * b * self.shared_intermediate + b * self.hidden) if self.shared_intermediate else 0
        return (
            common
            + self.top_k * (4 * b * self.expert_intermediate + 2 * b * self.hidden + 32)
            + 4 * self.experts
            + shared
        )

    def all_layer_activations(self, b: int) -> int:
        """layer_activations summed over the layers, dense and mixture-of-experts."""
        dense = self.layers - self.moe_layers
        return dense * self.layer_activations(b, False) + self.moe_layers * self.layer_activations(b, True)

    def describe(self) -> str:
        """'30.53B parameters, 3.35B active with 8 of 128 experts per token', or the count for a dense model."""

        def count(n: int) -> str:
            return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

        moe = (
            f", {count(self.active_params)} active with {self.top_k} of {self.experts} experts per token"
            if self.moe_layers
            else ""
        )
        tower = f", {count(self.vision_params)} of them the vision tower" if self.vision else ""
        return f"{count(self.params)} parameters" + moe + tower

    def tensors(self, fused: bool = False) -> list[int]:
        """Every parameter tensor's elements (they sum to `params`), as transformers holds them, or
        `fused` as vLLM does (q/k/v in one, gate/up in one; a vision tower's as transformers holds
        them either way): what is pinned tensor by tensor."""
        h, kv, q, m = self.hidden, self.kv_dim, self.q_dim, self.intermediate
        attn = [h * (q + 2 * kv)] if fused else [h * q, h * kv, h * kv]
        bias = ([q + 2 * kv] if fused else [q, kv, kv]) if self.qkv_bias else []
        mlp = [2 * h * m, m * h] if fused else [h * m, h * m, m * h]
        norms = ([q, kv] if self.qk_norm == q + kv else [self.qk_norm // 2] * 2) if self.qk_norm else []
        layer = attn + bias + norms + [q * h] + [h, h]
        # experts are held as two stacked tensors a layer on both sides (transformers' gate_up and
        # down projections, vLLM's w13 and w2), beside the router and the shared expert with its gate
        e, s = self.expert_intermediate, self.shared_intermediate
        shared = ([2 * h * s, s * h] if fused else [h * s, h * s, s * h]) + [h] if s else []
        moe = [self.experts * 2 * e * h, self.experts * h * e, self.experts * h] + shared
        body = (layer + moe) * self.moe_layers + (layer + mlp) * (self.layers - self.moe_layers)
        tower = list(self.vision.tensors) if self.vision else []
        return [self.vocab * h] + body + [h] + ([] if self.tied else [self.vocab * h]) + tower


def read_config(path: str) -> dict:
    """config.json of a model directory, of a shipped real model (by hub name, case-insensitive,
    base and -Instruct alike), or from the Hugging Face cache (or hub) as transformers would."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return json.loads((p / "config.json").read_text())
    if p.is_file() and p.suffix == ".json":
        return json.loads(p.read_text())
    shipped = shipped_config(path)
    if shipped is not None:
        return json.loads(shipped.read_text())
    if path == "demo":
        from hybridrl.core.models import DEMO

        return json.loads((DEMO / "config.json").read_text())
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(path, "config.json")).read_text())
    except Exception as e:  # noqa: BLE001 - any failure to find it is the same one line
        names = ", ".join(sorted(c.stem for c in CONFIGS.glob("*.json")))
        raise ConfigError(
            f"model {path!r}: no config.json found (not a directory, not shipped, and not in the "
            f"Hugging Face cache: {str(e).splitlines()[0] if str(e) else type(e).__name__}); pass a "
            f"directory or config.json, or one of the shipped configs: {names}"
        ) from None


def shipped_config(name: str) -> Path | None:
    key = name.lower().rstrip("/").split("/")[-1].removesuffix("-instruct").removeprefix("meta-")
    hit = CONFIGS / f"{key}.json"
    return hit if hit.is_file() else None


def info_of(name: str, conf: dict, shape: Shape):
    """models.ModelInfo from config.json alone (no tokenizer, no weights): what the recipe reads."""
    from hybridrl.core.models import ModelInfo

    text = conf.get("text_config") or conf
    archs = conf.get("architectures") or ["?"]
    return ModelInfo(
        name=name,
        path=name,
        arch=archs[0],
        params=shape.params,
        vocab=shape.vocab,
        max_positions=int(text.get("max_position_embeddings") or 0),
        kv_values_per_token=2 * shape.layers * shape.kv_dim,
        attn_heads=shape.layers * shape.heads,
    )
