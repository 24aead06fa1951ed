"""The reference policy of the KL penalty: nothing is loaded at beta = 0; with the KL in the reward
(the real engines, through the CLI) the penalty is exactly 0 while policy == reference, then grows;
under ZeRO-3 the policy, critic and reference load partitioned and the sharded reference scores like
the whole model (2 ranks). The KL in the loss is checked with the critic's resume run in test_critic.py."""

import pytest
import torch

from helpers.cli import train_cli


@pytest.mark.fast
def test_no_reference_model_is_loaded_when_beta_is_zero():
    from hybridrl.core import config
    from hybridrl.engines.reference import Reference

    cfg = config.load(overrides={"algo.kl_coef": 0.0})
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    assert Reference.load(cfg, "/no/such/model", **kw) is None  # would raise if it tried to load anything
    with pytest.raises(OSError):
        Reference.load(config.load(overrides={"algo.kl_coef": 0.1}), "/no/such/model", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_kl_in_the_reward_is_zero_at_step_one_then_moves(tmp_path, advantage):
    # one update per step: kl_mean is the loss's KL of the policy being updated, averaged over the step's
    # updates, and a second minibatch (the demo's default) would see a policy the first one moved
    _, steps, _ = train_cli(
        tmp_path / "run",
        "--steps",
        "4",
        "--algo.kl_coef",
        "0.1",
        "--algo.kl_in",
        "reward",
        "--algo.kl_type",
        "k1",
        "--algo.advantage",
        advantage,
        "--train.minibatches",
        "1",
    )
    # the trainer's log-probs of the sampling policy (old_logprob) against the reference's: the same
    # weights and kernels at step 1, so every KL_t is exactly 0. kl_mean is the loss's: its log-probs
    # come through the fused loss, another path than the no-grad one; equal to the bit on an Intel
    # Xeon, -2.2e-8 on an AMD EPYC
    assert steps[0]["kl_reward"] == 0.0 and abs(steps[0]["kl_mean"]) <= 1e-7
    assert all(s["time/old_logprob"] > 0 and s["time/ref_logprob"] > 0 for s in steps)
    # one update moved the policy off the reference: KL(pi_2 || ref) > 0, estimated on pi_2's own samples
    assert steps[1]["kl_mean"] > 1e-6
    # later steps need not grow: with no task reward in a group, the group's normalisation scales the
    # KL penalty up to a full advantage, which pulls the policy back to the reference, and k1's batch
    # mean can then dip below 0 (seed 0, grpo: 0.18, 0.05, -9e-5 at steps 2-4). What holds at every
    # step: the policy is off the reference, and the reward carries kl_coef times the KL it measured
    assert all(abs(s["kl_mean"]) > 1e-6 for s in steps[1:])
    assert all(s["kl_reward"] == pytest.approx(0.1 * s["kl_mean"], rel=1e-3, abs=1e-8) for s in steps)


ZERO3_SCRIPT = """
import json, sys
from hybridrl.core import environ
environ.setup()
import deepspeed, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from hybridrl.core import config
from hybridrl.core import launch
from hybridrl.data.batch import Batch, micro_batches, per_token
from hybridrl.engines.critic import Critic
from hybridrl.engines.reference import Reference
from hybridrl.engines.policy import TokenLogprobs
from hybridrl.engines.trainer import Trainer
from hybridrl.engines.zero_engine import ds_config, from_pretrained

DEMO = sys.argv[1]
world = launch.init_distributed()
cfg = config.load(None, {"train.zero_stage": 3, "algo.kl_coef": 0.05, "algo.advantage": "gae",
                         "train.max_tokens_per_micro_batch": 24})
kw = dict(device=world.device, dtype=torch.float32, attn_implementation="sdpa")
trainer, ref, critic = Trainer(cfg, DEMO, **kw), Reference.load(cfg, DEMO, **kw), Critic(cfg, DEMO, **kw)
files = load_file(DEMO + "/model.safetensors")
out = {"rank": world.rank}
# straight out of the loader, before any DeepSpeed engine: already partitioned (no rank held it whole)
loaded = from_pretrained(AutoModelForCausalLM, DEMO, ds_config(cfg, False), dtype=torch.float32)
out["partitioned_at_load"] = all(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel
                                 for p in loaded.parameters() if p.ds_numel > 1)

def check(name, module, prefix=""):
    params = dict(module.named_parameters())
    out[name] = {"local": sum(p.ds_tensor.numel() for p in params.values()),  # this rank's shards
                 "full": sum(p.ds_numel for p in params.values()),
                 "from_file": sum(prefix + n in files for n in params)}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        out[name]["equal"] = all(torch.equal(p, files[prefix + n]) for n, p in params.items() if prefix + n in files)

check("policy", trainer.hf)
check("reference", ref.module.module.hf)
check("critic", critic.engine.module.base, prefix="model.")
# rank 1 has three times the rows, so more micro-batches: the sharded reference pads rank 0's
g = torch.Generator().manual_seed(world.rank)
rows = 2 + 4 * world.rank
batch = Batch.from_rows([torch.randint(3, 12, (5,), generator=g).tolist() for _ in range(rows)],
                        [torch.randint(3, 12, (4,), generator=g).tolist() for _ in range(rows)],
                        [[-1.0] * 4] * rows, [1.0] * rows)
sharded = ref.logprobs(batch, 0.7)  # [B, T]
plain = TokenLogprobs(AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32), "torch",
                       cfg.train.logprob_chunk)  # the whole model, unpartitioned
with torch.no_grad():
    whole = per_token(lambda mb: plain(mb.tokens, mb.attention_mask(), mb.loss_mask, 0.7)[0], batch,
                      micro_batches(batch.lengths, 24), world.device)
out["ref_max_diff"] = float((sharded - whole).abs().max())
out["ref_scored"] = int((sharded != 0).sum())
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.devices(2)
def test_zero3_engines_load_partitioned_and_match_the_checkpoint(tmp_path):
    """Under ZeRO-3 the policy, the critic and the reference are built inside deepspeed.zero.Init
    and filled from the checkpoint partitioned (2 ranks, real DeepSpeed): each rank holds about
    half of every engine's parameters, the gathered parameters are the checkpoint's bit for bit,
    and the sharded reference (a ZeRO-3 engine that gathers per layer, with ranks running
    different micro-batch counts) gives the log-probs of the whole, unpartitioned model."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import hybridrl
    from hybridrl.core.launch import _free_port

    demo = str(Path(hybridrl.__file__).parent / "demo_model")
    script = tmp_path / "zero3_load.py"
    script.write_text(ZERO3_SCRIPT)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(script),
            demo,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    ranks = sorted(
        (json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("RESULT ")), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in ranks] == [0, 1]
    files = 51  # tensors in the demo checkpoint (untied head)
    for name, from_file in [("policy", files), ("reference", files), ("critic", files - 1)]:  # critic: no lm_head
        full = ranks[0][name]["full"]
        assert full == ranks[1][name]["full"] > 800_000, name
        for r in ranks:
            assert r[name]["local"] <= full // 2 + 2 * from_file, (name, r)  # its half (+ a padding element each)
            assert r[name]["from_file"] == from_file and r[name]["equal"], (name, r)
    for r in ranks:
        assert r["partitioned_at_load"]
        assert r["ref_max_diff"] == 0.0 and r["ref_scored"] == (2 + 4 * r["rank"]) * 4
