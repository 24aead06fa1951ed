"""The fast tier (`make test-fast`, `pytest -m fast`) and the guard that keeps it fast.

A fast test starts no engine: it builds no vLLM engine (`vllm.LLM`) and no DeepSpeed engine, and
starts no Python interpreter (no `hybridrl train` subprocess, no multiprocessing spawn). Those are
where the seconds go on a CPU: an engine loads a model and warms up, a child re-imports torch.
Importing vLLM is allowed (~3 s, once): hybridrl's planner imports it (engine_cycle -> sync ->
rollout -> vllm_compat), and so do the tests of its arithmetic. A fast test is marked
`@pytest.mark.fast`; a whole engine-free file says so at its top: `pytestmark = pytest.mark.fast`.

When the session is the fast tier (`-m fast`, exactly), conftest.py
  - skips collecting the test files that do not mention `mark.fast` (importing them costs seconds), and
  - arms the guard: constructing `vllm.LLM` or a `DeepSpeedEngine`, or starting a Python process,
    raises FastTierError, and the test that did it fails with that message (also where the code
    under test catches the exception: the violation is recorded and checked after each phase).
In `make test` the marker is inert and nothing is guarded.
"""

from __future__ import annotations

import importlib.machinery
import multiprocessing.util
import os
import re
import subprocess
import sys
from pathlib import Path

MARKER = "fast"
FIX = (
    "a test that needs an engine (vLLM's or DeepSpeed's) or a Python subprocess belongs to the default "
    "tier: drop its `fast` mark (tests/README.md)"
)

PYTHON = re.compile(r"python[0-9.]*")
# console scripts that are a Python interpreter too
PYTHON_SCRIPTS = {"hybridrl", "torchrun", "deepspeed", "accelerate", "vllm", "pytest"}
# programs that run the command they are given (test_faults starts `unshare -rm sh -c ... python`)
WRAPPERS = {"unshare", "sh", "bash", "env", "timeout", "nice", "nohup", "setsid", "stdbuf", "taskset", "numactl"}

violations: list[str] = []


class FastTierError(RuntimeError):
    pass


def is_fast_session(config) -> bool:
    """The session is the fast tier: `-m fast`, not an expression that also selects other tests."""
    return (config.getoption("markexpr", "") or "").strip() == MARKER


def has_fast_tests(path: Path) -> bool:
    """Cheap test, read before import: the file marks something fast."""
    try:
        return f"mark.{MARKER}" in path.read_text(encoding="utf-8")
    except OSError:
        return True  # let pytest report it


def _violate(what: str) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "a test module, while collected,").split(" (")[0]
    msg = f"fast tier: {test} {what}; {FIX}"
    violations.append(msg)
    raise FastTierError(msg)


# module -> (class, what constructing it means): the engines a fast test may not build
ENGINES = {
    "deepspeed.runtime.engine": ("DeepSpeedEngine", "built a DeepSpeed engine"),
    "vllm.entrypoints.llm": ("LLM", "started a vLLM engine (vllm.LLM)"),
}


def _forbid(module) -> None:
    cls, what = ENGINES[module.__name__]

    def refuse(*args, **kwargs):
        _violate(what)

    getattr(module, cls).__init__ = refuse


class _Guard:
    """sys.meta_path entry that lets the engines' modules load, then makes their classes refuse
    to be constructed."""

    def find_spec(self, name, path, target=None):
        if name not in ENGINES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_forbid(module):
                exec_module(module)
                _forbid(module)

            spec.loader.exec_module = exec_and_forbid
        return spec

    def invalidate_caches(self):
        pass


def _is_python(word: str) -> bool:
    name = Path(word).name
    return word == sys.executable or bool(PYTHON.fullmatch(name)) or name in PYTHON_SCRIPTS


def _python_child(args) -> bool:
    """The command starts a Python interpreter: its program is one (this interpreter, a `python*`,
    a Python console script), or it is a wrapper (`unshare ... sh -c ... python`) with one among its
    words. `file -b .../python3.11` (platform.architecture) is not."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    words = [w for a in argv for w in os.fsdecode(a).split()]
    if not words:
        return False
    if _is_python(words[0]):
        return True
    return Path(words[0]).name in WRAPPERS and any(_is_python(w) for w in words[1:])


def install() -> None:
    """Arm the guard for this process (the fast session's pytest process only)."""
    sys.meta_path.insert(0, _Guard())
    for name in ENGINES:
        if name in sys.modules:
            _forbid(sys.modules[name])

    execute_child = subprocess.Popen._execute_child

    def guarded_execute_child(self, args, *rest, **kw):
        if _python_child(args):
            command = args if isinstance(args, (str, bytes, os.PathLike)) else " ".join(map(os.fsdecode, args))
            _violate(f"started a Python process ({os.fsdecode(command).splitlines()[0][:100]})")
        return execute_child(self, args, *rest, **kw)

    subprocess.Popen._execute_child = guarded_execute_child

    def no_spawn(*args, **kwargs):  # multiprocessing's spawn and forkserver start a new interpreter here
        _violate("spawned a Python process (multiprocessing)")

    multiprocessing.util.spawnv_passfds = no_spawn


def check() -> str | None:
    """What the test just run did that the tier forbids, or None; the record is cleared."""
    if not violations:
        return None
    found = violations[0]
    violations.clear()
    return found
