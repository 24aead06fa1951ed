"""The configuration's schema: every setting of a run, as one typed dataclass tree.

Each group (model, rollout, train, algo, reward, data, env, log, ckpt) is a dataclass whose
fields carry their default, a real model's (GRPO on a chat or math model, as the peers ship it),
and their help text, which `hybridrl train --help` prints grouped by section. The embedded demo
(model.path=demo) runs with DEMO, its own recipe, in the keys the user leaves unset. Loading,
overrides and validation are in config.py, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridrl.algorithms import ESTIMATORS, POLICY_LOSSES

# the algorithms' names and one-line summaries, from their declarations (hybridrl/algorithms/)
AdvantageName = Literal[tuple(ESTIMATORS)]
PolicyLossName = Literal[tuple(POLICY_LOSSES)]


def _choices(specs: dict) -> str:
    return "; ".join(f"{name}: {spec.summary}" for name, spec in specs.items())


def knob(default: Any, help: str, valid: str | None = None, why: str = "", **kw) -> Any:
    """A config field with its help text; a number's allowed range in `valid` (config.in_range: '> 0',
    '>= 1', '[0, 1)', '0 or >= 5', 'finite'), checked with the config, before anything heavy is imported;
    `why` is said beside it when a value is refused."""
    meta = {"help": help, **({"valid": valid, "why": why} if valid else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


class Freezable:
    """A config group, and the Config: its fields can be set until the run's config is
    resolved, then `config.freeze` marks it and an assignment raises, so that no engine quietly
    changes a setting the run printed and recorded. dataclasses.replace still gives a settable copy."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: the run's config is resolved and frozen before the engines "
                "start (run/resolve.py); set it in YAML, by flag, or on the config before hybridrl.train"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot delete {type(self).__name__}.{name}: the config is frozen")
        object.__delattr__(self, name)


@dataclass
class ModelConfig(Freezable):
    path: str = knob("demo", "Policy model: a local HF directory, a hub name, or 'demo' (the shipped tiny model).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto",
        "Weight/compute dtype for both engines; auto = bfloat16 on GPU; on CPU float32, or bfloat16 for a "
        "model of 50M+ parameters on CPUs with AMX-BF16 (its bfloat16 GEMMs run in hardware). float16 is refused: "
        "the trainer has no loss scaling, so small gradients would underflow to zero.",
    )
    attn_implementation: str = knob(
        "auto",
        "transformers attention: auto = flash_attention_2 if installed on GPU; "
        "on CPU in bfloat16 eager while its saved scores fit 2 GiB (faster there), else "
        "sdpa.",
    )
    gradient_checkpointing: bool = knob(
        False,
        "Recompute activations in backward to save trainer memory. Unset on a "
        "GPU, the memory plan turns it on when a micro-batch's activations would not "
        "fit (`hybridrl plan` shows why).",
    )
    trust_remote_code: bool = knob(False, "Allow custom modelling code from the model directory.")
    train_vision: Literal["off", "projector", "all"] = knob(
        "off",
        "Vision-language models: what of the vision side trains. off: the tower and its projector are "
        "frozen (no gradients or optimizer states; the hand-off sends the language model only); projector: "
        "the projector (merger) trains too and is handed off; all: the whole tower. The memory plan counts each.",
    )
    lora_rank: int = knob(
        0,
        "LoRA rank r (0 = off: full fine-tuning). On: only the adapter trains (the base weights "
        "are frozen), only the adapter is handed to vLLM, and the KL reference is the base model "
        "(the trainer's own, adapter disabled: no second model).",
        valid="[0, 512]",
        why="0 is off, 512 the largest rank vLLM serves",
    )
    lora_alpha: float = knob(32.0, "LoRA alpha: the adapter's output is scaled by lora_alpha / lora_rank.", valid="> 0")
    lora_dropout: float = knob(
        0.0, "Dropout on the adapter's input while training (log-probs are computed without it).", valid="[0, 1)"
    )
    lora_target_modules: list = knob(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names (suffixes) that get an adapter: the attention and MLP projections "
        "of Llama/Qwen/Mistral-style models by default.",
    )


