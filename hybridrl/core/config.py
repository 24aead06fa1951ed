"""Loading and checking the run's configuration (its schema, the dataclass tree with every
field's default and help text, is schema.py; its names are re-exported here).

YAML files and dotted overrides (`algo.clip_high=0.28`) are applied on top of the defaults, and
for model.path=demo the demo's recipe (schema.DEMO) fills the keys left unset; an unknown key is
an error that names the closest valid key. Which keys were set (and by what: YAML, flag, the demo
recipe) is kept in `Config.sources`, so that the recipes (here and in recipe.py) fill only the rest.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from hybridrl.algorithms import ESTIMATORS, POLICY_LOSSES, estimator, policy_loss
from hybridrl.core.schema import AlgoConfig  # noqa: F401
from hybridrl.core.schema import (
    ADVANTAGES,
    DEMO,
    DEMO_SOURCE,
    DEMO_TASKS,
    GROUPS,
    CkptConfig,
    Config,
    DataConfig,
    EnvConfig,
    LogConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    knob,
)


class UserError(ValueError):
    """Bad input from the user (config, data, reward spec); the message says what to change.
    The CLI prints it without a traceback."""


class ConfigError(UserError):
    """A bad config key or value."""


def leaves(cfg_cls=Config) -> dict[str, dataclasses.Field]:
    """All 'group.field' names with their dataclass fields."""
    out = {}
    for g in dataclasses.fields(cfg_cls):
        if g.name == "sources":
            continue
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
            if isinstance(value, str):  # '[a, b]' as YAML, else comma-separated items, each YAML or as written
                import yaml

                if value.startswith("["):
                    try:
                        return list(yaml.safe_load(value))
                    except yaml.YAMLError as e:
                        raise ValueError(f"not a YAML list ({e.problem})") from None
                return [_scalar(item) for item in value.split(",")] if value else []
            return list(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None
    return value


def _scalar(text: str) -> Any:
    """A list item from the command line: a number or a word as YAML reads it ('0.9' -> 0.9),
    else the text itself (a stop string like '!' or '</answer>')."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else text


def default(key: str):
    """The schema's default of 'group.field': a real model's."""
    f = leaves()[key]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def get(cfg: Config, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def put(cfg: Config, key: str, value, source: str) -> Config:
    """A copy of `cfg` with 'group.field' = value, set by `source` (a recipe's name, "auto", ...)."""
    group, name = key.split(".")
    return dataclasses.replace(
        cfg, sources={**cfg.sources, key: source}, **{group: dataclasses.replace(getattr(cfg, group), **{name: value})}
    )


class _FrozenSources(dict):
    """A frozen config's `sources`: read like a dict, refusing changes (config.freeze)."""

    def _refuse(self, *args, **kw):
        raise TypeError("the config's sources are frozen with it (config.freeze): config.put returns a copy")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):  # pickled and deep-copied as what it holds, not key by key
        return type(self), (dict(self),)


class _FrozenList(list):
    """A frozen config's list-valued knob (rollout.stop, train.betas, ...): read like a list, refusing
    changes in place."""

    def _refuse(self, *args, **kw):
        raise TypeError("the config's lists are frozen with it (config.freeze): config.put returns a copy")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = remove = pop = clear = sort = (
        reverse
    ) = _refuse

    def __reduce__(self):
        return type(self), (list(self),)


def freeze(cfg: Config) -> Config:
    """A copy of `cfg` that refuses every assignment, to a group's field or to its sources
    (schema.Freezable): the run's resolved config, which the engines read (run/resolve.py). The caller's
    `cfg` stays settable (a notebook may change it for its next run)."""

    def lists(group):
        return {
            f.name: _FrozenList(v) for f in dataclasses.fields(group) if isinstance(v := getattr(group, f.name), list)
        }

    out = dataclasses.replace(
        cfg,
        sources=_FrozenSources(cfg.sources),
        **{g: dataclasses.replace(getattr(cfg, g), **lists(getattr(cfg, g))) for g in GROUPS},
    )
    for obj in (*(getattr(out, g) for g in GROUPS), out):
        object.__setattr__(obj, "_frozen", True)
    return out


def frozen(cfg: Config) -> bool:
    return all(obj.__dict__.get("_frozen", False) for obj in (cfg, *(getattr(cfg, g) for g in GROUPS)))


