"""The public API (docs/api.md): every name `hybridrl` exports imports, and the module names user
files imported before the package was grouped into role folders still work. Before:
`import hybridrl.verifiers` failed with "No module named 'hybridrl.verifiers'", so a reward file
written against it stopped every run that named it."""

import asyncio
import importlib
import subprocess
import sys
import textwrap

import pytest

import hybridrl
from hybridrl.data.rewards import evaluate, load_terms

# old module name -> the module it is now (the same object, so patches and isinstance agree)
COMPAT = {
    "hybridrl.verifiers": "hybridrl.data.verifiers",
    "hybridrl.rewards": "hybridrl.data.rewards",
    "hybridrl.envs": "hybridrl.data.envs",
    "hybridrl.tasks": "hybridrl.data.tasks",
    "hybridrl.tasks.arithmetic": "hybridrl.data.tasks.arithmetic",
    "hybridrl.env": "hybridrl.core.environ",
}


@pytest.mark.fast
@pytest.mark.parametrize("name", hybridrl.__all__)
def test_every_public_name_imports(name):
    value = getattr(hybridrl, name)
    assert value is not None
    exec(f"from hybridrl import {name}", {})
    assert name in dir(hybridrl)


@pytest.mark.fast
def test_the_public_api_is_what_the_docs_name():
    expected = {
        "train",
        "Config",
        "load_config",
        "ConfigError",
        "UserError",
        "ToolEnv",
        "PythonEnv",
        "python_tool",
        "batched",
        "exact_match",
        "math_verify",
        "format_check",
        "extract_answer",
        "last_boxed",
    }
    assert set(hybridrl.__all__) == expected
    assert hybridrl.Config is importlib.import_module("hybridrl.core.config").Config
    assert issubclass(hybridrl.ConfigError, hybridrl.UserError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hybridrl.nope  # noqa: B018


@pytest.mark.fast
@pytest.mark.parametrize("old,new", COMPAT.items())
def test_old_module_names_are_the_new_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


@pytest.mark.fast
def test_a_reward_file_written_against_hybridrl_verifiers_scores(tmp_path, monkeypatch):
    (tmp_path / "old_reward.py").write_text(
        textwrap.dedent("""\
        from hybridrl.verifiers import extract_answer, math_verify
        from hybridrl.rewards import batched

        def correct(prompt, completion, answer):
            return math_verify(prompt, completion, answer)

        @batched
        def answered(prompts, completions, answers):
            return [float(extract_answer(c) is not None) for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    terms = load_terms("old_reward:correct,old_reward:answered:0.5")
    values = evaluate(terms, "1/2 as a decimal?", ["\\boxed{0.5}", "no idea"], "1/2")
    assert values == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.fast
def test_an_environment_written_against_hybridrl_envs_runs(tmp_path, monkeypatch):
    (tmp_path / "old_env.py").write_text(
        textwrap.dedent("""\
        from hybridrl.envs import ToolEnv

        def add(a: int, b: int) -> int:
            \"\"\"Add two integers.\"\"\"
            return a + b

        class Calc(ToolEnv):
            tools = [add]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from hybridrl.data.envs import load

    cls = load("old_env:Calc")
    assert issubclass(cls, hybridrl.ToolEnv)
    env = cls()
    env.reset({"prompt": "1+2?", "answer": "3"})
    obs, reward, done, info = asyncio.run(
        env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    )
    assert (obs, done) == ([{"role": "tool", "content": "3"}], False)


def test_import_hybridrl_stays_light():
    """A reward worker or a script's `import hybridrl` pulls in no torch, vLLM or config tree."""
    code = (
        "import sys, hybridrl; print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'hybridrl.core.config') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
