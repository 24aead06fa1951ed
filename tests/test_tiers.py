"""The fast tier's guard (tiers.py, armed by conftest.py under `-m fast`): a fast test that builds
an engine or starts a Python process fails and says so, also when the code under test catches the
exception; importing vLLM, running other programs and pure tests pass; a test file that marks
nothing fast is not imported. In the default tier itself: it starts a pytest process."""

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util
import sys

sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_configure, pytest_ignore_collect = suite.pytest_configure, suite.pytest_ignore_collect
pytest_runtest_setup, pytest_runtest_call = suite.pytest_runtest_setup, suite.pytest_runtest_call
"""

TESTS_FILE = """
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast


def test_pure():
    assert 1 + 1 == 2


def test_other_programs_run():
    subprocess.run(["true"], check=True)


def test_importing_vllm_is_allowed():
    import vllm  # noqa: F401


def test_python_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])


def test_python_behind_a_wrapper():
    subprocess.run(["sh", "-c", '"$0" -c pass', sys.executable])


def test_caught_by_the_code_under_test():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except Exception:
        pass


def test_multiprocessing_spawn():
    import multiprocessing
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


def test_deepspeed_engine():
    import deepspeed
    deepspeed.runtime.engine.DeepSpeedEngine(args=None, model=None)


def test_vllm_engine():
    from vllm import LLM
    LLM(model="no-such-model")
"""


def test_fast_tier_guard(pytester, monkeypatch):
    # this checkout's hybridrl, as in the suite's own process (run from the repository root)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])))
    pytester.makeini("[pytest]\nmarkers =\n    fast: the fast tier\n")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_inner=TESTS_FILE, test_engines="raise RuntimeError('a file with no fast test was imported')"
    )
    res = pytester.runpytest_subprocess("-m", "fast", "-p", "no:cacheprovider", timeout=300)
    res.assert_outcomes(passed=3, failed=6)
    out = res.stdout.str()
    for name, what in [
        ("test_python_subprocess", "started a Python process"),
        ("test_python_behind_a_wrapper", "started a Python process (sh -c"),
        ("test_caught_by_the_code_under_test", "started a Python process"),
        ("test_multiprocessing_spawn", "spawned a Python process (multiprocessing)"),
        ("test_deepspeed_engine", "built a DeepSpeed engine"),
        ("test_vllm_engine", "started a vLLM engine (vllm.LLM)"),
    ]:
        assert f"fast tier: test_inner.py::{name} {what}" in out, (name, out[-4000:])
    assert "drop its `fast` mark" in out and "a file with no fast test was imported" not in out
