"""The whole run's configuration: one typed dataclass tree.

Every field has help text (shown by `hybridrl train --help`, grouped by section) and a default
that runs on the embedded demo. YAML files and dotted overrides (`algo.clip_high=0.28`) are
applied on top; an unknown key is an error that names the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


def knob(default: Any, help: str, **kw) -> Any:
    """A config field with its help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    path: str = knob("demo", "Policy model: a local HF directory, a hub name, or 'demo' (the shipped tiny model).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "Weight/compute dtype for both engines; auto = float32 on CPU, bfloat16 on GPU.")
    attn_implementation: str = knob("auto", "transformers attention: auto = flash_attention_2 if installed on GPU, else sdpa.")
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward to save trainer memory.")
    trust_remote_code: bool = knob(False, "Allow custom modelling code from the model directory.")


@dataclass
class RolloutConfig:
    n: int = knob(8, "Samples generated per prompt (the GRPO group size).")
    temperature: float = knob(1.0, "Sampling temperature; the trainer scores log-probs at the same temperature.")
    top_p: float = knob(1.0, "Nucleus sampling.")
    max_new_tokens: int = knob(4, "Longest completion, in tokens.")
    max_model_len: int = knob(64, "vLLM context length (prompt + completion).")
    tensor_parallel_size: int = knob(1, "vLLM tensor-parallel size inside each group of ranks.")
    gpu_memory_utilization: float = knob(0.5, "GPU only: fraction of device memory vLLM may use (weights + KV cache).")
    kv_cache_mb: int = knob(64, "CPU only (and GPU if > 0 and gpu_memory_utilization is 0): KV cache size in MiB.")
    enable_prefix_caching: bool = knob(True, "Reuse a prompt's KV cache across its n samples.")
    enforce_eager: bool = knob(True, "Skip graph capture/compilation (fast start; best for small models and CPU).")
    sleep_level: int = knob(1, "vLLM sleep level between rollouts on GPU (1: weights to CPU, 2: discard weights).")


@dataclass
class TrainConfig:
    # The demo recipe, chosen by measurement on the 2-core CPU machine (bench/demo_curve.py; single seeds,
    # held-out accuracy after 2.5 min from 21.9%): lr 3e-5 -> 54%, 5e-5 -> 64%, 7e-5 -> 56%,
    # 1e-4 with 50 warm-up steps -> 50%, and 1e-4 without warm-up falls below the start (Adam's first
    # sign-like steps on a noisy gradient wreck a barely trained model). At lr 3e-5, 16 prompts/step beat 64
    # (54% vs 30%): at this size a step costs mostly fixed overhead, so more, smaller steps learn faster.
    steps: int = knob(1200, "Number of RL steps (rollout + update). The demo takes ~4 min on 2 CPU cores.")
    max_minutes: float = knob(8.0, "Stop after this much wall time after engine start (0 = no limit).")
    prompts_per_step: int = knob(16, "Prompts per step across all ranks (each yields rollout.n samples).")
    lr: float = knob(5e-5, "AdamW learning rate.")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    betas: list = knob([0.9, 0.99], "AdamW betas.")
    warmup_steps: int = knob(0, "Linear learning-rate warm-up steps.")
    grad_clip: float = knob(1.0, "Gradient-norm clip (0 = off).")
    zero_stage: int = knob(2, "DeepSpeed ZeRO stage (2 or 3).")
    epochs: int = knob(1, "Passes over each rollout batch (PPO epochs).")
    minibatches: int = knob(1, "Optimizer steps per epoch; > 1 makes later steps off-policy (ratio != 1).")
    max_tokens_per_micro_batch: int = knob(8192, "Token budget of one forward/backward; micro-batches accumulate.")
    kernels: Literal["auto", "triton", "torch", "liger", "naive"] = knob(
        "auto", "Log-prob/loss provider: auto = Triton on CUDA, chunked torch on CPU; liger = Liger-Kernel's fused "
        "GRPO loss (clipped surrogate only); naive = full logits (reference).")
    logprob_chunk: int = knob(1024, "Tokens per chunk in the chunked log-prob path.")
    sync_bucket_mb: int = knob(256, "Weight hand-off bucket size: ZeRO-3 params are gathered this many MiB at a time.")
    probe_every: int = knob(1, "Check vLLM vs trainer log-probs on a probe batch every N hand-offs (0 = off).")
    probe_tol: float = knob(1e-3, "Largest allowed |logp_vllm - logp_trainer| on the probe batch.")
    probe_action: Literal["error", "warn"] = knob("error", "What a failed probe does.")
    seed: int = knob(0, "Seeds everything: data order, torch, and vLLM sampling (seed + rank on each rank).")


@dataclass
class AlgoConfig:
    advantage: str = knob("grpo", "Advantage estimator: grpo | dr_grpo | rloo.")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = knob(
        "token_mean", "How token losses are reduced (DAPO token_mean, GRPO seq_mean_token_mean, Dr.GRPO sum_norm).")
    clip_low: float = knob(0.2, "PPO clip epsilon below 1.")
    clip_high: float = knob(0.28, "PPO clip epsilon above 1 (DAPO clip-higher).")
    dual_clip: float = knob(0.0, "Dual-clip constant c > 1 for negative advantages (0 = off).")
    kl_coef: float = knob(0.0, "Weight of KL to the initial policy in the loss (0 = no reference model).")
    kl_type: Literal["k1", "k2", "k3"] = knob("k3", "KL estimator.")
    entropy_coef: float = knob(0.0, "Entropy bonus weight.")
    tis_cap: float = knob(0.0, "Truncated importance-sampling cap against vLLM log-probs (0 = off).")
    skip_zero_advantage: bool = knob(True, "Train only on samples with a non-zero advantage; groups whose rewards are "
                                     "all equal carry no gradient. The loss normaliser then counts only the kept "
                                     "tokens, as with DAPO's dynamic sampling.")
    dynamic_sampling: bool = knob(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and generate "
                                  "more prompts until train.prompts_per_step groups carry signal.")
    dynamic_sampling_max_rounds: int = knob(4, "Most generation rounds per step with dynamic sampling; at the cap the "
                                            "step trains on the groups it has (counted in ds_cap_hits).")
    overlong_buffer: int = knob(0, "DAPO soft overlong punishment: the last N tokens before rollout.max_new_tokens "
                                "cost up to overlong_penalty, linearly (0 = off).")
    overlong_penalty: float = knob(1.0, "Reward subtracted at the length limit by the overlong buffer.")
    overlong_filter: bool = knob(False, "DAPO overlong filtering: samples cut off by rollout.max_new_tokens (not "
                                 "stopped by EOS) are masked out of the loss.")


@dataclass
class RewardConfig:
    fn: str = knob("arithmetic", "Reward: comma-separated terms NAME[:WEIGHT], each a built-in (arithmetic, "
                   "exact_match, math_verify, format) or module:function with fn(prompt, completion, answer) -> float "
                   "(async def too; batched if fn.batched), e.g. math_verify:1.0,format:0.1.")
    on_error: Literal["zero", "raise"] = knob("zero", "A reward function that raises, hangs past timeout_s or kills "
                                              "its worker scores 0 (counted, dead-lettered) or stops the run.")
    workers: int = knob(-1, "Reward worker processes (0 = in this process, no timeout for plain functions; "
                        "-1 = auto: in-process for the built-in arithmetic/exact_match/format, else min(4, CPUs)).")
    timeout_s: float = knob(30.0, "Per-call reward timeout in seconds; the hung worker is killed and replaced.")
    format_pattern: str = knob(r"<think>.*?</think>\s*<answer>.*?</answer>",
                               "Regular expression the whole completion must match for the 'format' reward.")


@dataclass
class DataConfig:
    path: str = knob("demo", "Prompts: 'demo' (built-in addition task) or a .jsonl/.json/.parquet/.csv file.")
    heldout_path: str = knob("", "Held-out prompts for evaluation (default: the demo's held-out split, or none).")
    prompt_key: str = knob("prompt", "Column holding the prompt text.")
    answer_key: str = knob("answer", "Column holding the reference answer passed to the reward.")
    max_prompt_len: int = knob(48, "Prompts longer than this many tokens are dropped (counted).")
    chat_template: Literal["auto", "on", "off"] = knob(
        "auto", "Wrap prompts in the tokenizer's chat template (auto = if the tokenizer has one).")


@dataclass
class LogConfig:
    run_dir: str = knob("runs/{time}", "Where metrics.jsonl, the config and checkpoints go.")
    eval_every: int = knob(100, "Held-out greedy evaluation every N steps (0 = only at start and end).")
    eval_every_s: float = knob(0.0, "Also evaluate once this many seconds have passed since the last evaluation (0 = off).")
    eval_size: int = knob(256, "Held-out prompts evaluated (0 = all).")
    progress: bool = knob(True, "Print a live progress line.")
    tensorboard: bool = knob(False, "Also write TensorBoard events to <run_dir>/tensorboard (needs the 'log' extra).")
    wandb: bool = knob(False, "Also log to Weights & Biases (needs the 'log' extra).")
    wandb_project: str = knob("hybridrl", "Weights & Biases project name.")
    wandb_mode: Literal["auto", "online", "offline"] = knob(
        "auto", "auto = $WANDB_MODE, else online if an API key is set up, else offline (upload with `wandb sync`).")


@dataclass
class CkptConfig:
    every: int = knob(200, "Save a checkpoint every N steps (0 = only at the end and on SIGTERM/SIGINT).")
    keep: int = knob(2, "Keep the newest N complete checkpoints; older ones are deleted.")
    dir: str = knob("{run_dir}/checkpoints", "Where checkpoints go; {run_dir} is the run's directory.")
    resume: str = knob("", "Continue a run: 'auto' = the newest complete checkpoint under log.run_dir if any "
                       "(else start fresh), or a run directory (or one of its checkpoints) to continue.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)


GROUPS = [f.name for f in dataclasses.fields(Config)]


class UserError(ValueError):
    """Bad input from the user (config, data, reward spec); the message says what to change.
    The CLI prints it without a traceback."""


class ConfigError(UserError):
    """A bad config key or value."""


def leaves(cfg_cls=Config) -> dict[str, dataclasses.Field]:
    """All 'group.field' names with their dataclass fields."""
    out = {}
    for g in dataclasses.fields(cfg_cls):
        for f in dataclasses.fields(typing.get_type_hints(cfg_cls)[g.name]):
            out[f"{g.name}.{f.name}"] = f
    return out


def _field_type(group: str, name: str):
    return typing.get_type_hints(typing.get_type_hints(Config)[group])[name]


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key, list(leaves()), n=1, cutoff=0.0)
    return match[0] if match else "?"


def coerce(key: str, value: Any) -> Any:
    """Parse `value` (from YAML or a CLI string) into the declared type of `key`."""
    group, name = key.split(".", 1)
    tp = _field_type(group, name)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp, origin = args[0], typing.get_origin(args[0])
    try:
        if origin is Literal:
            choices = typing.get_args(tp)
            if str(value) not in [str(c) for c in choices]:
                raise ValueError(f"must be one of {', '.join(map(str, choices))}")
            return str(value)
        if tp is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError("must be true or false")
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if tp in (int, float, str):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError("must be an integer")
            return tp(float(value)) if tp is int and isinstance(value, str) and "e" in value.lower() else tp(value)
        if tp is list or origin is list:
            if isinstance(value, str):
                import yaml
                value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
            return list(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None
    return value


def apply(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys on a copy of `cfg`; unknown keys name the closest valid one."""
    cfg = dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g)) for g in GROUPS})
    valid = leaves()
    for key, value in overrides.items():
        if key not in valid:
            raise ConfigError(f"unknown config key '{key}'; did you mean '{_closest(key)}'?")
        group, name = key.split(".", 1)
        setattr(getattr(cfg, group), name, coerce(key, value))
    validate(cfg)
    return cfg


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "." not in key:  # groups nest one level
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file <- dotted overrides."""
    tree: dict[str, Any] = {}
    if path:
        import yaml
        try:
            tree = flatten(yaml.safe_load(Path(path).read_text()) or {})
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    for key in tree:
        if key in GROUPS:
            raise ConfigError(f"'{key}' in {path} must be a mapping of its fields, e.g. {key}: {{...}}")
    tree.update(overrides or {})
    return apply(Config(), tree)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def validate(cfg: Config) -> None:
    """Cross-field checks with the fix in the message."""
    t, r = cfg.train, cfg.rollout
    checks = [
        (t.zero_stage in (2, 3), "train.zero_stage must be 2 or 3"),
        (r.n >= 1, "rollout.n must be >= 1"),
        (t.prompts_per_step >= 1, "train.prompts_per_step must be >= 1"),
        (t.minibatches >= 1 and t.epochs >= 1, "train.minibatches and train.epochs must be >= 1"),
        (0 <= cfg.algo.clip_low < 1 and cfg.algo.clip_high >= 0, "algo.clip_low must be in [0, 1), clip_high >= 0"),
        (cfg.algo.dual_clip == 0 or cfg.algo.dual_clip > 1, "algo.dual_clip must be 0 (off) or > 1"),
        (r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
         f"data.max_prompt_len + rollout.max_new_tokens must fit rollout.max_model_len "
         f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len}): raise rollout.max_model_len"),
        (cfg.ckpt.every >= 0 and cfg.ckpt.keep >= 1, "ckpt.every must be >= 0 and ckpt.keep >= 1"),
        (cfg.algo.kl_coef == 0, "algo.kl_coef > 0 (reference model) is not supported yet; set it to 0"),
        (cfg.reward.timeout_s > 0, "reward.timeout_s must be > 0"),
        (cfg.algo.dynamic_sampling_max_rounds >= 1, "algo.dynamic_sampling_max_rounds must be >= 1"),
        (0 <= cfg.algo.overlong_buffer <= r.max_new_tokens,
         f"algo.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}]"),
        (cfg.algo.advantage in ("grpo", "dr_grpo", "rloo"),
         f"algo.advantage={cfg.algo.advantage!r}: choose grpo, dr_grpo or rloo"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
