"""train.precision: how the trainer computes in a bfloat16 run (issue 61).

On SmolLM2-135M-Instruct's chat task a trainer holding bfloat16 weights and activations (DeepSpeed's
bf16, float32 master weights in the optimizer) gained a third of the held-out accuracy per step that
the same trainer gained in float32, or TRL with float32 weights under bfloat16 autocast; importance
correction against vLLM did not help (docs/pretrained.md). amp is that autocast: float32 weights,
gradients and optimizer, bfloat16 GEMMs. auto is amp on CPU, where it was measured, and bf16 on a GPU.
tests/test_pretrained.py has the learning itself (slow)."""

from pathlib import Path

import pytest
import torch

import hybridrl
from hybridrl.core import config, recipe

from helpers.memory import four_rows

DEMO = str(Path(hybridrl.__file__).parent / "demo_model")


@pytest.mark.parametrize(
    "precision, weights", [("auto", torch.float32), ("amp", torch.float32), ("bf16", torch.bfloat16)]
)
def test_a_bfloat16_trainer_keeps_float32_weights_under_autocast_on_cpu(precision, weights, world_of_one):
    from hybridrl.engines.trainer import Trainer

    cfg = config.load(None, {"model.dtype": "bfloat16", "train.precision": precision, "train.lr": 1e-3})
    trainer = Trainer(cfg, DEMO, device=torch.device("cpu"), dtype=torch.bfloat16, attn_implementation="sdpa")
    assert {p.dtype for p in trainer.hf.parameters()} == {weights}
    batch = four_rows()
    logp = trainer.logprobs(batch, 1.0)[batch.loss_mask]
    # the GEMMs round to bfloat16 either way: the log-probs are not float32's over the same weights
    exact = Trainer(
        config.load(None, {}), DEMO, device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa"
    ).logprobs(batch, 1.0)[batch.loss_mask]
    assert 1e-4 < (logp - exact).abs().max() < 0.1
    before = {n: p.float().clone() for n, p in trainer.hf.named_parameters()}
    trainer.step(batch)
    moved = {n: (p.float() - before[n]).abs().max().item() for n, p in trainer.hf.named_parameters()}
    assert max(moved.values()) > 0
    # the hand-off sends what the trainer holds; vLLM casts float32 to its bfloat16 as it copies
    assert {t.dtype for _, t in trainer.named_parameters_for_sync(1 << 20)} == {weights}
    # the reference (KL) and the critic (GAE) compute as the policy does
    from hybridrl.engines.critic import Critic
    from hybridrl.engines.reference import Reference

    kw = dict(device=torch.device("cpu"), dtype=torch.bfloat16, attn_implementation="sdpa")
    ref = Reference(cfg, DEMO, **kw)
    assert {p.dtype for p in ref.module.parameters()} == {weights}
    assert torch.equal(ref.logprobs(batch, 1.0)[batch.loss_mask], logp)  # step 1's KL is 0
    critic = Critic(
        config.load(None, {"model.dtype": "bfloat16", "train.precision": precision, "algo.advantage": "gae"}),
        DEMO,
        **kw,
    )
    assert {p.dtype for p in critic.engine.module.parameters()} == {weights}
    assert critic.values(batch)[batch.loss_mask].isfinite().all()


@pytest.mark.fast
def test_auto_is_amp_on_cpu_and_bf16_on_a_gpu_in_bfloat16_runs_only():
    from hybridrl.core import models

    info = models.inspect(DEMO)
    for on_cpu, dtype, want in ((True, "bfloat16", "amp"), (False, "bfloat16", "bf16"), (True, "float32", "auto")):
        cfg = recipe.resolve(
            config.load(None, {"model.path": DEMO, "model.dtype": dtype}), info, on_cpu=on_cpu, free_ram=8 << 30
        )
        assert cfg.train.precision == want, (on_cpu, dtype)
        assert recipe.amp(cfg, on_cpu) == (want == "amp")
    cfg = config.load(None, {"model.dtype": "bfloat16", "train.precision": "bf16"})
    assert not recipe.amp(cfg, on_cpu=True)  # the user's choice stands
    with pytest.raises(config.ConfigError, match="train.precision"):
        config.load(None, {"train.precision": "fp16"})


@pytest.mark.fast
def test_the_plan_counts_amps_float32_gradients_also_when_the_optimizer_is_offloaded():
    from hybridrl.cycle import plan

    from helpers.plan import H100, NODE, gpu_config, shape

    s = shape("qwen2.5-7b")
    for precision, wb in (("bf16", 2), ("amp", 4)):
        for offload in ("off", "on"):
            cfg = gpu_config("qwen2.5-7b", 8, **{"train.precision": precision, "train.optimizer_offload": offload})
            k = plan.knobs(cfg, s, world=8, local=8, on_cpu=False)
            p = plan.build(s, k, device=H100, host=NODE)
            assert p.rows["trainer params"]["train"] == s.params * wb
            bucket = min(plan.REDUCE_BUCKET, s.params) * wb  # the reduce bucket alone when offloaded
            grads = bucket if offload == "on" else s.params * wb // 8 + bucket
            assert p.rows["trainer grads"]["train"] == grads, (precision, offload)
