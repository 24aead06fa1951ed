"""The memory plan of a vision-language model (cycle/shape.py's Tower, cycle/plan.py): the shipped
Qwen2.5-VL-7B and Qwen3-VL-8B configs counted exactly against transformers' classes on the meta
device, and a plan larger than its text model's by the tower's terms and nothing else. Pure
arithmetic on config.json (and a meta-device build): no engine starts here."""

import dataclasses

import pytest

from hybridrl.core import config, models
from hybridrl.cycle import plan
from hybridrl.cycle.shape import Shape, read_config, shipped_config

from helpers.plan import shape

pytestmark = pytest.mark.fast

# the hub name -> (tower, projector, every parameter): counted on transformers' class on the meta device
# (docs/design/vision.md section 6); the totals are the released checkpoints'
VLMS = {
    "Qwen/Qwen2.5-VL-7B-Instruct": (676_550_144, 44_574_464, 8_292_166_656),
    "Qwen/Qwen3-VL-8B-Instruct": (576_388_336, 160_496_896, 8_767_123_696),
}
TEXT = {"Qwen/Qwen2.5-VL-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct": "Qwen/Qwen3-8B"}


@pytest.mark.parametrize("name", VLMS)
def test_the_shipped_vlm_configs_count_as_transformers_builds_them(name):
    """Tower and projector exact, every tensor of the model (text and vision) as transformers holds it,
    the head untied as in the text model, and one image at max_pixels 16384 tokens of 4 patches."""
    from transformers import AutoConfig

    assert shipped_config(name).name == name.split("/")[1].lower().removesuffix("-instruct") + ".json"
    conf = read_config(name)
    s = Shape.from_config(conf)
    tower, projector, total = VLMS[name]
    assert (s.vision.params, s.vision.projector, s.params) == (tower, projector, total)
    model = models.meta_model(AutoConfig.for_model(**conf))
    assert sorted(s.tensors()) == sorted(p.numel() for p in model.parameters())
    assert sum(s.tensors(fused=True)) == s.vllm_rank_params(1) == total and not s.tied
    assert (s.vision.image_tokens, s.vision.merge) == (16384, 4)
    # the language model is the text model's, shape for shape
    assert dataclasses.replace(s, vision=None) == shape(TEXT[name])
    assert s.describe().endswith("of them the vision tower") and f"{tower / 1e6:.2f}M" in s.describe()


def test_a_block_of_qwen25_vl_by_hand():
    """Qwen2.5-VL's block (width 1280, gated MLP 3420): its module outputs, norm1 + qkv + proj + norm2
    + gate + up + down, beside its input and the attention's output; a patch's pixels 3 x 2 x 14 x 14;
    Qwen3-VL's deepstack hands the language model four features per image token (merger + 3)."""
    v = shape("Qwen/Qwen2.5-VL-7B-Instruct").vision
    assert (v.blocks, v.width, v.patch_in, v.outputs) == (32, 1280, 1176, 3584)
    assert v.held == 1280 + 3 * 1280 + 1280 + 1280 + 2 * 3420 + 1280 + 2 * 1280 == 18360
    assert v.activations(100, 2) == 100 * 1176 * 6 + 100 * 18360 * 2
    assert v.activations(100, 2, "all", ckpt=True) == v.activations(100, 2) + 100 * 1280 * 2 * 32
    assert shape("Qwen/Qwen3-VL-8B-Instruct").vision.outputs == 4 * 4096


def test_count_params_builds_the_vision_family_class():
    """models.inspect's count (the recipe's printed size): AutoModelForCausalLM maps no Qwen-VL type, so it
    counted 0; the family's class counts the whole model."""
    from transformers import AutoConfig

    conf = AutoConfig.for_model(**read_config("Qwen/Qwen2.5-VL-7B-Instruct"))
    assert models._count_params(conf, False) == (8_292_166_656, True)


@pytest.mark.parametrize("name", VLMS)
@pytest.mark.parametrize("train", ["off", "projector", "all"])
def test_a_vlm_plans_larger_than_its_text_model_by_the_tower(name, train):
    """The recipe's settings, one plan for the model and one for its language model alone: vLLM's and
    the trainer's weights differ by the tower; gradients and Adam by the part model.train_vision trains;
    the trainer's activations by the tower's forward on a micro-batch of image tokens and their features;
    vLLM's by its encoder profile (16384 image tokens) and cache. Nothing else differs."""
    s = shape(name)
    text = dataclasses.replace(s, vision=None)
    recipe = f"examples/recipes/{name.split('/')[1].lower().removesuffix('-instruct')}-8xh100.yaml"
    cfg, p, _ = plan.dry_run(
        config.load(recipe, {"model.train_vision": train}),
        nproc=8,
        nnodes=1,
        gpu_gib=plan.DEFAULT_GPU_GIB,
        host_gib=plan.DEFAULT_HOST_GIB,
    )
    k, v, b, N = p.knobs, s.vision, 2, 8
    assert k.trained == text.params + {"off": 0, "projector": v.projector, "all": v.params}[train]
    assert k.images == 16 * 8 * 2048  # a rank's 128 rows x data.max_prompt_len (2 images of 16384 tokens fill it)
    ours = plan.build(s, k, device=p.device, host=p.host).rows
    theirs = plan.build(text, dataclasses.replace(k, trained=text.params), device=p.device, host=p.host).rows
    img = min(k.mb_tokens, k.images)  # every token of the micro-batch an image token, at most
    enc = max(plan.BATCHED_TOKENS, v.image_tokens)
    extra = {
        "vLLM weights": v.params * b,
        "trainer params": v.params * b,  # ZeRO-2: whole on every rank
        "trainer grads": (k.trained // N - text.params // N) * b,
        "fp32 master + Adam": 12 * k.trained // N - 12 * text.params // N,
        "activations": v.activations(img * v.merge, b, train, k.ckpt) + img * v.outputs * b,
        "vLLM activations": v.activations(enc * v.merge, b) + enc * v.outputs * b,
    }
    assert k.zero == 2 and set(ours) == set(theirs)
    for row in set(ours) - {"vLLM KV cache"}:  # the cache is what the GPU has left: smaller by the tower's terms
        assert max(ours[row].values()) - max(theirs[row].values()) == extra.get(row, 0), row


def test_model_train_vision_refuses_a_bad_value_in_one_line():
    with pytest.raises(config.ConfigError, match=r"^model.train_vision='encoder': must be one of off, projector, all$"):
        config.load(None, {"model.train_vision": "encoder"})
