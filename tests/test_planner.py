"""The GPU memory planner on CPU, with the device's free memory given: its arithmetic
(memory.plan: the KV cache, activations and vLLM's sampler against what is free with the trainer's
states on the device and off it), the step's KV need and sequence count, and the caller that fills
the auto knobs (engine_cycle.plan_rollout)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridrl.core import config, memory
from hybridrl.core.config import ConfigError
from hybridrl.cycle import engine_cycle
from hybridrl.engines.seams import Engines

from helpers.memory import FakeTrainer  # records the planner's offload and reload calls

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

GIB = 1 << 30


def test_plan_arithmetic():
    # 80 GiB device; 70 GiB free with the trainer's states on it, 76 GiB once they leave; margin 2,
    # weights 1, the step's KV cache 2: activations 1 + 0.1 = 1.1; 1 + 2 + 1.1 = 4.1 <= 70 - 2, so
    # the states stay (no offload every step) and vLLM gets exactly 4.1 GiB = 0.05125 of the device
    p = memory.plan(80 * GIB, 70 * GIB, 76 * GIB, margin=2 * GIB, weights=1 * GIB, need=2 * GIB)
    assert not p.offload and p.kv == 2 * GIB and p.activations == GIB + GIB // 10
    assert p.budget == 4 * GIB + GIB // 10 and p.utilization == pytest.approx(4.1 / 80)
    assert "with the trainer's states kept on it 70.0 GiB" in p.describe() and "KV cache 2.00 GiB" in p.describe()
    # the same with offload forced on: measured after offloading, same budget
    p = memory.plan(80 * GIB, 0, 76 * GIB, margin=2 * GIB, weights=1 * GIB, need=2 * GIB, offload="on")
    assert p.offload and p.free == 76 * GIB and p.kv == 2 * GIB
    # 14 GiB of weights (7B bf16), a 20 GiB KV cache: activations 2.4; 36.4 > 10 - 2 with the
    # states on the device, <= 60 - 2 without: the states must leave
    p = memory.plan(80 * GIB, 10 * GIB, 60 * GIB, margin=2 * GIB, weights=14 * GIB, need=20 * GIB)
    assert p.offload and p.kv == 20 * GIB
    # only 20 GiB free even offloaded: the KV cache shrinks to 20 - 2 - 14 - 2.4 = 1.6 GiB and says so
    p = memory.plan(80 * GIB, 10 * GIB, 20 * GIB, margin=2 * GIB, weights=14 * GIB, need=20 * GIB)
    assert p.offload and p.kv == 20 * GIB - 2 * GIB - 14 * GIB - (GIB + 14 * GIB // 10)
    assert "less than the 20.00 GiB the step needs" in p.describe()
    # 18 GiB free offloaded: 18 - 2 - 14 - 2.4 < 1.4 (10% of the weights) -> refused with the knobs to turn
    with pytest.raises(ConfigError, match="lower rollout.memory_margin_mb"):
        memory.plan(80 * GIB, 10 * GIB, 18 * GIB, margin=2 * GIB, weights=14 * GIB, need=20 * GIB)
    with pytest.raises(ConfigError, match="set train.offload_states auto"):
        memory.plan(80 * GIB, 10 * GIB, 60 * GIB, margin=2 * GIB, weights=14 * GIB, need=20 * GIB, offload="off")
    # vLLM's sampler at its default 1024 sequences, Qwen2.5's 151936 tokens: 1024 * 151936 * 4 bytes
    # = 0.58 GiB (the H100's planner check: the engine used 0.60 GiB over a plan without it); 64
    # sequences, the step's: 37 MiB, on top of the 1.1 GiB of activations
    assert memory.sampler_bytes(1024, 151936) == 622329856
    p = memory.plan(
        80 * GIB,
        70 * GIB,
        76 * GIB,
        margin=2 * GIB,
        weights=1 * GIB,
        need=2 * GIB,
        sampler=memory.sampler_bytes(64, 151936),
    )
    assert p.activations == GIB + GIB // 10 + 38895616 and p.budget == 3 * GIB + p.activations
    assert "activations 1.14 GiB (sampler 0.04)" in p.describe()
    import transformers

    assert memory.vocab_size(transformers.Qwen2Config(vocab_size=151936)) == 151936
    vl = transformers.AutoConfig.for_model("qwen2_5_vl", text_config={"vocab_size": 151936})
    assert memory.vocab_size(vl) == 151936  # the text model's, from a multimodal config


def test_a_short_kv_cache_runs_the_step_in_waves_down_to_the_longest_sequences():
    """Issue 49: the measured sizing's floor is a few full-length sequences (memory.kv_floor), not 10%
    of the weights, and the plan says how many waves a short KV cache costs. 30 GiB of weights
    (activations 1 + 3), 128 sequences of 1 GiB each (need 256 with the headroom), margin 2."""
    kw = dict(margin=2 * GIB, weights=30 * GIB, need=256 * GIB, floor=memory.kv_floor(128, GIB), seqs=128, seq=GIB)
    # 70 GiB free offloaded: a KV cache of 70 - 2 - 30 - 4 = 34 GiB, 34 sequences at once: 4 waves
    p = memory.plan(80 * GIB, 10 * GIB, 70 * GIB, **kw)
    assert p.offload and p.kv == 34 * GIB
    assert "up to 4 waves of 34" in p.describe() and "vLLM will queue sequences" in p.describe()
    # 39.5 GiB free: 3.5 GiB of KV cache is above 10% of the weights but below 4 full-length sequences
    with pytest.raises(ConfigError, match="KV cache of 4.00 GiB .the longest sequences running.*max_model_len"):
        memory.plan(80 * GIB, 10 * GIB, 39 * GIB + GIB // 2, **kw)
    assert memory.plan(80 * GIB, 10 * GIB, 40 * GIB, **kw).kv == 4 * GIB  # exactly the floor: 32 waves
    assert "up to 32 waves of 4" in memory.plan(80 * GIB, 10 * GIB, 40 * GIB, **kw).describe()


def test_kv_cache_need():
    import transformers

    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64 -> 2 * 24 * 2 * 64 * 2 bytes = 12 KiB per bf16 token
    qwen = transformers.Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    )
    assert memory.kv_bytes_per_token(qwen, 2) == 12288
    # 64 prompts x 8 samples over 8 ranks = 64 sequences of 4096 tokens: 64 * 4096 * 12 KiB = 3 GiB, x2
    cfg = config.load(None, {"train.prompts_per_step": 64, "rollout.n": 8, "rollout.max_model_len": 4096})
    assert memory.kv_cache_need(cfg, qwen, 8, 2) == 6 * GIB
    small = config.load(None, {})  # the demo's step needs a few MiB: at least 1 GiB
    assert memory.kv_cache_need(small, qwen, 1, 2) == memory.KV_MIN


def test_engine_seqs_cover_the_step_and_the_evaluation():
    # a rank's step: 64 prompts x 8 over 8 ranks = 64; its evaluation: 256 / 8 = 32 greedy, x4 with eval_n 4
    cfg = config.load(None, {"train.prompts_per_step": 64, "rollout.n": 8})
    assert memory.step_seqs(cfg, 8) == 64 and memory.engine_seqs(cfg, 8) == 64
    cfg = config.load(None, {"train.prompts_per_step": 64, "rollout.n": 8, "log.eval_n": 4})
    assert memory.engine_seqs(cfg, 8) == 128
    # every held-out prompt (counted later): vLLM's default on an 80 GB GPU
    assert memory.engine_seqs(config.load(None, {"log.eval_size": 0}), 1) == 1024


def test_tensor_parallel_engines_run_the_groups_sequences_as_planned():
    """Issue 47 item 2: a tensor-parallel engine serves its group's requests (every rank brings its
    own share), so max_num_seqs is tp x a rank's. The 72B recipe (TP 4, 8 GPUs, 32 prompts x 8,
    512 held-out prompts) runs 4 x 32 = 128 step sequences and 4 x 64 = 256 held-out ones per engine:
    256, what `hybridrl plan` prints, not one rank's 64 (the step in two waves, evaluation in four)."""
    from hybridrl.cycle import plan

    root = Path(__file__).resolve().parents[1]
    cfg = config.load(str(root / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), {})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert cfg.rollout.tensor_parallel_size == 4 and cfg.rollout.max_num_seqs == 0
    assert memory.engine_seqs(cfg, 8, 4) == 4 * max(memory.step_seqs(cfg, 8), 512 // 8) == 256
    assert p.knobs.max_num_seqs == 256 and "rollout.max_num_seqs=256 per engine (2 engine(s) of TP 4)" in p.table()
    # what runs: the planner's caller with the same settings (a fraction given: nothing to measure)
    fixed = replace(cfg, rollout=replace(cfg.rollout, gpu_memory_utilization="0.9"))
    out = engine_cycle.plan_rollout(fixed, Engines(FakeTrainer([])), cuda=True, main=False, world_size=8)
    assert out.max_num_seqs == p.knobs.max_num_seqs


def test_plan_rollout_fills_auto(monkeypatch, capsys):
    """The planner's caller, with the device's free memory given: 24 GiB device, 20 GiB free with
    the trainer's states (18 once Adam's moments exist), 22 once they leave; a 4 MiB model needs
    the 1 GiB minimum KV cache, so the states stay."""
    events = []
    cfg = config.load(None, {"rollout.memory_margin_mb": 1024})
    assert cfg.rollout.gpu_memory_utilization == "auto" and cfg.train.offload_states == "auto"
    frees = iter([(20 * GIB, 24 * GIB), (22 * GIB, 24 * GIB)])
    monkeypatch.setattr(memory, "free_memory", lambda: next(frees))
    trainer = FakeTrainer(events)
    trainer.hf = torch.nn.Linear(1024, 1024)  # 1024 * 1024 + 1024 fp32 params, ~4 MiB
    trainer.hf.config = type(
        "C", (), dict(num_attention_heads=2, num_hidden_layers=2, hidden_size=64, vocab_size=1000)
    )()
    trainer.hf.dtype = torch.float32
    trainer.pending_state_bytes = lambda: 2 * GIB  # Adam's moments, created at the first step
    out = engine_cycle.plan_rollout(cfg, Engines(trainer), cuda=True, main=True)
    # measured with the states on, then offloaded, then (they fit) reloaded
    assert events == [("trainer.offload", False), ("trainer.reload",)]
    assert out.offload_states == "off" and out.kv_cache_mb == 1024
    # vLLM runs the step's 32 prompts x 8 samples (or the 256 held-out prompts) at once: its sampler's 256
    # float32 rows are planned
    assert out.max_num_seqs == 256
    weights = (1024 * 1024 + 1024) * 4
    budget = weights + GIB + GIB + weights // 10 + 256 * 1000 * 4
    assert out.gpu_memory_utilization == str(int(budget / (24 * GIB) * 1e4) / 1e4)
    assert "memory plan: device 24.0 GiB" in capsys.readouterr().out
    # 19 GiB of reward models score while vLLM is awake: 1 + 19 > 20 - 2 with the states kept, so they
    # leave, and the KV cache shrinks to what is left (in whole MiB: this path once failed on a float)
    frees = iter([(20 * GIB, 24 * GIB), (22 * GIB, 24 * GIB)])
    out = engine_cycle.plan_rollout(cfg, Engines(trainer), cuda=True, main=True, visitors=19 * GIB)
    assert out.offload_states == "on"
    assert out.kv_cache_mb == (22 * GIB - 20 * GIB - weights - GIB - weights // 10 - 256 * 1000 * 4) >> 20
    # CPU, or a fraction the user set: offload as asked, nothing measured; vLLM's default sequences on CPU
    events.clear()
    out = engine_cycle.plan_rollout(cfg, Engines(trainer), cuda=False, main=True)
    assert out.offload_states == "on" and out.max_num_seqs == 0
    fixed = config.load(
        None, {"rollout.gpu_memory_utilization": "0.6", "train.offload_states": "off", "rollout.max_num_seqs": 100}
    )
    out = engine_cycle.plan_rollout(fixed, Engines(trainer), cuda=True, main=True)
    assert out.gpu_memory_utilization == "0.6" and out.offload_states == "off"
    assert out.max_num_seqs == 100  # set by the user: kept
    assert events == [("trainer.offload", False)]  # only the CPU call offloaded
    with pytest.raises(ConfigError, match="sleep_level=0 set a fraction"):
        engine_cycle.plan_rollout(config.load(None, {"rollout.sleep_level": 0}), Engines(trainer), cuda=True, main=True)


def test_gpu_memory_utilization_knob():
    assert config.load(None, {"rollout.gpu_memory_utilization": 0.7}).rollout.gpu_memory_utilization == "0.7"
    assert memory.utilization("0.7") == 0.7 and memory.utilization("auto") is None
    for bad in ("x", 0, 1.5):
        with pytest.raises(ConfigError, match="use auto or a fraction"):
            config.load(None, {"rollout.gpu_memory_utilization": bad})
    with pytest.raises(ConfigError, match="probe_every=0"):
        config.load(None, {"train.offload_params": True})


def test_an_oom_or_a_dead_engine_is_one_line_naming_the_phase_plan_and_knob(tmp_path):
    """Injected on CPU: a device out-of-memory at wake (vLLM's side) or in train (the trainer's), and
    vLLM's engine dying mid-generate, each become one line naming the step, the phase, the memory plan
    and the knob, after the rollout side is closed; other errors pass through. The hand-off's temporary
    directory goes at exit however the run ends. Before: a raw traceback and a leaked directory."""
    from hybridrl.core import faults
    from hybridrl.engines import ipc, vllm_compat

    class Rollout:
        closed = 0

        def close(self):
            self.closed += 1

    cfg = config.load(None, {"rollout.memory_margin_mb": 1024})
    cases = [
        (
            3,
            "wake_kv",
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "out of device memory in step 3, phase wake_kv (vLLM; the plan: rollout.gpu_memory_utilization=auto"
            ", rollout.kv_cache_mb=0, rollout.memory_margin_mb=1024",
            "raise rollout.memory_margin_mb",
        ),
        (
            5,
            "train",
            torch.OutOfMemoryError("CUDA out of memory"),
            "out of device memory in step 5, phase train (the trainer;",
            "lower train.max_tokens_per_micro_batch",
        ),
    ]
    if vllm_compat.ENGINE_DEAD:
        cases.append(
            (
                4,
                "generate",
                vllm_compat.ENGINE_DEAD[0](),
                "vLLM's engine died in step 4, phase generate",
                "rollout.gpu_memory_utilization",
            )
        )
    for step, phase, error, head, knob in cases:
        rollout = Rollout()
        faults.progress(step, phase)
        with pytest.raises(engine_cycle.EngineFailure) as e:
            with engine_cycle.failures(cfg, rollout):
                raise error
        line = str(e.value)
        assert line.startswith(head) and knob in line and "\n" not in line, line
        assert isinstance(e.value, config.UserError) and rollout.closed == 1  # the CLI prints it as one line
    with pytest.raises(KeyError):  # anything else is not an engine failure
        with engine_cycle.failures(cfg, Rollout()):
            raise KeyError("x")
    sender = ipc.BucketSender(1 << 20, cuda=False)
    where = Path(sender.dir)
    assert where.is_dir()
    del sender  # (the process exiting does the same: weakref.finalize runs at exit)
    assert not where.exists()