@dataclass
class RolloutConfig(Freezable):
    n: int = knob(8, "Samples generated per prompt (the GRPO group size).", valid=">= 1")
    temperature: float = knob(
        1.0,
        "Sampling temperature; the trainer scores log-probs at the same temperature.",
        valid="> 0",
        why="at 0 vLLM samples greedily: one answer per prompt (it refuses "
        "rollout.n > 1) and no distribution to train on; the held-out evaluation is greedy",
    )
    top_p: float = knob(
        1.0,
        "Nucleus sampling. Only 1.0 trains: vLLM's log-probs are renormalised over the nucleus, "
        "the trainer's are not, so the ratios and the probe would be biased.",
        valid="(0, 1]",
    )
    top_k: int = knob(0, "Top-k sampling (0 = off). Refused for training, like top_p < 1.", valid=">= -1")
    min_p: float = knob(0.0, "Min-p sampling (0 = off). Refused for training, like top_p < 1.", valid="[0, 1]")
    stop: list = knob(
        [],
        "Stop strings: a completion ends at the first one (kept in the completion, as an EOS would "
        "be), e.g. ['</answer>']. Also used by the held-out evaluation.",
    )
    max_new_tokens: int = knob(1024, "Longest completion, in tokens (OpenRLHF's; verl 512, TRL 256).", valid=">= 1")
    max_model_len: int = knob(
        1536,
        "vLLM context length; unset: data.max_prompt_len + rollout.max_new_tokens, at "
        "most the model's max_position_embeddings.",
        valid=">= 2",
    )
    tensor_parallel_size: int = knob(
        1,
        "vLLM tensor-parallel size: consecutive ranks, this many, share one engine "
        "(must divide --nproc; for models one device cannot serve). 1: every rank runs "
        "its own engine. In process only. Unset on GPUs, the memory plan raises it when "
        "vLLM's weights leave no room on one GPU.",
        valid="[1, 8]",
    )
    gpu_memory_utilization: str = knob(
        "auto",
        "GPU only: fraction of device memory vLLM may use (weights + KV cache), or auto = what is free "
        "once the trainer has offloaded its states, less rollout.memory_margin_mb (the plan is printed at start).",
    )
    memory_margin_mb: int = knob(
        2048,
        "GPU only, with gpu_memory_utilization=auto: device memory kept back from vLLM "
        "(CUDA contexts, NCCL, fragmentation, the hand-off's staging).",
        valid=">= 0",
    )
    mode: Literal["inprocess", "outofprocess"] = knob(
        "inprocess",
        "inprocess: vLLM runs inside each rank, weights passed by reference; outofprocess: vLLM's own "
        "engine-core process, weights sent through train.sync_bucket_mb staging buckets shared by handle (CUDA IPC "
        "on GPU, shared memory on CPU).",
    )
    kv_cache_mb: int = knob(
        0,
        "KV cache size in MiB; 0 = auto: on CPU (at least 64) the step's sequences x context "
        "(in 128-token blocks) x the model's KV bytes per token, at most half the free RAM; on GPU "
        "(with gpu_memory_utilization=auto) 2 x what the step's sequences need at full length, at "
        "least 1 GiB. More is mapped and unmapped at every wake and sleep for nothing; vLLM queues "
        "what does not fit.",
        valid=">= 0",
    )
    max_num_seqs: int = knob(
        0,
        "Sequences vLLM runs at once. 0 = auto: on GPU a rank's step or held-out evaluation, "
        "whichever is more (vLLM's sampler keeps a float32 logits row for each: its default of "
        "1024 on an 80 GB GPU is 0.6 GiB at a 152k vocabulary; the memory plan reserves them); on "
        "CPU vLLM's default.",
        valid=">= 0",
    )
    enable_prefix_caching: bool = knob(True, "Reuse a prompt's KV cache across its n samples.")
    images_per_prompt: int = knob(
        4,
        "Vision-language models: the most images one prompt holds; vLLM sizes its encoder's profile and "
        "cache for them, and takes no video.",
        valid=">= 1",
    )
    enforce_eager: bool = knob(
        True,
        "Skip graph capture/compilation. Unset: False on GPUs (vLLM decodes with CUDA "
        "graphs, captured for batches up to rollout.max_num_seqs, their memory in the plan; "
        "LoRA engines stay eager); on CPU False for a model of 50M parameters or more "
        "(vLLM's compiled decoder), True for smaller ones (fast start).",
    )
    partial: Literal["off", "on"] = knob(
        "off",
        "Partial rollouts (docs/partial.md): issue rollout.partial_oversample x the step's groups, stop vLLM "
        "once train.prompts_per_step groups are complete (all n samples finished), and continue the rest in the "
        "next step from their tokens (prefix re-fed to vLLM); their older tokens are trained with the importance "
        "correction against their stored log-probs (algo.tis_cap 2 unless set). For long-tailed answer lengths, "
        "where a step waits for its few longest answers. Single-turn, one engine per rank.",
    )
    partial_max_age: int = knob(
        1,
        "Partial rollouts: the most optimizer updates a trained token may be older than "
        "the policy it trains (a group at the cap is finished, not carried again).",
        valid=">= 1",
    )
    partial_oversample: float = knob(
        1.5, "Partial rollouts: groups in flight per group trained (the carried ones included).", valid="[1, 8]"
    )
    sleep_level: int = knob(
        2,
        "vLLM sleep level between rollouts on GPU. 2 (default): weights discarded, since every "
        "hand-off rewrites them all anyway (level 1 copies the weights to pinned host memory, one "
        "copy per rank); 1: weights kept in host memory (for hand-offs that send only part of the "
        "weights: with model.lora_rank > 0, 2 becomes 1); 0: no sleep, vLLM keeps its memory.",
        valid="0 or 1 or 2",
    )


