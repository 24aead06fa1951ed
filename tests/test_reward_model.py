"""Neural reward models (`rm:PATH` terms of reward.fn): a tiny random Qwen2ForSequenceClassification
with the demo's tokenizer, built here. Its scores in padded batches equal transformers' own forward
on each text alone; the spec parses; a bad model is refused in one line; and a run with the real
engines combines it with the rule-based verifier by weight (reward == arithmetic + 0.5 * rm)."""

import math
import shutil

import pytest
import torch
import transformers

from hybridrl.core import config, memory
from hybridrl.core.config import ConfigError, RewardConfig
from hybridrl.core.memory import GIB
from hybridrl.data.rewards import Scorer, load_terms, model_terms, parse_spec
from hybridrl.data.tasks.arithmetic import DEMO_MODEL_DIR
from hybridrl.engines.reward_model import RewardModel, load_all

from helpers.cli import train_cli


def make_rm(path, num_labels=1):
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id,
    )
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.fast
def test_scores_match_transformers_forward(tmp_path):
    path = make_rm(tmp_path / "rm")
    rm = RewardModel(path, device=torch.device("cpu"), dtype=torch.float32, batch_size=3)
    prompts = ["12+34=", "1+1=", "49+49=", "7+8=", "3+30="]
    completions = ["46", "2", "98", "1", "33<eos>"]  # lengths differ: every batch is padded
    got = rm.score(prompts, completions)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = [float(model(**tok(p + c, return_tensors="pt")).logits[0, 0]) for p, c in zip(prompts, completions)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == len(got)  # a random model tells the texts apart


@pytest.mark.fast
def test_the_memory_plan_keeps_room_for_reward_models(tmp_path):
    """An RM is copied to the device while vLLM is awake (it scores before vLLM sleeps): the plan
    counts its bytes beside the margin: every parameter and buffer, as they are held."""
    path = make_rm(tmp_path / "rm")
    cfg = config.load(None, {"reward.fn": f"arithmetic,rm:{path}:0.5", "model.dtype": "bfloat16"})
    ((name, weight, rm),) = load_all(cfg, torch.device("cpu"))
    assert name == f"rm:{path}" and weight == 0.5
    params = sum(t.numel() for t in rm.model.parameters())
    buffers = sum(t.numel() * t.element_size() for t in rm.model.buffers())  # rotary's inv_freq stays float32
    assert rm.model.dtype == torch.bfloat16 and rm.nbytes == 2 * params + buffers and 0 < buffers <= 64
    # 80 GiB device, 70 free with the trainer's states on it, 76 offloaded; margin 2, weights 14,
    # KV 20 -> activations 2.4: 36.4 + 2 <= 70 keeps the states; 36.4 + 2 + 32 (an RM) > 70 does not
    base = dict(margin=2 * GIB, weights=14 * GIB, need=20 * GIB)
    assert not memory.plan(80 * GIB, 70 * GIB, 76 * GIB, **base).offload
    p = memory.plan(80 * GIB, 70 * GIB, 76 * GIB, **base, visitors=32 * GIB)
    assert p.offload and p.kv == 20 * GIB and p.visitors == 32 * GIB
    assert "reward models 32.00 GiB" in p.describe()
    # offloaded, the KV cache gives way: 76 - 2 - 40 - 14 - 2.4 = 17.6 GiB left for it
    p = memory.plan(80 * GIB, 70 * GIB, 76 * GIB, **base, visitors=40 * GIB)
    assert p.kv == 76 * GIB - 2 * GIB - 40 * GIB - 14 * GIB - (GIB + 14 * GIB // 10)
    with pytest.raises(ConfigError, match="and 58.00 GiB of reward models"):
        memory.plan(80 * GIB, 70 * GIB, 76 * GIB, **base, visitors=58 * GIB)


@pytest.mark.fast
def test_spec_and_bad_models(tmp_path):
    spec = "arithmetic:1.0,rm:/models/my-rm:0.5,rm:other"
    assert parse_spec(spec)[1:] == [("rm:/models/my-rm", 0.5), ("rm:other", 1.0)]
    assert model_terms(spec) == [("/models/my-rm", 0.5), ("other", 1.0)]
    assert [t.name for t in load_terms(spec)] == ["arithmetic"]  # the Scorer never calls a model
    scorer = Scorer(RewardConfig(fn="rm:/nowhere"))
    assert scorer.score(["1+1="], ["2"], ["2"]) == [0.0] and scorer.workers == 0  # no rule terms: 0
    with pytest.raises(ConfigError, match="neither a built-in"):
        parse_spec("rm:")
    with pytest.raises(ConfigError) as e:
        RewardModel(str(tmp_path / "missing"), device=torch.device("cpu"), dtype=torch.float32, batch_size=2)
    assert "cannot load a sequence-classification model" in str(e.value) and "\n" not in str(e.value)
    two = make_rm(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=2; a reward model has one output"):
        RewardModel(two, device=torch.device("cpu"), dtype=torch.float32, batch_size=2)


def test_reward_model_term_with_the_real_engines(tmp_path):
    """3 steps: the verifier plus 0.5 x the RM; also GSPO with masked IS and two minibatches."""
    path = make_rm(tmp_path / "rm")
    name = f"reward/rm:{path}"
    out, steps, _ = train_cli(
        tmp_path / "run",
        "--reward",
        f"arithmetic:1.0,rm:{path}:0.5",
        "--algo.policy_loss",
        "gspo",
        "--algo.is_correction",
        "mask",
        "--train.minibatches",
        "2",
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert math.isfinite(s[name]) and s[name] != 0.0
        assert s["reward"] == pytest.approx(s["reward/arithmetic"] + 0.5 * s[name], abs=1e-6)
        assert s["time/reward_model"] > 0
        assert s["is/masked_frac"] == 0.0  # float32: vLLM and the trainer agree to ~1e-5
        assert math.isfinite(s["loss"]) and s["probe_gap"] <= 1e-4
    shutil.rmtree(path)
