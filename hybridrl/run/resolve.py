"""A run's configuration, resolved once, before any engine starts: `run_config`.

The config as loaded (defaults <- YAML <- flags, and the demo's recipe for the demo) becomes the
one a run uses in five stages, each filling only what the user left unset:

    machine      this machine's 'auto' settings: model.dtype, model.attn_implementation
    recipe       the model's (recipe.resolve): lengths and context, the CPU KV cache, with LoRA
                 vLLM's sleep level 1, on CPU the dtype, attention and compiled decoder of a real-size model
    memory plan  what fits the device (plan.fit): micro-batch tokens, ZeRO stage, offloading, ...
    data         rollout.max_model_len at the data's longest prompt (recipe.fit_to_data), so the
                 plan counts the prompts the run has, not data.max_prompt_len's cap; train.steps
                 from train.data_epochs and the prompts left once too-long ones drop
    resume       a resumed run's directory (checkpoint.Resume.find)

and the trainer's layout (kernels, packing, shared prompt: policy.layout) is decided from it, so
the recipe the run prints (recipe.describe) says what the engines will do. `hybridrl train`
(loop.train) resolves with `run_config`, `hybridrl eval` with `eval_config`, the benches, which do not train,
with `configure` (machine and recipe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hybridrl.core import launch, memory, models, platform, recipe
from hybridrl.core.config import Config, ConfigError, freeze, put
from hybridrl.cycle import plan
from hybridrl.data.images import Vision
from hybridrl.data.prompts import encode, load_rows, template_choice
from hybridrl.engines import policy
from hybridrl.run import checkpoint

log = logging.getLogger("hybridrl")


@dataclass
class Resolved:
    """A run's resolved config, with what resolving it read: the model, its tokenizer, the training
    prompts (encoded, the too-long and malformed ones counted in `dropped`)."""

    cfg: Config
    model_path: str  # the directory (or hub name) the engines load
    info: models.ModelInfo
    tokenizer: object
    prompts: list
    dropped: dict
    heldout: list  # the held-out prompts evaluated (log.eval_size of them), encoded like `prompts`
    chat: dict  # what data.chat_template=auto did, for the recipe printed at start (prompts.template_choice)
    layout: policy.Layout  # what the trainer will run with (recipe.describe's `engines`)
    resumed: checkpoint.Resume | None = None  # the checkpoint the run continues from (ckpt.resume)
    vision: Vision | None = None  # how a vision-language model takes images; None for a text model


def run_config(cfg: Config, world) -> Resolved:
    """The config `hybridrl train` runs with: this machine's 'auto' settings, the model's recipe
    (a bad model fails here, in one line), the memory plan from what the fullest rank has free (a
    run that cannot fit stops here, in one line), the steps from the data; and the trainer's layout.
    Collective: every rank calls it (the plan and bfloat16 on CPU are agreed over the ranks)."""
    on_cpu = world.device.type == "cpu"
    cfg, model_path, info = configure(cfg, on_cpu, world.size)  # the demo's recipe, or a real model's defaults
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.algo.teacher:  # before any engine: the teacher scores the student's token ids
        models.check_teacher(
            cfg.algo.teacher,
            tokenizer,
            model_path,
            trust_remote_code=cfg.model.trust_remote_code,
            full=cfg.algo.distill_loss == "full",
        )
    vision = Vision.of(model_path, tokenizer)  # None: a text-only model, which refuses rows with images
    rows = load_rows(cfg.data, "train")
    prompts, dropped = encode(rows, tokenizer, cfg.data, cfg.data.path, vision)
    heldout = encode(load_rows(cfg.data, "heldout"), tokenizer, cfg.data, "held-out", vision)[0]
    heldout = heldout[: cfg.log.eval_size or None]
    cfg = recipe.fit_to_data(
        cfg, info, max((p.length for p in prompts + heldout), default=0), on_cpu=on_cpu, world_size=world.size
    )  # the context the data needs, before the plan counts it
    cfg = plan_memory(cfg, model_path, world, on_cpu)  # every phase on the device; what the user left unset
    vision_limits(cfg, vision, prompts + heldout)  # what images do not go with yet (the plan's ZeRO stage too)
    if cfg.train.prompts_per_step % world.size:
        raise ConfigError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by the {world.size} ranks"
        )
    sp = cfg.train.sequence_parallel_size
    if world.size % sp:
        raise ConfigError(
            f"train.sequence_parallel_size={sp} must divide the {world.size} ranks: use --nproc a multiple of {sp}"
        )
    heads = (
        getattr(
            AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code).get_text_config(),
            "num_attention_heads",
            sp,
        )
        if sp > 1
        else sp
    )
    if heads % sp:
        raise ConfigError(
            f"train.sequence_parallel_size={sp} must divide the model's {heads} attention heads (each "
            "rank of the group attends with its share of them)"
        )
    cfg = recipe.set_steps(cfg, len(prompts))  # train.data_epochs -> train.steps
    resumed = checkpoint.Resume.find(cfg, world)  # None: a fresh run
    if resumed:  # continue in that run's directory
        cfg = put(cfg, "log.run_dir", str(resumed.run_dir), "the resumed run")
    layout = policy.layout(
        cfg, cfg.model.attn_implementation, native=info.native, plain_cache=info.plain_cache, name=info.arch
    )
    # frozen from here: what the engines read is what the run prints and records (plan_rollout's
    # measured sizes come back beside it, engine_cycle.plan_rollout)
    return Resolved(
        freeze(cfg),
        model_path,
        info,
        tokenizer,
        prompts,
        dropped,
        heldout,
        template_choice(rows, tokenizer, cfg.data),
        layout,
        resumed,
        vision,
    )


def vision_limits(cfg: Config, vision: Vision | None, prompts: list) -> None:
    """What a vision-language run does not do yet stops here, before any engine starts, in one line
    naming the setting to change (docs/vision.md's limits). A text model passes. (An out-of-process
    vLLM would need vllm_compat.images_without_torchvision in its own process too.)"""
    if vision is None:
        return
    name = vision.family.model_type
    for bad, what, fix in (
        (cfg.train.sequence_parallel_size > 1, "sequence parallelism", "set train.sequence_parallel_size 1"),
        (cfg.rollout.partial == "on", "partial rollouts", "set rollout.partial off"),
        (cfg.rollout.mode == "outofprocess", "an out-of-process vLLM", "set rollout.mode inprocess"),
        (bool(cfg.algo.teacher), "a distillation teacher", "unset algo.teacher"),
    ):  # fmt: skip
        if bad:
            raise ConfigError(f"a vision-language model ({name}): {what} is not wired for images yet; {fix}")
    # ZeRO-3 gathers the tower's shards on every rank together: a rank whose micro-batch holds no image
    # would skip its forward, and the ranks would wait on each other
    text = sum(not p.images for p in prompts)
    if cfg.train.zero_stage == 3 and text:
        raise ConfigError(
            f"a vision-language model under ZeRO-3: {text} prompt(s) without images, whose micro-batches "
            "would not run the vision tower the other ranks gather; give every prompt an image, or set "
            "train.zero_stage 2"
        )


def eval_config(
    cfg: Config, on_cpu: bool, world_size: int = 1, model_dir: str | None = None
) -> tuple[Config, str, models.ModelInfo]:
    """The config `hybridrl eval` runs with: `configure`'s, and on a GPU with
    rollout.gpu_memory_utilization=auto a fixed fraction, since vLLM has the device to itself."""
    cfg, path, info = configure(cfg, on_cpu, world_size, model_dir)
    if not on_cpu and cfg.rollout.gpu_memory_utilization == "auto":
        cfg = put(cfg, "rollout.gpu_memory_utilization", "0.85", "hybridrl eval")
    return freeze(cfg), path, info


def configure(
    cfg: Config, on_cpu: bool, world_size: int = 1, model_dir: str | None = None
) -> tuple[Config, str, models.ModelInfo]:
    """The config a run uses: this machine's 'auto' settings (`machine`), then the recipe for the
    model (`models.inspect`: a bad model fails here, in one line, before any engine starts), with
    bfloat16 on CPU only where every rank's CPU has AMX-BF16. `model_dir`: where the model's files
    are when not at model.path (`hybridrl eval` of a run's exported checkpoint).
    Returns (config, model directory, model info)."""
    cfg, path = machine(cfg, on_cpu)
    from hybridrl.data import tasks

    if model_dir is None and cfg.model.path == "demo" and cfg.data.path in tasks.BUILT_IN:
        own = getattr(tasks.task(cfg.data.path), "MODEL_DIR", None)  # the demo model warmed on that task
        model_dir = str(own) if own else None
    info = models.inspect(model_dir or cfg.model.path, cfg.model.trust_remote_code)
    fast_bf16 = on_cpu and not launch.all_max(float(not platform.current().amx_bf16))
    cfg = recipe.resolve(cfg, info, on_cpu=on_cpu, world_size=world_size, fast_bf16=fast_bf16)
    return cfg, model_dir or path, info


def machine(cfg: Config, on_cpu: bool) -> tuple[Config, str]:
    """Fill the 'auto' settings for this machine; returns the config and the model directory."""
    cfg = recipe.auto_dtype(cfg, on_cpu)
    m = cfg.model
    if m.attn_implementation == "auto":  # recipe.resolve may still pick eager (short contexts in bfloat16 on CPU)
        attn = "sdpa"
        if not on_cpu:
            try:
                import flash_attn  # noqa: F401

                attn = "flash_attention_2"
            except ImportError:
                pass
        cfg = put(cfg, "model.attn_implementation", attn, "auto")
    if on_cpu and m.dtype != "float32" and not platform.current().amx_bf16:
        log.warning(
            "model.dtype=%s on a CPU without AMX-BF16: often slower than float32 there "
            "(docs/speed.md); compare with --model.dtype float32",
            m.dtype,
        )
    return cfg, models.local_path(m.path)


def plan_memory(cfg: Config, model_path: str, world, on_cpu: bool) -> Config:
    """The memory plan (plan.py) before any engine starts, from what the fullest rank has free:
    its choices go into the config, a run that cannot fit stops here in one line."""
    budget, host = memory.plan_budget(cuda=not on_cpu)
    cfg, mem = plan.fit(
        cfg,
        model_path,
        world=world.size,
        local=memory.local_ranks(),
        device=int(-launch.all_max(-budget)),
        host=host,
        on_cpu=on_cpu,
    )
    if mem is not None and world.main:
        print(plan.summary(mem) if on_cpu else mem.table(cfg.model.path), flush=True)
    return cfg