@dataclass
class TrainConfig(Freezable):
    steps: int = knob(
        600, "Number of RL steps (rollout + update); unset, with train.data_epochs > 0, from the data.", valid=">= 1"
    )
    data_epochs: float = knob(
        1.0,
        "Passes over the training prompts: train.steps = ceil(data_epochs x prompts / "
        "prompts_per_step) unless train.steps is set (0 = use train.steps).",
        valid=">= 0",
    )
    max_minutes: float = knob(
        0.0,
        "Stop after this much wall time after engine start (0 = no limit: a run ends after its steps).",
        valid=">= 0",
    )
    prompts_per_step: int = knob(
        64, "Prompts per step across all ranks (each yields rollout.n samples: 64 x 8 = 512 sequences).", valid=">= 1"
    )
    lr: float = knob(1e-6, "AdamW learning rate (1e-6: the range of GRPO on 0.5B-7B).", valid="(0, 1]")
    weight_decay: float = knob(0.0, "AdamW weight decay.", valid=">= 0")
    precision: Literal["auto", "amp", "bf16"] = knob(
        "auto",
        "How the trainer computes in bfloat16 (model.dtype=bfloat16; float32 runs ignore it): amp = float32 "
        "weights, gradients and optimizer, forward and backward under bfloat16 autocast (TRL's default); bf16 = "
        "bfloat16 weights, activations and gradients over DeepSpeed's float32 master weights (half the weight memory). "
        "auto = amp on CPU, bf16 on GPU. vLLM generates in model.dtype either way.",
    )
    betas: list = knob([0.9, 0.99], "AdamW betas.")
    warmup_steps: int = knob(
        0,
        "Linear learning-rate warm-up over this many optimizer updates: lr / warmup_steps, "
        "2 lr / warmup_steps, ..., lr.",
        valid=">= 0",
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = knob(
        "constant",
        "Learning rate after the warm-up: constant, or a cosine / linear decay to lr x min_lr_ratio at the last step.",
    )
    min_lr_ratio: float = knob(0.0, "Where cosine / linear decay ends, as a fraction of train.lr.", valid="[0, 1]")
    grad_clip: float = knob(1.0, "Gradient-norm clip (0 = off).", valid=">= 0")
    zero_stage: int = knob(
        2,
        "DeepSpeed ZeRO stage (2 or 3). Unset on GPUs, the memory plan picks 3 when ZeRO-2's "
        "replicated parameters do not fit.",
        valid="2 or 3",
    )
    epochs: int = knob(1, "Passes over each rollout batch (PPO epochs).", valid=">= 1")
    minibatches: int = knob(
        1,
        "Optimizer steps per epoch; > 1 makes later steps off-policy (ratio != 1). 1: one "
        "update per rollout, on-policy, and no pi_old pass in 16-bit.",
        valid=">= 1",
    )
    max_tokens_per_micro_batch: int = knob(
        8192,
        "Token budget of one forward/backward; micro-batches accumulate. "
        "Unset on GPUs, the memory plan halves it (down to 1024 tokens or one "
        "full-length sequence) while its activations do not fit.",
        valid=">= 1",
    )
    sequence_parallel_size: int = knob(
        1,
        "Ulysses sequence parallelism: consecutive ranks, this many, split each "
        "micro-batch's tokens between them (all-to-all around attention: heads "
        "scattered, sequence gathered), so one sequence may be up to this many times "
        "train.max_tokens_per_micro_batch (1: off; a longer sequence is refused). Must "
        "divide --nproc and the model's attention heads; the group trains on its "
        "ranks' rollouts together (docs/parallel.md).",
        valid=">= 1",
    )
    packing: Literal["auto", "on", "off"] = knob(
        "auto",
        "Lay each micro-batch's samples end to end in one row (position ids restart per sample) instead of "
        "right-padded rows; same loss either way. auto = on with flash-attention (varlen: no padding computed), off "
        "with sdpa/eager, whose packed row costs a full masked L x L attention.",
    )
    share_prompt: Literal["auto", "on", "off"] = knob(
        "auto",
        "Compute each prompt once for its rollout.n samples in the trainer's forward and backward (its KV "
        "cache, gathered to the samples; the same loss and gradients). auto = on with sdpa/eager attention, "
        "unpacked rows, ZeRO-1/2 and no gradient checkpointing.",
    )
    kernels: Literal["auto", "triton", "torch", "liger", "naive"] = knob(
        "auto",
        "Log-prob/loss provider: auto = chunked torch (cuBLAS on CUDA); triton = the fused Triton kernels; "
        "liger = Liger-Kernel's fused "
        "GRPO loss (clipped surrogate only); naive = full logits (reference).",
    )
    logprob_chunk: int = knob(1024, "Tokens per chunk in the chunked log-prob path.", valid=">= 1")
    sync_bucket_mb: int = knob(
        256,
        "Weight hand-off bucket size: ZeRO-3 params are gathered this many MiB at a time, "
        "and rollout.mode=outofprocess sends them through staging buckets of this size "
        "(0 = one parameter at a time).",
        valid=">= 0",
    )
    offload_states: Literal["auto", "on", "off"] = knob(
        "auto",
        "GPU only: move the trainer's optimizer states, fp32 master weights and gradients off the device while "
        "vLLM generates. auto = only when they do not fit beside vLLM's planned memory (with "
        "rollout.gpu_memory_utilization=auto; a fixed fraction means on).",
    )
    offload_params: bool = knob(
        False,
        "GPU only: also move the trainer's parameters off the device while vLLM "
        "generates (after the hand-off); optimizer states, fp32 master weights and gradients "
        "always move.",
    )
    optimizer_offload: Literal["auto", "on", "off"] = knob(
        "auto",
        "Keep the fp32 master weights and Adam's moments in host memory and run the optimizer step there "
        "(DeepSpeed ZeRO-Offload, offload_optimizer: cpu; OpenRLHF's --adam_offload). "
        "auto = on when the memory plan finds the states do not fit the GPU otherwise (off on CPU).",
    )
    param_offload: Literal["auto", "on", "off"] = knob(
        "auto",
        "ZeRO-3 only: keep the parameters' shards in host memory, gathered to the device layer by layer "
        "(DeepSpeed offload_param: cpu); needs train.optimizer_offload on or auto (the memory plan then turns it "
        "on). auto = on when the memory plan finds nothing else fits (off on CPU).",
    )
    probe_every: int = knob(
        20,
        "Check vLLM vs trainer log-probs on a probe batch after the first hand-off, every N "
        "steps, and at once when a training batch's own vLLM-vs-trainer gap (logp_gap_max in "
        "float32, logp_gap_mean in 16-bit) exceeds train.probe_tol (0 = off). The probe is two "
        "forward passes (docs/speed.md has their cost).",
        valid=">= 0",
    )
    probe_tol: float = knob(
        0.0,
        "Bound on |logp_vllm - logp_trainer| over the probe batch's tokens; 0 = by dtype: the "
        "largest gap <= 1e-4 in float32, the mean gap <= 2e-2 in bfloat16/float16 (16-bit rounding "
        "alone moves single tokens by up to ~0.15; a stale or garbled tensor moves them all).",
        valid=">= 0",
    )
    probe_action: Literal["error", "warn"] = knob("error", "What a failed probe does.")
    seed: int = knob(
        0, "Seeds everything: data order, torch, and vLLM sampling (seed + rank on each rank).", valid="[0, 4294967295]"
    )
    watchdog_s: float = knob(
        900.0,
        "Stop the run when a rank makes no progress (no phase of a step begins) for this "
        "many seconds, naming the rank that stalled and dumping its stacks (0 = off). Raise it "
        "if one phase (a long generation, a big checkpoint) can legitimately take longer.",
        valid="0 or >= 5",
    )


@dataclass
class AlgoConfig(Freezable):
    advantage: AdvantageName = knob("grpo", f"Advantage estimator: {_choices(ESTIMATORS)}.")
    policy_loss: PolicyLossName = knob("ppo", f"Policy loss (docs/losses.md): {_choices(POLICY_LOSSES)}.")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = knob(
        "token_mean", "How token losses are reduced (DAPO token_mean, GRPO seq_mean_token_mean, Dr.GRPO sum_norm)."
    )
    clip_low: float = knob(
        0.2,
        "Clip epsilon below 1 (ppo: 0.2; a loss with a range of its own takes it unless set: "
        "gspo/gspo_token 3e-4, gmpo 0.4 on the log-ratio).",
        valid="[0, 1)",
    )
    clip_high: float = knob(
        0.28,
        "Clip epsilon above 1 (ppo: 0.28, DAPO clip-higher; unless set: gspo/gspo_token "
        "4e-4, gmpo 0.4 on the log-ratio).",
        valid=">= 0",
    )
    dual_clip: float = knob(
        0.0,
        "Dual-clip constant c > 1 for negative advantages (0 = off; the losses with a "
        "clipped surrogate: ppo/gspo/gspo_token).",
        valid="0 or > 1",
    )
    cispo_clip_low: float = knob(
        1.0, "CISPO: the IS weight is clipped below at 1 - this (1 = no lower bound, as in MiniMax-M1).", valid=">= 0"
    )
    cispo_clip_high: float = knob(
        4.0,
        "CISPO: the IS weight is clipped above at 1 + this (4: the bound 5 that "
        "Liger-Kernel's documentation suggests).",
        valid=">= 0",
    )
    kl_coef: float = knob(
        0.0, "Weight beta of the KL to the reference policy (0 = no reference model is loaded).", valid=">= 0"
    )
    kl_type: Literal["k1", "k2", "k3"] = knob(
        "k3", "KL estimator (Schulman's k1 = log ratio, k2, k3); k1 is the usual choice with algo.kl_in=reward."
    )
    kl_in: Literal["loss", "reward"] = knob(
        "loss",
        "Where the KL goes: loss (+ beta * KL in the policy loss, GRPO) or reward (a per-token reward "
        "-beta * KL_t, PPO-RLHF; for grpo/dr_grpo/rloo beta * sum_t KL_t is taken off the sample's reward).",
    )
    ref_path: str = knob(
        "", "Reference policy for the KL: a HF model directory (default: the initial policy, model.path)."
    )
    teacher: str = knob(
        "",
        "On-policy distillation: a teacher model (HF directory or hub name; any size or family with the "
        "policy's tokenizer) that scores every sampled token; its per-token reverse KL d_t = log pi(a_t) - "
        "log pi_teacher(a_t) enters the advantage as A_t - algo.distill_coef * d_t (docs/distillation.md).",
    )
    distill_coef: float = knob(
        1.0,
        "Weight lambda of the teacher's signal (algo.teacher): of d_t in the advantage, or of the full-vocabulary "
        "divergence in the loss (algo.distill_loss full).",
        valid=">= 0",
    )
    distill_loss: Literal["sampled", "full"] = knob(
        "sampled",
        "The teacher's signal: sampled = the sampled token's reverse KL d_t as a per-token advantage; full = "
        "the exact divergence over the whole vocabulary from both models' final hidden states (fused, chunked: "
        "no [tokens, vocab] logits), added to the loss as lambda x its token aggregate (TRL's GKD).",
    )
    distill_beta: float = knob(
        1.0,
        "algo.distill_loss full's divergence, TRL's generalised JSD beta: 1 = reverse KL(student || teacher), "
        "0 = forward KL(teacher || student), in between the JSD of the beta-mixture.",
        valid="[0, 1]",
    )
    task_reward: bool = knob(
        True,
        "The reward's advantage enters the update (off: pure distillation, the reward still scores the "
        "held-out evaluation). algo.teacher with no reward named turns it off.",
    )
    gamma: float = knob(1.0, "Discount factor of the per-token returns (gae, reinforce_pp).", valid="(0, 1]")
    gae_lambda: float = knob(
        0.95, "GAE lambda: 1 = Monte-Carlo returns minus the value, 0 = one-step TD.", valid="[0, 1]"
    )
    critic_lr: float = knob(1e-4, "Learning rate of the critic (algo.advantage=gae).", valid="(0, 1]")
    critic_path: str = knob(
        "",
        "Critic initialisation (default: the policy's model.path, value head at zero): a HF "
        "model with the policy's tokenizer; a reward model's or saved critic's one-output head "
        "(score, value_head, v_head.summary) starts the value head.",
    )
    value_clip: float = knob(
        0.2,
        "PPO value clipping: new values may move at most this far from the old ones in the critic's loss (0 = off).",
        valid=">= 0",
    )
    entropy_coef: float = knob(0.0, "Entropy bonus weight.", valid=">= 0")
    is_correction: Literal["tis", "mask"] = knob(
        "tis",
        "Importance correction against vLLM's log-probs: tis (truncate the weight at algo.tis_cap; off while "
        "it is 0) or mask (IcePop: the weight is 0 for tokens/sequences whose ratio leaves "
        "[algo.is_mask_low, algo.is_mask_high]).",
    )
    tis_cap: float = knob(0.0, "Truncated importance-sampling cap against vLLM log-probs (0 = off).", valid=">= 0")
    old_logprobs: Literal["auto", "trainer", "rollout"] = knob(
        "auto",
        "Where pi_old comes from when a rollout feeds several updates (train.epochs x train.minibatches > 1) "
        "or the KL sits in the reward: trainer = one more trainer forward over the batch before the first update; "
        "rollout = vLLM's log-probs of the sampled tokens, free (verl's bypass mode). auto = rollout in float32, "
        "where the two agree to ~1e-6 (the probe checks it), unless importance correction or the KL in the reward "
        "needs the trainer's; trainer otherwise.",
    )
    tis_level: Literal["token", "sequence", "geometric"] = knob(
        "token",
        "IS weight (tis or mask) per token, per sequence (exp of the summed log-ratio, shared by its "
        "tokens), or geometric (exp of the mean log-ratio: length-normalised).",
    )
    is_mask_low: float = knob(
        0.5, "Masked IS (algo.is_correction=mask): lower bound of the kept ratios.", valid="[0, 1]"
    )
    is_mask_high: float = knob(
        2.0, "Masked IS (algo.is_correction=mask): upper bound of the kept ratios.", valid=">= 1"
    )
    routing_replay: Literal["auto", "on", "off"] = knob(
        "auto",
        "Routing replay (R3) for mixture-of-experts models: the trainer's forward routes each sampled "
        "token to the experts vLLM routed it to (the gate weights are still the trainer's, so the router "
        "learns). auto = on for MoE models whose routers it supports (off, with a note, for others and under "
        "sequence parallelism); dense models have nothing to replay (ignored, with a note). "
        "The routing mismatch (routing/mismatch) and the experts' load (router/load_cv) are logged either way.",
    )
    skip_zero_advantage: bool = knob(
        True,
        "Train only on samples with a non-zero advantage; groups whose rewards are "
        "all equal carry no gradient. The loss normaliser then counts only the kept "
        "tokens, as with DAPO's dynamic sampling.",
    )
    dynamic_sampling: bool = knob(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and generate "
        "more prompts until train.prompts_per_step groups carry signal.",
    )
    dynamic_sampling_max_rounds: int = knob(
        4,
        "Most generation rounds per step with dynamic sampling; at the cap the "
        "step trains on the groups it has (counted in ds_cap_hits).",
        valid=">= 1",
    )
    overlong_buffer: int = knob(
        0,
        "DAPO soft overlong punishment: the last N tokens before rollout.max_new_tokens "
        "cost up to overlong_penalty, linearly (0 = off).",
        valid=">= 0",
    )
    overlong_penalty: float = knob(1.0, "Reward subtracted at the length limit by the overlong buffer.", valid=">= 0")
    overlong_filter: bool = knob(
        False,
        "DAPO overlong filtering: samples cut off by rollout.max_new_tokens (not "
        "stopped by EOS) are masked out of the loss.",
    )


@dataclass
class RewardConfig(Freezable):
    fn: str = knob(
        "arithmetic",
        "Reward: comma-separated terms NAME[:WEIGHT], each a built-in (arithmetic, the "
        "demo's verifier and the default, which a run on other data must name to keep; "
        "exact_match, math_verify, format, code_tests: the row's tests run in the code sandbox), "
        "module:function with fn(prompt, completion, answer) -> float "
        "(async def too; batched if fn.batched), or rm:PATH (a sequence-classification reward model scored "
        "on the device), e.g. math_verify:1.0,format:0.1 or arithmetic,rm:/models/rm:0.5.",
    )
    rm_batch_size: int = knob(32, "Texts per forward of an rm:PATH reward model.", valid=">= 1")
    on_error: Literal["zero", "raise"] = knob(
        "zero",
        "A reward function that raises, hangs past timeout_s or kills "
        "its worker scores 0 (counted, dead-lettered) or stops the run.",
    )
    workers: int = knob(
        -1,
        "Reward worker processes (0 = in this process, no timeout for plain functions; "
        "-1 = auto: in-process for the built-in arithmetic/exact_match/format; for code_tests the "
        "cores the engines leave free, shared by the node's ranks; else min(4, CPUs)).",
        valid=">= -1",
    )
    timeout_s: float = knob(
        30.0, "Per-call reward timeout in seconds; the hung worker is killed and replaced.", valid="> 0"
    )
    format_pattern: str = knob(
        r"<think>.*?</think>\s*<answer>.*?</answer>",
        "Regular expression the whole completion must match for the 'format' reward.",
    )
    code_all_or_nothing: bool = knob(
        False, "The 'code_tests' reward scores 1 when every test passes, else 0 (default: the fraction passed)."
    )
    sandbox_packages: str = knob(
        "",
        "Installed packages the 'code_tests' programs may import, comma-separated top-level names "
        "(numpy,sympy); each is shown to the sandbox read-only. '' = the standard library only.",
    )

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.sandbox_packages.split(",") if p.strip())


