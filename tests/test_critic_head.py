"""`algo.critic_path` with a trained head: the critic's value head starts from a reward model's
one-output head (transformers' `score`, OpenRLHF's `value_head`, TRL's `v_head.summary`), so its
first values are that model's per-token scores; a model without one starts at zero; a head with
several outputs, an unreadable one, or a vocabulary smaller than the policy's is refused at start.
Real DeepSpeed engines on the demo's shapes."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridrl
from hybridrl.core import config
from hybridrl.core.config import ConfigError
from hybridrl.data.batch import Batch

from helpers.cli import export_cli, train_cli

DEMO = str(Path(hybridrl.__file__).parent / "demo_model")


def reward_model(path: Path, num_labels: int = 1, vocab: int | None = None, seed: int = 0):
    """A sequence-classification model of the demo's shape, random weights and head, saved to `path`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    conf = AutoConfig.from_pretrained(DEMO, num_labels=num_labels)
    conf.vocab_size = vocab or conf.vocab_size
    torch.manual_seed(seed)
    rm = AutoModelForSequenceClassification.from_config(conf)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.save_pretrained(path)
    return rm.eval()


def critic_of(path: str, zero: int = 2):
    from hybridrl.engines.critic import Critic

    cfg = config.load(None, {"algo.advantage": "gae", "algo.critic_path": path, "train.zero_stage": zero})
    return Critic(cfg, DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")


def batch() -> Batch:
    return Batch.from_rows([[1, 5, 6, 7], [1, 8, 9]], [[10, 11, 2], [12, 2]], [[-1.0] * 3, [-1.0] * 2], [1.0, -1.0])


@pytest.mark.parametrize("zero", [2, 3])
def test_value_head_starts_from_a_reward_models_score(tmp_path, world_of_one, zero):
    rm = reward_model(tmp_path / "rm")
    critic = critic_of(str(tmp_path / "rm"), zero)
    b = batch()
    values = critic.values(b)  # [B, T]
    # the reward model's score of the state that predicts each completion token (position t - 1)
    with torch.no_grad():
        hidden = rm.model(input_ids=b.tokens, attention_mask=b.attention_mask()).last_hidden_state
        scores = rm.score(hidden).squeeze(-1)  # [B, T]
    expected = scores[:, :-1][b.loss_mask[:, 1:]]
    assert expected.abs().min() > 1e-3  # not the zero head's values
    torch.testing.assert_close(values[b.loss_mask], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("name", ["value_head", "v_head.summary"])
def test_other_trainers_head_names_and_bias(tmp_path, name):
    """OpenRLHF's reward model and critic save `value_head.weight`, TRL's value-head model
    `v_head.summary.weight` and `.bias`: read as the head, the bias kept (zero where absent)."""
    from hybridrl.engines.critic import trained_head

    reward_model(tmp_path / "rm")
    tensors = load_file(tmp_path / "rm" / "model.safetensors")
    weight = tensors.pop("score.weight")
    tensors[f"{name}.weight"] = weight
    if name == "v_head.summary":
        tensors[f"{name}.bias"] = torch.tensor([0.25])
    save_file(tensors, tmp_path / "rm" / "model.safetensors", metadata={"format": "pt"})
    head = trained_head(str(tmp_path / "rm"), weight.shape[1])
    assert torch.equal(head["weight"], weight)
    assert head["bias"].item() == (0.25 if name == "v_head.summary" else 0.0)


def test_a_causal_lm_gives_the_zero_head(world_of_one):
    from hybridrl.engines.critic import trained_head

    assert trained_head(DEMO, 128) is None
    values = critic_of(DEMO).values(batch())
    assert torch.count_nonzero(values) == 0


@pytest.mark.fast
def test_bad_heads_and_vocabularies_refused(tmp_path, world_of_one):
    from hybridrl.engines.critic import trained_head

    reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match=r"has shape \(2, 128\).*num_labels=1"):
        trained_head(str(tmp_path / "two"), 128)
    reward_model(tmp_path / "bin")  # a classification model whose safetensors lack the head
    tensors = load_file(tmp_path / "bin" / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, tmp_path / "bin" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="safe_serialization=True"):
        trained_head(str(tmp_path / "bin"), 128, ["Qwen2ForSequenceClassification"])
    reward_model(tmp_path / "small", vocab=10)  # the demo's vocabulary has 15 tokens
    with pytest.raises(ConfigError, match="embeds 10 tokens, the policy's vocabulary has 15"):
        critic_of(str(tmp_path / "small"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-step PPO run of the demo and its critic exported (before any test sets up a world in
    this process: the CLI's ranks would take its address)."""
    tmp = tmp_path_factory.mktemp("critic")
    train_cli(
        tmp / "run", "--algo.advantage", "gae", "--steps", "2", "--train.minibatches", "1", "--algo.critic_lr", "1e-2"
    )  # a large step: the head and the base move visibly
    assert "wrote the critic to" in export_cli(tmp / "run", tmp / "critic", "--critic").stdout
    return tmp


def test_exported_critic_is_its_values_and_starts_the_next_run(exported, world_of_one):
    """`hybridrl export RUN OUT --critic`: a token-classification model whose logits are the trained
    critic's values (its DeepSpeed module state in the checkpoint, read without hybridrl), and
    `--algo.critic_path OUT` starts a critic with those same values."""
    import torch.nn.functional as F
    from transformers import AutoModel, AutoModelForTokenClassification

    run, out = exported / "run", exported / "critic"
    module = torch.load(run / "checkpoints" / "step-2" / "critic" / "mp_rank_00_model_states.pt", weights_only=False)[
        "module"
    ]  # the critic as DeepSpeed saved it
    assert module["head.weight"].abs().max() > 1e-3  # trained: no longer the zero head
    b = batch()
    base = AutoModel.from_pretrained(DEMO).eval()
    base.load_state_dict({k.removeprefix("base."): v for k, v in module.items() if k.startswith("base.")})
    with torch.no_grad():
        hidden = base(input_ids=b.tokens, attention_mask=b.attention_mask()).last_hidden_state
        want = F.linear(hidden, module["head.weight"], module["head.bias"]).squeeze(-1)[:, :-1][b.loss_mask[:, 1:]]
        got = (
            AutoModelForTokenClassification.from_pretrained(out)
            .eval()(input_ids=b.tokens, attention_mask=b.attention_mask())
            .logits.squeeze(-1)[:, :-1][b.loss_mask[:, 1:]]
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(critic_of(str(out)).values(b)[b.loss_mask], want, rtol=1e-5, atol=1e-5)


def test_export_refuses_critic_with_merged(exported, tmp_path):
    res = export_cli(exported / "run", tmp_path / "x", "--critic", "--merged", ok=False)
    assert res.returncode != 0 and "give one of them" in res.stderr + res.stdout