def explicit(cfg: Config, key: str) -> bool:
    """Set in YAML or by flag, or changed by a script from the value it had: its default, or the
    demo recipe's (not by any other recipe)."""
    src = cfg.sources.get(key)
    if src is None:
        return get(cfg, key) != default(key)
    if src == DEMO_SOURCE and key in _DEMO_KEYS:  # (the demo's KV cache is sized, not in DEMO)
        return get(cfg, key) not in _demo_values(key)
    return src in ("YAML", "flag")


_DEMO_KEYS = set(DEMO).union(*DEMO_TASKS.values())


def _demo_values(key: str) -> list:
    """What the demo's recipe may have put in `key`, for its own task or a built-in one."""
    return [r[key] for r in (DEMO, *DEMO_TASKS.values()) if key in r]


def demo_recipe(cfg: Config) -> Config:
    """For model.path=demo, the demo's recipe (schema.DEMO) in every key of it left unset. For any
    other model, the keys it filled go back to their defaults (model.path changed after loading)."""
    demo = cfg.model.path == "demo"
    # a built-in task (data.path=longtail, code) has its own lengths, and code its reward
    recipe = {**DEMO, **DEMO_TASKS.get(cfg.data.path, {})} if demo else {}
    for key in sorted(_DEMO_KEYS):
        if explicit(cfg, key):
            continue
        if key in recipe and (cfg.sources.get(key) != DEMO_SOURCE or get(cfg, key) != recipe[key]):
            cfg = put(cfg, key, recipe[key], DEMO_SOURCE)
        elif key not in recipe and cfg.sources.get(key) == DEMO_SOURCE:
            cfg = put(cfg, key, default(key), DEMO_SOURCE)
            del cfg.sources[key]  # put copied the sources: this config's own
    return cfg


def apply(cfg: Config, overrides: dict[str, Any], source: str | dict[str, str] = "flag") -> Config:
    """Set dotted keys on a copy of `cfg`, recording in `sources` what set them (`source`, or a
    source per key), then the demo's recipe (`demo_recipe`); unknown keys name the closest valid one."""
    cfg = dataclasses.replace(
        cfg, sources=dict(cfg.sources), **{g: dataclasses.replace(getattr(cfg, g)) for g in GROUPS}
    )
    valid = leaves()
    for key, value in overrides.items():
        if key not in valid:
            raise ConfigError(f"unknown config key '{key}'; did you mean '{_closest(key)}'?")
        group, name = key.split(".", 1)
        setattr(getattr(cfg, group), name, coerce(key, value))
        cfg.sources[key] = source if isinstance(source, str) else source[key]
    cfg = demo_recipe(cfg)
    validate(cfg, lengths=cfg.model.path == "demo")  # other models: once the recipe has set the lengths
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
    """Defaults <- YAML file <- dotted overrides (<- the demo's recipe, for the demo)."""
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
    sources = {**{k: "YAML" for k in tree}, **{k: "flag" for k in overrides or {}}}
    tree.update(overrides or {})
    return apply(Config(), tree, sources)


def to_dict(cfg: Config) -> dict:
    return {
        g: {k: list(v) if isinstance(v, list) else v for k, v in dataclasses.asdict(getattr(cfg, g)).items()}
        for g in GROUPS
    }  # a frozen config's lists as plain ones (YAML writes no subclass)