@dataclass
class DataConfig(Freezable):
    path: str = knob(
        "demo",
        "Prompts: a built-in task ('demo': addition; 'longtail': its long-tailed variant for "
        "partial rollouts; 'code': write a function, scored by running it), a .jsonl/.json/.parquet/"
        ".csv file, or a directory written by datasets' save_to_disk.",
    )
    heldout_path: str = knob("", "Held-out prompts for evaluation (default: the demo's held-out split, or none).")
    prompt_key: str = knob(
        "prompt",
        "Column holding the prompt text (or its chat turns, as data.messages_key's); for a "
        "vision-language model an '<image>' marker places each image of the row's 'images' column.",
    )
    answer_key: str = knob("answer", "Column holding the reference answer passed to the reward.")
    max_prompt_len: int = knob(
        512, "Prompts longer than this many tokens are dropped (counted; verl's 512).", valid=">= 1"
    )
    messages_key: str = knob(
        "messages",
        "Column of chat-format rows: a list of {role, content} turns (system, "
        "user, ...), rendered with the tokenizer's chat template; used when a row has no "
        "data.prompt_key. A trailing assistant turn is left out (the model writes it). A content may "
        "be a list of {type: text, text} and {type: image} parts (TRL's), each image from the "
        "row's 'images' column.",
    )
    chat_template: Literal["auto", "on", "off"] = knob(
        "auto",
        "Wrap prompts in the tokenizer's chat template (auto = if the tokenizer has one; prompts that "
        "carry its markers already are used as given).",
    )
    split: str = knob("train", "Split of data.path when it is a saved datasets.DatasetDict.")
    heldout_split: str = knob("test", "Split of data.heldout_path when it is a saved datasets.DatasetDict.")
    on_error: Literal["error", "skip"] = knob(
        "error",
        "A malformed row (bad JSON, missing key, non-string prompt) stops with its file and line, or is "
        "skipped and counted (logged once with the first location).",
    )


