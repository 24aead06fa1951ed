"""Every command README.md shows is run by a test.

A command is a line of one of the README's ```sh blocks (its trailing `# comment` dropped, `\\`
continuations joined) or an inline code span that starts with one (`hybridrl ...`, `make ...`,
`python ...`). COMMANDS below maps each to the tests that run it, as pytest node ids. This file
fails for a README command with no entry, for an entry the README no longer shows, and for a node
whose test function does not exist in its file (read with `ast`, not collected: this file starts no
engine and no subprocess, so it stays in the fast tier).

The cheap commands run here, in process, as the `hybridrl` console script would run them:
`hybridrl train --help`, both `hybridrl plan` commands (the 7B plan's output must be the one the
README shows, to the character) and `hybridrl report` on a small run; the `make` targets are read
from the Makefile.

When you add a command to the README, add it to COMMANDS with the test that runs it; when no test
runs it, write one or leave the command out.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# The README's commands -> the tests that run them (or their equivalent at a test's size: a local
# model for a hub name, two ranks for eight). Keys are the commands with whitespace collapsed.
COMMANDS: dict[str, list[str]] = {
    # the first lines: a fresh machine
    "make demo": [
        "tests/test_readme.py::test_make_targets_run_what_the_readme_says",
        "tests/test_demo_learns.py::test_short_demo_run_raises_accuracy_and_reward",
    ],
    "make test": ["tests/test_readme.py::test_make_targets_run_what_the_readme_says"],
    "hybridrl train": [
        "tests/test_demo_learns.py::test_short_demo_run_raises_accuracy_and_reward",
        "tests/test_observability.py::test_demo_run_writes_the_metrics",
    ],
    # training your own model
    "hybridrl train --help": [
        "tests/test_readme.py::test_cheap_commands_run_as_shown",
        "tests/test_config.py::test_cli_help_shows_groups_and_rejects_typos",
        "tests/test_cli.py::test_help_at_80_columns_shows_whole_option_names",
    ],
    "hybridrl train --model Qwen/Qwen2.5-0.5B-Instruct --data train.jsonl --reward math_verify": [
        "tests/test_real_model.py::test_real_model_trains_chat_rows_with_schedule_stop_and_canary",
        "tests/test_train_e2e.py::test_user_data_reward_module_and_bad_rows",
        "tests/test_rewards.py::test_math_verify_equivalences",
    ],
    "hybridrl train --config my.yaml --train.lr 1e-5": [
        "tests/test_real_model.py::test_real_model_trains_chat_rows_with_schedule_stop_and_canary",
        "tests/test_real_model.py::test_yaml_and_flags_win_over_the_recipe",
    ],
    "hybridrl train --steps 50 --algo.advantage gae --algo.kl_coef 0.05": [
        "tests/test_critic.py::test_resume_with_critic_and_reference_is_exact"
    ],
    # from Python: the notebook (a python block, not a command) and the accelerate script
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "examples/accelerate_train.py train.steps=20": ["tests/test_examples.py::test_accelerate_example_runs_two_ranks"],
    "hybridrl plan": ["tests/test_plan.py::test_plan_command_prints_the_7b_table_and_refuses_72b_on_one_gpu"],
    "hybridrl plan --model Qwen/Qwen2.5-7B-Instruct --nproc 8": [
        "tests/test_readme.py::test_the_plan_output_shown_is_todays",
        "tests/test_plan.py::test_plan_command_prints_the_7b_table_and_refuses_72b_on_one_gpu",
    ],
    "hybridrl plan --config examples/recipes/qwen2.5-32b-8xh100.yaml --nproc 8": [
        "tests/test_readme.py::test_cheap_commands_run_as_shown",
        "tests/test_plan.py::test_recipes_fit_8xh100",
    ],
    "hybridrl train --data.path vision": [
        "tests/test_vision_train.py::test_image_prompts_train_and_both_engines_agree_packed_and_padded",
        "tests/test_demo_learns.py::test_the_vision_demo_raises_accuracy_and_reward",
    ],
    "hybridrl plan --config examples/recipes/qwen2.5-vl-7b-8xh100.yaml --nproc 8": [
        "tests/test_plan.py::test_recipes_fit_8xh100",
        "tests/test_plan_vision.py::test_a_vlm_plans_larger_than_its_text_model_by_the_tower",
    ],
    "hybridrl train --data.path code": [
        "tests/test_code_task.py::test_a_code_run_scores_programs_in_the_sandbox",
        "tests/test_code_task.py::test_the_code_demo_learns_from_executed_code",
    ],
    "hybridrl train --data.path longtail --rollout.partial on --train.prompts_per_step 16 --train.minibatches 1": [
        "tests/test_partial.py::test_longtail_task_runs_with_partial_rollouts"
    ],
    "hybridrl train --nproc 2 --rollout.tensor_parallel_size 2": [
        "tests/test_tensor_parallel.py::test_two_ranks_share_one_engine"
    ],
    "hybridrl train --nproc 2 --train.sequence_parallel_size 2 --train.max_tokens_per_micro_batch 6": [
        "tests/test_sequence_parallel.py::test_train_with_sequences_longer_than_a_micro_batch",
        "tests/test_sequence_parallel.py::test_sequence_parallel_equals_one_rank",
    ],
    "hybridrl train --model.lora_rank 16 --train.lr 3e-4": [
        "tests/test_lora.py::test_lora_demo_run_learns",
        "tests/test_lora.py::test_hand_off_moves_only_the_adapter_and_vllm_agrees",
    ],
    "hybridrl export runs/RUN OUT --merged": ["tests/test_lora.py::test_export_writes_an_adapter_peft_and_vllm_load"],
    "python examples/make_tool_demo_model.py": [
        "tests/test_tool_demo.py::test_readme_commands_from_a_fresh_clone",
        "tests/test_tool_demo.py::test_tool_demo_learns_to_call_the_calculator",
    ],
    "python examples/make_moe_demo_model.py": ["tests/test_moe.py::test_tiny_moe_learns_the_demo_task"],
    "hybridrl train --model runs/moe_demo": [
        "tests/test_moe.py::test_tiny_moe_learns_the_demo_task",
        "tests/test_moe.py::test_moe_trains_out_of_process_with_the_probe_holding",
    ],
    "hybridrl train --config examples/recipes/tool-demo.yaml": [
        "tests/test_tool_demo.py::test_readme_commands_from_a_fresh_clone",
        "tests/test_tool_demo.py::test_the_tool_demo_recipe_imports_its_environment_from_the_working_directory",
    ],
    "hybridrl train --resume auto": [
        "tests/test_faults.py::test_kill_9_mid_step_then_resume_repeats_the_run",
        "tests/test_checkpoint.py::test_signal_stops_after_a_checkpoint_and_resume_auto_continues",
    ],
    "hybridrl export runs/RUN OUT": [
        "tests/test_checkpoint.py::test_export_loads_in_transformers_with_the_trainers_logits"
    ],
    "hybridrl eval runs/RUN --data heldout.jsonl": [
        "tests/test_real_model.py::test_real_model_trains_chat_rows_with_schedule_stop_and_canary"
    ],
    "hybridrl report runs/RUN": [
        "tests/test_readme.py::test_report_on_a_small_run",
        "tests/test_observability.py::test_report_cli_fails_clearly_without_metrics",
        "tests/test_observability.py::test_report_panels_hold_the_run",
    ],
    "hybridrl doctor": ["tests/test_observability.py::test_doctor_reports_this_cpu_machine"],
    # the file map and the tests
    # the rendered tables' footnotes: the bench that measured them (its --help; a real run installs TRL and
    # takes minutes, see docs/testing.md) and the renderer
    "python -m bench.partial_rollout": ["tests/test_bench_results.py::test_every_bench_module_runs_as_a_module"],
    "python -m bench.peers": ["tests/test_bench_results.py::test_every_bench_module_runs_as_a_module"],
    "python -m bench.distill": [
        "tests/test_bench_results.py::test_every_bench_module_runs_as_a_module",
        "tests/test_distill.py::test_distillation_learns_the_teachers_task",
    ],
    "hybridrl train --algo.teacher runs/distill/teacher": [
        "tests/test_distill.py::test_distillation_trains_with_the_probe_holding",
        "tests/test_distill.py::test_distillation_learns_the_teachers_task",
    ],
    "python -m bench.render": [
        "tests/test_bench_results.py::test_the_repository_tables_are_current",
        "tests/test_bench_results.py::test_render_fills_a_marked_region_and_check_finds_it_stale",
    ],
    "make test-fast": ["tests/test_readme.py::test_make_targets_run_what_the_readme_says"],
    "make test-slow": ["tests/test_readme.py::test_make_targets_run_what_the_readme_says"],
    "make gpu-check": [
        "tests/test_readme.py::test_make_targets_run_what_the_readme_says",
        "tests/test_gpu_check.py::test_gpu_check_without_cuda_lists_every_claim_unmeasured",
    ],
}

# What each `make` target the README shows must run (fragments of its recipe).
MAKE = {
    "demo": ["hybridrl train"],
    "test": ["pytest", "not slow"],
    "test-fast": ["pytest", "fast"],
    "test-slow": ["pytest", "slow"],
    "gpu-check": ["gpu_check"],
}
# Targets another branch adds; until it lands their check is skipped, saying so.
PENDING = {"test-fast": "the test tiers (tests/README.md) add it"}

COMMAND_WORDS = ("hybridrl", "make", "python", "python3", "pip", "torchrun", "accelerate", "bash")
LANGUAGES = {"sh", "text", "python", "yaml"}
FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The fenced blocks, as (language, lines), and the lines outside them."""
    out, prose, lang, body = [], [], None, []
    for line in text.splitlines():
        m = FENCE.match(line)
        if lang is None and m:
            lang, body = m.group(1), []
        elif lang is not None and line.strip() == "```":
            out.append((lang, body))
            lang = None
        elif lang is not None:
            body.append(line)
        else:
            prose.append(line)
    assert lang is None, "README.md: a code block is not closed"
    return out, prose


