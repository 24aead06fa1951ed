"""The context a run plans for is its data's: rollout.max_model_len at the longest prompt (training
and held-out, as encoded) + rollout.max_new_tokens, not data.max_prompt_len's cap, so the CPU KV
cache and the memory plan count the prompts the run has; a micro-batch is never planned larger than
the rank's whole step; `hybridrl plan --cpu` plans a CPU run as `hybridrl train` starts it."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridrl.core import config as C, models, recipe
from hybridrl.cycle import plan
from hybridrl.run import resolve

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    for name, n in (("train", 40), ("heldout", 8)):
        rows = [
            {"messages": [{"role": "user", "content": f"what is {i} + {i + 3}?"}], "answer": str(2 * i + 3)}
            for i in range(n)
        ]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "train.jsonl", d / "heldout.jsonl"


def over(tiny, chat_data, **more) -> dict:
    return {
        "model.path": str(tiny),
        "data.path": str(chat_data[0]),
        "data.heldout_path": str(chat_data[1]),
        "rollout.max_new_tokens": 16,
        "train.prompts_per_step": 8,
        "rollout.n": 8,
        **more,
    }


@pytest.mark.fast
def test_a_run_plans_its_context_at_the_datas_longest_prompt(tiny, chat_data, monkeypatch):
    """A chat set of ~20-token prompts under the 512-token cap: before, the context was 512 + 16 and the
    CPU KV cache sized for it; now the longest prompt + 16, the source naming it."""
    import torch

    monkeypatch.setattr(recipe, "_free_ram", lambda: 8 << 30)
    world = SimpleNamespace(device=torch.device("cpu"), size=1, main=True)
    res = resolve.run_config(C.load(None, over(tiny, chat_data)), world)
    longest = max(len(p.ids) for p in res.prompts + res.heldout)
    assert 10 < longest < 40
    r = res.cfg.rollout
    assert (
        r.max_model_len == longest + 16
        and res.cfg.sources["rollout.max_model_len"] == f"the data's longest prompt, {longest} tokens"
    )
    # the prompt cap follows (a saved config stays valid: cap + answer fit the context); the KV cache is
    # resized for the context (here at its 64 MiB floor)
    assert res.cfg.data.max_prompt_len == longest
    assert (
        res.cfg.sources["data.max_prompt_len"]
        == res.cfg.sources["rollout.kv_cache_mb"]
        == f"the data's longest prompt, {longest} tokens"
    )
    C.validate(C.load(None, C.flatten(C.to_dict(res.cfg))))  # as `hybridrl eval` reloads config.yaml
    assert res.chat == {"data.chat_template": ("on", "auto, the tokenizer has a chat template")}


@pytest.mark.fast
def test_what_the_data_does_not_decide_is_left_alone(tiny):
    info = models.inspect(str(tiny))

    def fitted(**sets):
        cfg = recipe.resolve(
            C.load(None, {"model.path": str(tiny), "rollout.max_new_tokens": 16, **sets}),
            info,
            on_cpu=True,
            free_ram=8 << 30,
        )
        return recipe.fit_to_data(cfg, info, 30, on_cpu=True, free_ram=8 << 30).rollout.max_model_len

    assert fitted() == 46
    assert fitted(**{"rollout.max_model_len": 600}) == 600  # the user's
    assert fitted(**{"env.cls": "hybridrl.data.envs:ToolEnv"}) == 512 + 16  # multi-turn prompts grow by turns
    assert fitted(**{"data.max_prompt_len": 100}) == 116  # a cap the user set: its context, as before
    demo = recipe.resolve(C.load(), models.inspect("demo"), on_cpu=True, free_ram=8 << 30)
    assert recipe.fit_to_data(demo, models.inspect("demo"), 3, on_cpu=True) is demo


@pytest.mark.fast
def test_a_micro_batch_is_planned_no_larger_than_the_ranks_step():
    """8 prompts x 8 samples of at most 62 tokens are 3,968 tokens: the plan counted the activations
    of an 8,192-token micro-batch (train.max_tokens_per_micro_batch) the step never fills."""
    shape = plan.Shape.from_config(
        json.loads((HERE.parent / "hybridrl" / "model_configs" / "qwen2.5-0.5b.json").read_text())
    )
    cfg = C.load(
        None,
        {
            "model.path": "x",
            "train.prompts_per_step": 8,
            "rollout.n": 8,
            "rollout.max_model_len": 62,
            "model.dtype": "bfloat16",
        },
    )
    assert plan.knobs(cfg, shape, world=1, local=1, on_cpu=True).mb_tokens == 3968
    assert plan.knobs(cfg, shape, world=2, local=2, on_cpu=True).mb_tokens == 1984  # each rank's half
    big = C.load(None, {"model.path": "x", "rollout.max_model_len": 1536, "model.dtype": "bfloat16"})
    assert plan.knobs(big, shape, world=8, local=8, on_cpu=False).mb_tokens == 8192  # 8 x 8 x 1536: the budget


def test_plan_command_plans_a_cpu_run_from_the_data(tiny, chat_data):  # a subprocess: the default tier
    import subprocess

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl",
            "plan",
            "--cpu",
            "--host-mem-gib",
            "16",
            *sum((["--set", f"{k}={v}"] for k, v in over(tiny, chat_data).items()), []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout
    assert res.returncode == 0, res.stderr[-2000:]
    assert "memory plan per host (shared by the node's ranks): 16.0 GiB" in out, out
    assert "the data's longest prompt" in out and "vLLM KV cache" in out


def test_a_probe_of_the_longest_prompt_and_a_full_answer_trains(tmp_path):
    """The demo model given as a path, so the run's context is fitted to the data (the longest prompt
    + rollout.max_new_tokens), and a first row of the longest prompt whose answer is longer than
    max_new_tokens: its probe sequence was exactly max_model_len tokens, which vLLM refuses (it scores
    a sequence as a prompt asking for one token more), and the run died at step 0 with a traceback."""
    from hybridrl.data.tasks import arithmetic

    from helpers.cli import train_cli

    rows = [{"prompt": "123456+654321=", "answer": "777777"}] + [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 34), (5, 7), (40, 2), (9, 9), (31, 3))
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, steps, _ = train_cli(
        tmp_path / "run",
        "--model",
        str(arithmetic.DEMO_MODEL_DIR),
        "--data",
        str(data),
        "--reward",
        "arithmetic",
        "--rollout.max_new_tokens",
        "4",
        "--steps",
        "1",
        "--train.prompts_per_step",
        "4",
    )
    assert "rollout.max_model_len" in out.stdout  # the recipe fitted it to the data
    assert [s["step"] for s in steps] == [1] and steps[0]["probe_gap"] <= 1e-4