@dataclass
class EnvConfig(Freezable):
    cls: str = knob(
        "",
        "Multi-turn rollouts: an environment class, module:Class (see hybridrl/data/envs.py; ToolEnv "
        "runs Python tools the model calls as <tool_call>{json}</tool_call>). '' = single-turn.",
    )
    max_turns: int = knob(
        4,
        "Most assistant turns per episode; an episode still going after them ends, counted (env/truncated_turns).",
        valid=">= 1",
    )
    max_tokens: int = knob(
        0,
        "Token budget of an episode's completion: assistant and environment tokens together "
        "(0 = rollout.max_new_tokens x env.max_turns). rollout.max_new_tokens bounds each "
        "assistant turn. An episode that would exceed it, or rollout.max_model_len, ends, counted "
        "(env/truncated_length).",
        valid=">= 0",
    )
    tool_timeout_s: float = knob(
        10.0,
        "Seconds a tool call (ToolEnv) or an environment's reset/step may take; past "
        "it the call is abandoned, counted and dead-lettered, and the run goes on.",
        valid="> 0",
    )


@dataclass
class LogConfig(Freezable):
    run_dir: str = knob("runs/{time}", "Where metrics.jsonl, the config and checkpoints go.")
    eval_every: int = knob(50, "Held-out greedy evaluation every N steps (0 = only at start and end).", valid=">= 0")
    eval_every_s: float = knob(
        0.0, "Also evaluate once this many seconds have passed since the last evaluation (0 = off).", valid=">= 0"
    )
    eval_size: int = knob(256, "Held-out prompts evaluated (0 = all).", valid=">= 0")
    eval_n: int = knob(
        0,
        "Also sample this many completions per held-out prompt and log their mean accuracy "
        "as eval/mean@n (0 = off; greedy pass@1 is always logged).",
        valid=">= 0",
    )
    eval_temperature: float = knob(1.0, "Sampling temperature of the eval_n samples.", valid="> 0")
    eval_threshold: float = knob(
        1.0,
        "A held-out completion counts as correct (accuracy, pass@1, mean@n) when its "
        "reward is >= this; eval/mean_reward is logged too, for continuous rewards.",
        valid="finite",
    )
    eval_samples: int = knob(
        4,
        "Prompts, completions and rewards written to samples.jsonl (and the TensorBoard/W&B "
        "sinks) at every evaluation (0 = off).",
        valid=">= 0",
    )
    progress: bool = knob(True, "Print a live progress line.")
    verbose: bool = knob(
        False,
        "Show everything vLLM, DeepSpeed, torch and transformers print (their info lines, "
        "harmless warnings, load bars); off: only their errors and hybridrl's own lines.",
    )
    tensorboard: bool = knob(False, "Also write TensorBoard events to <run_dir>/tensorboard (needs the 'log' extra).")
    wandb: bool = knob(False, "Also log to Weights & Biases (needs the 'log' extra).")
    wandb_project: str = knob("hybridrl", "Weights & Biases project name.")
    wandb_mode: Literal["auto", "online", "offline"] = knob(
        "auto", "auto = $WANDB_MODE, else online if an API key is set up, else offline (upload with `wandb sync`)."
    )