def normal(cmd: str) -> str:
    return " ".join(cmd.split())


def is_command(text: str) -> bool:
    return text.split(maxsplit=1)[0] in COMMAND_WORDS if text.strip() else False


def sh_commands(lines: list[str]) -> list[str]:
    joined, cur = [], ""
    for line in lines:
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()  # a comment, whole-line or trailing
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        if (cur + line).strip():
            joined.append(normal(cur + line))
        cur = ""
    return joined


def inline_commands(prose: list[str]) -> list[str]:
    found = []
    for para in "\n".join(prose).split("\n\n"):
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", para, re.S):
            if is_command(m.group(2)):
                found.append(normal(m.group(2)))
    return found


def readme_commands() -> list[str]:
    bs, prose = blocks(README.read_text())
    cmds = [c for lang, lines in bs if lang == "sh" for c in sh_commands(lines)]
    return list(dict.fromkeys(cmds + inline_commands(prose)))


def cli_app():
    """The `hybridrl` console script's typer app."""
    return importlib.import_module("hybridrl.run.cli").app


def run_cli(*args: str):
    from typer.testing import CliRunner

    return CliRunner().invoke(cli_app(), list(args))


# --- the table and the README agree ------------------------------------------------------------
def test_the_readme_stays_a_guide():
    """What, how, one headline table per area, limits: under 350 lines; measurement history and every
    lease's details live in docs/."""
    assert len(README.read_text().splitlines()) < 350