def validate(cfg: Config, lengths: bool = True) -> None:
    """Cross-field checks with the fix in the message. `lengths=False` leaves out the checks of
    the lengths the recipe has yet to set (recipe.resolve runs them all)."""
    for key, f in leaves().items():  # first each number's own range (schema.knob's `valid`), then across fields
        spec = f.metadata.get("valid")
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if spec and not in_range(value, spec):
            allowed = (
                spec
                if " or " in spec
                else "a finite number" + ("" if spec == "finite" else f" {'in ' * (spec[0] in '[(')}{spec}")
            )
            why = f.metadata.get("why")
            raise ConfigError(f"{key}={value!r}: must be {allowed}{f'; {why}' if why else ''}")
    t, r = cfg.train, cfg.rollout
    for key, specs in (("algo.advantage", ESTIMATORS), ("algo.policy_loss", POLICY_LOSSES)):
        if get(cfg, key) not in specs:  # a Config built in Python skips coerce's Literal check
            raise ConfigError(f"{key}={get(cfg, key)!r}: choose {', '.join(specs)}")
    loss, adv = policy_loss(cfg.algo.policy_loss), estimator(cfg.algo.advantage)
    length_checks = [
        (
            cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
            f"data.max_prompt_len + rollout.max_new_tokens must fit rollout.max_model_len "
            f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len}): raise rollout.max_model_len",
        ),
        (
            0 <= cfg.algo.overlong_buffer <= r.max_new_tokens,
            f"algo.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}]",
        ),
    ]
    checks = length_checks * lengths + [
        (
            cfg.algo.dual_clip == 0 or "algo.dual_clip" in loss.knobs().values(),
            f"algo.dual_clip bounds a clipped surrogate, which algo.policy_loss={loss.name} has not: "
            "set algo.dual_clip 0",
        ),
        (
            cfg.algo.tis_cap == 0 or cfg.algo.is_correction == "tis",
            "algo.tis_cap truncates the weight, algo.is_correction=mask masks it: set algo.tis_cap 0 with mask",
        ),
        (
            cfg.algo.old_logprobs != "rollout" or not (cfg.algo.tis_cap or cfg.algo.is_correction == "mask"),
            "algo.old_logprobs=rollout makes the importance weight pi_old / pi_vllm 1: use algo.old_logprobs trainer "
            "(or auto) with TIS or masked IS",
        ),
        (
            t.kernels != "liger" or (cfg.algo.kl_coef == 0 and not adv.per_token),
            f"train.kernels=liger takes one advantage per sample and no KL: use train.kernels=auto with "
            f"algo.kl_coef > 0 or algo.advantage {adv.name}",
        ),
        (
            t.kernels != "liger" or not cfg.algo.teacher,
            "train.kernels=liger takes one advantage per sample, and algo.teacher gives one per token: use "
            "train.kernels=auto",
        ),
        (
            cfg.algo.distill_loss == "sampled" or cfg.algo.teacher,
            "algo.distill_loss=full needs a teacher: set algo.teacher",
        ),
        (
            cfg.algo.distill_loss == "sampled" or t.sequence_parallel_size == 1,
            "algo.distill_loss=full does not split a sequence's teacher hidden states over ranks yet: use "
            "train.sequence_parallel_size 1 or algo.distill_loss sampled",
        ),
        (
            not cfg.algo.teacher or cfg.algo.teacher != cfg.model.path,
            f"algo.teacher={cfg.algo.teacher} is the policy itself: its reverse KL is 0 at the start and "
            "teaches nothing; name a stronger model",
        ),
        (
            t.kernels != "liger" or loss.liger is not None,
            f"train.kernels=liger has no {loss.name}: use algo.policy_loss "
            f"{'/'.join(n for n, spec in POLICY_LOSSES.items() if spec.liger)} or train.kernels=auto",
        ),
        (
            t.kernels != "liger" or loss.liger is None or not loss.liger.needs(cfg.algo),
            loss.liger and loss.liger.needs(cfg.algo),
        ),
        (
            _fraction_or_auto(r.gpu_memory_utilization),
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization!r}: use auto or a fraction in (0, 1]",
        ),
        # DeepSpeed's engine.offload_states asserts that the parameters are not offloaded, and the trainer
        # moves its states off the device with it whenever the optimizer stays on the device
        (
            not (t.param_offload == "on" and t.optimizer_offload == "off"),
            "train.param_offload=on needs the optimizer in host memory too (DeepSpeed cannot move the states of an "
            "engine with offloaded parameters off the device while vLLM runs): set train.optimizer_offload on or auto",
        ),
        (
            not (t.offload_params and t.probe_every),
            "train.offload_params needs train.probe_every=0: the probe's "
            "trainer forward runs after the hand-off, when the parameters would be off the device",
        ),
        (
            r.partial == "off" or not cfg.env.cls,
            "rollout.partial=on continues single-turn samples; a multi-turn "
            "episode (env.cls) cannot be cut and resumed yet: set rollout.partial off",
        ),
        (
            r.partial == "off" or not cfg.algo.dynamic_sampling,
            "rollout.partial=on already over-samples and keeps "
            "groups across steps; DAPO's dynamic sampling rounds do not compose with it: set algo.dynamic_sampling "
            "false or rollout.partial off",
        ),
        (
            r.partial == "off" or r.tensor_parallel_size == 1,
            "rollout.partial=on aborts requests on its own engine; "
            "a tensor-parallel group would have to abort the same ones at the same engine step on every rank: set "
            "rollout.tensor_parallel_size 1 or rollout.partial off",
        ),
        (
            r.partial == "off"
            or cfg.algo.tis_cap
            or cfg.algo.is_correction == "mask"
            or not explicit(cfg, "algo.tis_cap"),
            "rollout.partial=on trains tokens an older policy sampled and needs the importance correction: set "
            "algo.tis_cap > 0 (unset: 2) or algo.is_correction mask",
        ),
        (
            r.partial == "off" or cfg.algo.routing_replay != "on",
            "rollout.partial=on does not carry a sample's MoE "
            "routes across steps: set algo.routing_replay auto/off or rollout.partial off",
        ),
        (
            r.tensor_parallel_size == 1 or r.mode == "inprocess",
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} runs vLLM inside the ranks "
            "(its external launcher): use rollout.mode=inprocess",
        ),
        (
            t.sequence_parallel_size == 1 or not _sequence_level(cfg),
            f"train.sequence_parallel_size={t.sequence_parallel_size} splits a sequence's tokens over ranks, and "
            f"{_sequence_level(cfg)} needs each sequence whole on one rank: use algo.loss_agg token_mean (or "
            "seq_mean_token_sum_norm), algo.policy_loss "
            f"{'/'.join(n for n, p in POLICY_LOSSES.items() if not p.sequence)}, algo.tis_level token "
            "and train.kernels auto/torch/triton, or train.sequence_parallel_size 1",
        ),
        # the critic trains on whole padded rows: under SP a sequence of up to S x the budget would be one
        # critic micro-batch, activations the plan does not count (its slices are not built yet)
        (
            t.sequence_parallel_size == 1 or not adv.critic,
            f"algo.advantage={adv.name} with train.sequence_parallel_size={t.sequence_parallel_size}: "
            "the critic scores and trains on whole sequences, not sequence-parallel slices; "
            "use an advantage without a critic "
            f"({', '.join(n for n, spec in ESTIMATORS.items() if not spec.critic)}) or train.sequence_parallel_size 1",
        ),
        (
            t.sequence_parallel_size == 1 or cfg.algo.routing_replay != "on",
            f"algo.routing_replay=on with train.sequence_parallel_size={t.sequence_parallel_size}: replaying vLLM's "
            "experts over sequence-parallel slices is not built yet; set algo.routing_replay auto (off under SP) or "
            "train.sequence_parallel_size 1",
        ),
        (
            not cfg.env.cls or cfg.algo.routing_replay != "on",
            "algo.routing_replay=on with env.cls: a multi-turn episode's routes are not recorded yet (its later turns "
            "are requests of their own); set algo.routing_replay auto (the trainer routes episodes itself) or off",
        ),
        (
            cfg.model.dtype != "float16",
            "model.dtype=float16 is not supported: the trainer configures no loss scaling, so small gradients would "
            "underflow to zero; use model.dtype=bfloat16 (or float32)",
        ),
        (
            not cfg.model.lora_rank
            or (
                cfg.model.lora_alpha > 0 and 0 <= cfg.model.lora_dropout < 1 and len(cfg.model.lora_target_modules) > 0
            ),
            "with model.lora_rank > 0: model.lora_alpha must be > 0, model.lora_dropout in [0, 1) and "
            "model.lora_target_modules non-empty",
        ),
        # vLLM's processed log-probs of a truncated distribution are renormalised over what is kept; the
        # trainer scores the full softmax, so every ratio, TIS weight and the probe would be off
        (
            r.top_p == 1.0 and r.top_k in (0, -1) and r.min_p == 0.0,
            f"rollout.top_p={r.top_p}, top_k={r.top_k}, min_p={r.min_p}: vLLM renormalises its log-probs over the "
            "tokens these keep, the trainer scores the full distribution, so the ratios and the probe would be biased; "
            "train with top_p=1, top_k=0, min_p=0 (temperature alone)",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def _sequence_level(cfg: Config) -> str:
    """The first setting whose loss reads a whole sequence at once (a per-sequence mean, ratio or
    weight; Liger's rows), which sequence parallelism's token slices cannot give; '' for none."""
    a = cfg.algo
    for key, bad in (
        ("algo.loss_agg=seq_mean_token_mean", a.loss_agg == "seq_mean_token_mean"),
        (f"algo.policy_loss={a.policy_loss}", policy_loss(a.policy_loss).sequence),
        (f"algo.tis_level={a.tis_level}", a.tis_level != "token"),
        ("train.kernels=liger", cfg.train.kernels == "liger"),
    ):
        if bad:
            return key
    return ""


def in_range(value, spec: str) -> bool:
    """Whether a number is finite and satisfies a range `spec`: 'finite', '> 0', '>= 1', '[0, 1)', '(0, 1]',
    or alternatives joined by ' or ' ('0 or >= 5', '2 or 3')."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return any(_in_one(value, alt.strip()) for alt in spec.split(" or "))


def _in_one(v: float, spec: str) -> bool:
    if spec == "finite":
        return True
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo <= v if spec[0] == "[" else lo < v) and (v <= hi if spec[-1] == "]" else v < hi)
    for op, test in ((">=", float.__ge__), ("<=", float.__le__), (">", float.__gt__), ("<", float.__lt__)):
        if spec.startswith(op):
            return test(float(v), float(spec[len(op) :]))
    return v == float(spec)


# Where each module lived before the package was grouped into role folders (and now lives: core/ is
# the ground floor): a run directory's saved config (or a user's) that names `hybridrl.envs:ToolEnv`
# or `hybridrl.rewards:...` still resolves.
MOVED = {
    "trainer": "engines.trainer",
    "policy": "engines.policy",
    "critic": "engines.critic",
    "reference": "engines.reference",
    "reward_model": "engines.reward_model",
    "rollout": "engines.rollout",
    "vllm_compat": "engines.vllm_compat",
    "vllm_worker_ext": "engines.vllm_worker_ext",
    "ipc": "engines.ipc",
    "lora": "engines.lora",
    "models": "core.models",
    "zero_step": "engines.deepspeed_compat",
    "engine_cycle": "cycle.engine_cycle",
    "sync": "cycle.sync",
    "plan": "cycle.plan",
    "memory": "core.memory",
    "algo": "algorithms.advantages",
    "dapo": "algorithms.dapo",
    "data": "data.prompts",
    "batch": "data.batch",
    "rewards": "data.rewards",
    "verifiers": "data.verifiers",
    "envs": "data.envs",
    "multiturn": "run.multiturn",
    "collect": "run.collect",
    "tasks": "data.tasks",
    "loop": "run.loop",
    "config": "core.config",
    "schema": "core.schema",
    "recipe": "core.recipe",
    "cli": "run.cli",
    "launch": "core.launch",
    "checkpoint": "run.checkpoint",
    "export": "run.export",
    "evaluate": "run.evaluate",
    "journal": "core.journal",
    "env": "core.environ",
    "progress": "observe.progress",
    "logs": "core.logs",
    "report": "observe.report",
    "canaries": "core.canaries",
    "doctor": "run.doctor",
    "preflight": "run.preflight",
    "faults": "core.faults",
}


def import_spec(key: str, spec: str, name: str, what: str = "attribute"):
    """`name` ('module:attr', from the setting `key`=`spec`) -> the object; a one-line ConfigError
    naming the fix when the module does not import or lacks the attribute."""
    import importlib
    import os
    import sys

    module, _, attr = name.partition(":")
    old = module.split(".")
    if old[0] == "hybridrl" and len(old) > 1 and old[1] in MOVED and (len(old) == 2 or old[1] == "tasks"):
        module = ".".join(["hybridrl", MOVED[old[1]], *old[2:]])
    # the working directory first, as `python -m` puts it (the `hybridrl` console script does not): a
    # spec such as examples.calculator_env:Calc names a module under the directory the user runs from
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ConfigError(
            f"{key}={spec!r}: cannot import {module!r} ({e}); run from the directory that holds "
            "it, or put that directory on PYTHONPATH"
        ) from None
    except AttributeError:
        raise ConfigError(f"{key}={spec!r}: module {module!r} has no {what} {attr!r}") from None


def torch_dtype(name: str):
    """model.dtype's torch.dtype (a resolved name, not 'auto'). torch is imported here, not at the
    top: the CLI reads the config before anything heavy is imported."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _fraction_or_auto(value: str) -> bool:
    try:
        return value == "auto" or 0 < float(value) <= 1
    except ValueError:
        return False


def completion_budget(cfg: Config) -> int:
    """Most tokens in one sample's completion: rollout.max_new_tokens, or with an environment its
    episode budget (assistant and environment tokens together)."""
    if not cfg.env.cls:
        return cfg.rollout.max_new_tokens
    return cfg.env.max_tokens or cfg.rollout.max_new_tokens * cfg.env.max_turns