@dataclass
class CkptConfig(Freezable):
    every: int = knob(200, "Save a checkpoint every N steps (0 = only at the end and on SIGTERM/SIGINT).", valid=">= 0")
    keep: int = knob(2, "Keep the newest N complete checkpoints; older ones are deleted.", valid=">= 1")
    dir: str = knob("{run_dir}/checkpoints", "Where checkpoints go; {run_dir} is the run's directory.")
    write_mb_s: float = knob(
        100.0,
        "The slowest the checkpoint storage is expected to write, in MiB/s for the "
        "whole run: a save may take train.watchdog_s plus its bytes at this speed before the "
        "watchdog stops the run (a 72B run's ~1 TB: about 3 hours at 100).",
        valid="> 0",
    )
    resume: str = knob(
        "",
        "Continue a run: 'auto' = the newest complete checkpoint under log.run_dir if any "
        "(else start fresh), or a run directory (or one of its checkpoints) to continue.",
    )


@dataclass
class Config(Freezable):
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    # 'group.field' -> 'YAML' or 'flag' for every key set explicitly (by load / apply): the recipe
    # fills only the others. Not a config group: not in to_dict, config.yaml or the CLI.
    sources: dict = field(default_factory=dict, repr=False, compare=False)


GROUPS = [f.name for f in dataclasses.fields(Config) if f.name != "sources"]
ADVANTAGES = tuple(ESTIMATORS)  # the advantage estimators' names (hybridrl/algorithms/estimators.py)