def test_every_readme_command_has_a_test():
    shown = readme_commands()
    assert shown, "no commands found in README.md"
    missing = [c for c in shown if c not in COMMANDS]
    assert not missing, f"README.md shows commands no test is named for (add them to COMMANDS): {missing}"
    stale = [c for c in COMMANDS if c not in shown]
    assert not stale, f"COMMANDS names commands README.md no longer shows (remove them): {stale}"


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_named_test_exists():
    bad = []
    for cmd, nodes in COMMANDS.items():
        assert nodes, f"{cmd!r}: no test named"
        for node in nodes:
            file, _, func = node.partition("::")
            path = ROOT / file
            if not path.is_file() or func.split("[")[0] not in _test_functions(path):
                bad.append(f"{cmd!r} -> {node}")
    assert not bad, "these test nodes do not exist:\n" + "\n".join(bad)


def test_code_blocks_say_what_they_hold():
    """Every fenced block names its language, so commands (sh) are told from output (text); no
    command hides in a text block or an indented one, where the extraction above would miss it."""
    text = README.read_text()
    bs, prose = blocks(text)
    assert all(lang in LANGUAGES for lang, _ in bs), [lang for lang, _ in bs if lang not in LANGUAGES]
    hidden = [line for lang, lines in bs if lang != "sh" for line in lines if is_command(line.lstrip("$ "))]
    hidden += [line for line in prose if line.startswith("    ") and is_command(line)]
    assert not hidden, f"commands outside ```sh blocks: {hidden}"


# --- the cheap commands, run here --------------------------------------------------------------
@pytest.mark.parametrize(
    "cmd", ["hybridrl train --help", "hybridrl plan --config examples/recipes/qwen2.5-32b-8xh100.yaml --nproc 8"]
)
def test_cheap_commands_run_as_shown(cmd, monkeypatch):
    assert cmd in readme_commands()
    monkeypatch.chdir(ROOT)
    res = run_cli(*cmd.split()[1:])
    assert res.exit_code == 0, res.output[-3000:]
    if cmd.endswith("--help"):
        assert "--train.lr" in res.output and "--model.lora_rank" in res.output
    else:
        assert "(fits)" in res.output and "TP 2" in res.output


def test_the_plan_output_shown_is_todays():
    """The README shows `hybridrl plan --model Qwen/Qwen2.5-7B-Instruct --nproc 8` and, in the
    ```text block right after it, its output: that output is what the command prints now."""
    cmd = "hybridrl plan --model Qwen/Qwen2.5-7B-Instruct --nproc 8"
    bs, _ = blocks(README.read_text())
    at = next(i for i, (lang, lines) in enumerate(bs) if lang == "sh" and cmd in sh_commands(lines))
    lang, shown = bs[at + 1]
    assert lang == "text", "the plan's output should follow its command, in a ```text block"
    res = run_cli(*cmd.split()[1:])
    assert res.exit_code == 0, res.output[-3000:]
    assert res.output.rstrip("\n").splitlines() == shown, (
        "README.md's plan output is not today's; paste this in:\n" + res.output
    )


def test_report_on_a_small_run(tmp_path):
    rows = [
        {
            "step": i,
            "reward": 0.1 * i,
            "loss": 0.5,
            "time/generate": 0.1,
            "time/train": 0.2,
            "heldout_acc": 0.2 + 0.1 * i,
        }
        for i in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_cli("report", str(tmp_path))
    assert res.exit_code == 0, res.output[-3000:]
    assert (tmp_path / "report.png").stat().st_size > 0 and (tmp_path / "report.html").exists()


@pytest.mark.parametrize(
    "cmd", [c for c in COMMANDS if c.startswith("hybridrl train") or c.startswith("hybridrl plan")]
)
def test_train_and_plan_options_exist(cmd):
    """Every option a README `hybridrl train` / `plan` command uses is one the CLI takes (parsed, not
    run: a renamed setting fails here in a second, not in the end-to-end test)."""
    import typer

    words = cmd.split()
    if len(words) < 3 or words[2] == "--help":
        return
    command = typer.main.get_command(cli_app()).commands[words[1]]
    command.make_context(words[1], words[2:])  # raises click's UsageError on an unknown option


# --- make --------------------------------------------------------------------------------------
def _recipe(target: str) -> list[str] | None:
    lines = (ROOT / "Makefile").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^{re.escape(target)}\s*:(?!=)", line):
            out = []
            for body in lines[i + 1 :]:
                if not body.startswith("\t"):
                    break
                out.append(body.strip())
            return out
    return None


@pytest.mark.parametrize("cmd", sorted(c for c in COMMANDS if c.startswith("make ")))
def test_make_targets_run_what_the_readme_says(cmd):
    target = cmd.split()[1]
    assert cmd in readme_commands()
    recipe = _recipe(target)
    if recipe is None and target in PENDING:
        pytest.skip(f"Makefile has no `{target}` yet: {PENDING[target]}")
    assert recipe is not None, f"Makefile has no `{target}` target, which README.md shows"
    text = "\n".join(recipe)
    for frag in MAKE[target]:
        assert frag in text, (target, frag, recipe)
    if target == "demo":  # the embedded demo: `hybridrl train` with no arguments
        assert any(line.endswith("hybridrl train") for line in recipe), recipe
    if target == "test":  # "this is what CI runs: .ci/run"
        assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()