# The demo's recipe: what model.path=demo runs with in the keys the user leaves unset (their source is "demo
# recipe"), where a real model's defaults above do not suit the 0.86M demo model, its task or the 2-core CPU
# machine `make demo` is made for. The task is two-number addition ("12+34=" -> "46": a few prompt tokens, an
# answer of two digits and EOS), the model has 64 positions. lr and batch were chosen by measurement
# (bench/demo_curve.py: held-out accuracy against wall time). lr: of 3e-5, 5e-5 and 7e-5, 5e-5 learned most in
# the same time (single seeds); 1e-4 learned less even with 50 warm-up steps, and without warm-up it falls
# below the start (Adam's first sign-like steps on a noisy gradient wreck a barely trained model). Batch
# (docs/speed.md, "the demo's batch chosen again"): 32 prompts in two minibatches of 16 reached 75% soonest;
# 16 prompts in one update per rollout, 32 in four minibatches or two epochs took longer, and 8 or 16 prompts
# in one update learn less per second. It lives here, not in recipe.py, because config.py fills it in as a
# config loads: the demo's lengths are checked then, before anything heavy is imported.
DEMO_SOURCE = "demo recipe"
DEMO = {
    "rollout.max_new_tokens": 4,  # two digits and EOS, one token to spare
    "data.max_prompt_len": 48,
    "rollout.max_model_len": 64,  # the demo model's max_position_embeddings
    "train.lr": 5e-5,
    "train.prompts_per_step": 32,  # x rollout.n (8): 256 sequences a step
    "train.minibatches": 2,  # two updates of 16 prompts per rollout
    "train.data_epochs": 0.0,  # train.steps' 600 (~2.5 min), not passes over the prompts
    "train.max_minutes": 8.0,  # `make demo` ends within minutes on a loaded machine too
    "log.eval_every": 100,
}
# data.path=longtail on the demo (tasks/longtail.py, partial rollouts' task): answers of up to 40 digits
# and EOS; the model is the demo model warmed on it (resolve.configure picks hybridrl/demo_model_longtail)
DEMO_LONGTAIL = {
    "rollout.max_new_tokens": 48,
    "data.max_prompt_len": 12,
}
# data.path=code on the demo (tasks/code.py, a function from two of its values): programs of up to 23
# characters and EOS, scored by running them (code_tests); the model is hybridrl/demo_model_code. A step
# costs ~20x the addition's (24-token samples, a sandboxed program each), so fewer, cheaper steps: 16
# prompts in one update (as tests/test_demo_learns.py), 200 of them. lr stays 5e-5: 1e-4 lowered the
# training reward within 20 steps (0.28 -> 0.21), where 5e-5 raised it steadily.
DEMO_CODE = {
    "rollout.max_new_tokens": 28,
    "data.max_prompt_len": 20,
    "reward.fn": "code_tests",
    "train.prompts_per_step": 16,
    "train.minibatches": 1,
    "train.steps": 200,
    "train.max_minutes": 30.0,
    "log.eval_every": 50,
}
# data.path=vision on the demo (tasks/cells.py, "what colour is cell 3?" of an image of four cells): colour
# names of up to 6 characters and EOS, scored by exact_match; the model is hybridrl/demo_model_vision, a tiny
# Qwen2-VL whose image is 4 tokens.
DEMO_VISION = {
    "rollout.max_new_tokens": 8,
    "data.max_prompt_len": 40,
    "reward.fn": "exact_match",
}
DEMO_TASKS = {"demo": {}, "longtail": DEMO_LONGTAIL, "code": DEMO_CODE, "vision": DEMO_VISION}  # built-in data.path
