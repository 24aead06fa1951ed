"""Rewards: built-in verifiers and user functions, combined with weights, scored as samples finish.

`reward.fn` is a comma-separated list of terms, each `NAME[:WEIGHT]` or `module:function[:WEIGHT]`
(weight 1 if left out): `math_verify:1.0,format:0.1` scores 1.0 * math_verify + 0.1 * format.
Built-ins are in verifiers.py. `rm:PATH[:WEIGHT]` is a neural reward model (reward_model.py), scored
by the collector on the device in batches after these terms; the Scorer skips it. A user function is

    def fn(prompt: str, completion: str, answer: str) -> float          # per sample, or `async def`
    @hybridrl.data.rewards.batched
    def fn(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]

A batched function (marked by `fn.batched = True`, which the decorator sets) is called once per
prompt with that prompt's n completions, as soon as the last of them finishes.

Where they run (`Scorer`): each finished sample is submitted while vLLM keeps generating the rest.
With `reward.workers` > 0 the calls run in that many worker processes (spawned, never forked: this
process holds vLLM's and torch's threads) with a per-call timeout; a call that raises, a worker
that dies, and a call past `reward.timeout_s` (its worker is killed and replaced, so the pool
keeps its size) all score 0, are counted (`reward_errors`, `reward_timeouts`) and are written to
`<run_dir>/reward_dead_letter.jsonl`; `reward.on_error=raise` stops the run instead. With 0
workers the calls run in this process, between engine steps: no timeout for plain functions
(async ones get `asyncio.wait_for`), no IPC. The default (-1, auto) keeps the microsecond
built-ins (arithmetic, exact_match, format) in-process, where a worker's IPC would cost more than
the call, gives code_tests (a sandboxed program per sample, CPU-bound) the cores the engines leave
free (`sandbox_workers`), and uses min(4, CPUs) workers for anything else: math_verify and user code
can hang.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any, Callable

from hybridrl.core.config import Config, ConfigError, RewardConfig, UserError, import_spec
from hybridrl.core.journal import DEAD_LETTER_CAP, Journal
from hybridrl.data import verifiers

log = logging.getLogger("hybridrl")

BUILTIN = verifiers.BUILTIN  # name -> fn(prompt, completion, answer)


class RewardError(UserError):
    """A reward function failed and reward.on_error=raise."""


def batched(fn: Callable) -> Callable:
    """Mark `fn(prompts, completions, answers) -> list[float]` as batched (see module doc)."""
    fn.batched = True
    return fn


# --- the spec: terms and weights --------------------------------------------------------------
def parse_spec(spec: str) -> list[tuple[str, float]]:
    """'math_verify:1.0,mymod:score:0.5' -> [('math_verify', 1.0), ('mymod:score', 0.5)]; 'none' -> []
    (an environment's rewards alone, env.cls)."""
    if spec.strip().lower() in ("none", ""):
        return []
    terms = []
    for raw in spec.split(","):
        text = raw.strip()
        head, sep, tail = text.rpartition(":")
        try:
            name, weight = (head, float(tail)) if sep else (text, 1.0)
        except ValueError:  # 'mymod:score': the last part is a function name, not a weight
            name, weight = text, 1.0
        if not name or (name not in BUILTIN and ":" not in name) or name == "rm:":
            raise ConfigError(
                f"reward.fn={spec!r}: term {text!r} is neither a built-in ({', '.join(BUILTIN)}) "
                f"nor module:function nor rm:PATH; terms look like 'math_verify:1.0,format:0.1'"
            )
        terms.append((name, weight))
    return terms


@dataclass
class Term:
    name: str
    weight: float
    fn: Callable
    batched: bool
    is_async: bool


def _import(name: str, spec: str) -> Callable:
    fn = import_spec("reward.fn", spec, name, "function")
    if not callable(fn):
        raise ConfigError(f"reward.fn={spec!r}: {name} is not callable")
    return fn


def model_terms(spec: str) -> list[tuple[str, float]]:
    """The reward-model terms of a spec: 'arithmetic,rm:/models/rm:0.5' -> [('/models/rm', 0.5)]."""
    return [(name[3:], weight) for name, weight in parse_spec(spec) if name.startswith("rm:")]


def load_terms(
    spec: str,
    format_pattern: str = verifiers.DEFAULT_FORMAT,
    code_all_or_nothing: bool = False,
    code_packages: tuple[str, ...] = (),
) -> list[Term]:
    """The rule-based terms (built-ins and functions) of a spec; rm: terms are the collector's."""
    terms = []
    for name, weight in parse_spec(spec):
        if name.startswith("rm:"):
            continue
        if name == "format":
            fn = _FormatCheck(format_pattern)
        elif name == "code_tests":
            fn = _CodeTests(code_all_or_nothing, code_packages)
        else:
            fn = BUILTIN.get(name) or _import(name, spec)
        terms.append(
            Term(
                name,
                weight,
                fn,
                bool(getattr(fn, "batched", False)),
                inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)),
            )
        )
    return terms


@dataclass
class _FormatCheck:
    pattern: str

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return verifiers.format_check(prompt, completion, answer, pattern=self.pattern)


@dataclass
class _CodeTests:
    all_or_nothing: bool
    packages: tuple[str, ...] = ()

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return verifiers.code_tests(
            prompt, completion, answer, all_or_nothing=self.all_or_nothing, packages=self.packages
        )


def evaluate(
    terms: list[Term], prompt: str, completions: list[str], answer: str, timeout_s: float | None = None
) -> list[list[float]]:
    """Each term's value for each completion of one prompt: [len(completions)][len(terms)].
    Raises whatever a term raises (or asyncio.TimeoutError for an async term past timeout_s)."""
    k = len(completions)
    if not terms:
        return [[] for _ in completions]
    columns = []
    for t in terms:
        if t.batched:
            out = t.fn([prompt] * k, list(completions), [answer] * k)
            if t.is_async:
                out = _run_async(out, timeout_s)
            values = [_number(t, v) for v in out]
            if len(values) != k:
                raise ValueError(f"batched reward {t.name} returned {len(values)} values for {k} completions")
        elif t.is_async:
            values = [_number(t, _run_async(t.fn(prompt, c, answer), timeout_s)) for c in completions]
        else:
            values = [_number(t, t.fn(prompt, c, answer)) for c in completions]
        columns.append(values)
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in completions]


def _number(term: Term, value) -> float:
    """A term's value as a float; a NaN, an inf or a non-number is an error like an exception (one
    NaN reward turns the step's advantages, loss and gradient into NaN, and every update is skipped)."""
    try:
        x = float(value) if not isinstance(value, (str, bytes)) and value is not None else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise ValueError(f"reward {term.name} returned {value!r:.80}, not a finite number")
    return x


def _run_async(coro, timeout_s: float | None):
    main = asyncio.wait_for(coro, timeout_s) if timeout_s else coro
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
        return asyncio.run(main)
    # called under a running loop (a Jupyter kernel): asyncio.run refuses, so use a thread of its own
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main).result()


def total(terms: list[Term], values: list[float]) -> float:
    return sum(t.weight * v for t, v in zip(terms, values))


# --- worker processes ----------------------------------------------------------------------------
def _worker(conn, spec: str, format_pattern: str, code_all_or_nothing: bool = False, code_packages=()) -> None:
    """A reward worker: load the terms, then answer (key, prompt, completions, answer) messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (save, stop)
    terms = load_terms(spec, format_pattern, code_all_or_nothing, code_packages)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        key, prompt, completions, answer = msg
        try:
            rows = evaluate(terms, prompt, completions, answer)
            conn.send(("ok", key, rows, _hostile()))
        except BaseException as e:  # noqa: BLE001 (a reward function may raise anything)
            conn.send(("error", key, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _hostile() -> int:
    """Samples whose program tried to reach its own verdict since the last call (code_tests counts
    them: its harness decides the tests where the program cannot reach, and says when it tried)."""
    code_tests = sys.modules.get("hybridrl.data.code_tests")
    return code_tests.take_hostile() if code_tests else 0


_VERB = {"error": "raised", "timeout": "timed out", "crash": "killed its worker"}  # dead-letter kind -> words


@dataclass
class _Worker:
    """One reward worker process, its pipe and the task it runs."""

    proc: Any
    conn: Any
    ready: bool = False
    key: Any = None  # the task it runs
    deadline: float = 0.0


@dataclass
class _Task:
    key: Any
    prompt: str
    completions: list[str]
    answer: str
    meta: dict


def sandbox_workers(cores: int | None = None, ranks: int | None = None) -> int:
    """Workers for sandboxed rewards on each rank: the node's cores less two a rank (its vLLM engine's
    loop and the trainer's), shared by the node's ranks; at least 2, at most 32."""
    from hybridrl.core import memory

    cores = cores or len(os.sched_getaffinity(0))
    ranks = ranks or memory.local_ranks()
    return max(2, min(32, (cores - 2 * ranks) // ranks))


def worker_count(rc: RewardConfig, names: list[str], cores: int | None = None, ranks: int | None = None) -> int:
    """The Scorer's pool on each rank for reward terms `names` (reward.workers; -1: see module doc)."""
    if rc.workers >= 0:
        return rc.workers
    if all(n in verifiers.FAST for n in names):
        return 0
    if any(n in verifiers.SANDBOXED for n in names):
        return sandbox_workers(cores, ranks)
    return min(4, os.cpu_count() or 1)


def sandbox_bytes(cfg: Config, ranks: int, cores: int | None = None) -> int:
    """The most host memory the node's sandboxed programs hold at once, for the memory plan: as many
    as run at once (at most `sandbox.slots()`; code_tests alone: at most its workers, or one a rank
    with none) times the most one may hold (code_tests.ceiling; a tool call's Limits.ceiling)."""
    from hybridrl import sandbox
    from hybridrl.data import code_tests, envs

    names = [n for n, _ in parse_spec(cfg.reward.fn)]
    sizes, at_once = [], 0
    if any(n in verifiers.SANDBOXED for n in names):
        sizes.append(code_tests.ceiling())
        at_once += ranks * max(1, worker_count(cfg.reward, names, cores, ranks))
    if cfg.env.cls:  # an environment may call the python tool (envs.python), a call a thread at a time
        sizes.append(sandbox.Limits(**envs.TOOL_LIMITS).ceiling)
        at_once = sandbox.slots()
    return min(sandbox.slots(), at_once) * max(sizes, default=0)


@dataclass
class Scorer:
    """Scores submitted samples, in-process or in a pool of worker processes (see module doc).

    `submit(key, prompt, completions, answer, meta)` queues one prompt's finished completions;
    `poll()` hands queued work to idle workers and collects results without blocking (call it
    between engine steps); `wait()` blocks until every submitted task is scored and returns
    {key: [reward per completion]}. `counts()` returns and resets the error/timeout counters."""

    cfg: RewardConfig
    run_dir: Path | None = None
    rank: int = 0
    terms: list[Term] = field(init=False)
    workers: int = field(init=False)

    def __post_init__(self):
        self.terms = load_terms(  # fails fast here
            self.cfg.fn, self.cfg.format_pattern, self.cfg.code_all_or_nothing, self.cfg.packages
        )
        self.n_model_terms = len(model_terms(self.cfg.fn))  # scored by the collector (reward_model.py)
        self.batched = any(t.batched for t in self.terms)
        self.workers = w = worker_count(self.cfg, [t.name for t in self.terms])
        self.pending: list[_Task] = []
        self.running: dict[Any, _Task] = {}
        self.results: dict[Any, list[float]] = {}
        self.term_sums = [0.0] * len(self.terms)
        self.errors = self.timeouts = self.hostile = 0
        self.sandboxed = any(t.name in verifiers.SANDBOXED for t in self.terms)
        self._ctx = mp.get_context("spawn")
        self.slots = [self._start() for _ in range(w)]
        self._dead_letter = None
        self.step: int | None = None  # stamped into dead-letter entries

    # --- public -----------------------------------------------------------------------------
    def submit(self, key, prompt: str, completions: list[str], answer: str, meta: dict | None = None) -> None:
        task = _Task(key, prompt, list(completions), answer, meta or {})
        if not self.workers:
            self._run_here(task)
        else:
            self.pending.append(task)
            self.poll()

    def poll(self) -> None:
        if self.workers:
            self._pump(0.0)

    def wait(self) -> dict[Any, list[float]]:
        while self.pending or self.running:
            deadlines = [s.deadline for s in self.slots if s.key is not None]
            self._pump(max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0)
        out, self.results = self.results, {}
        return out

    def score(
        self, prompts: list[str], completions: list[str], answers: list[str], meta: dict | None = None
    ) -> list[float]:
        """One reward per (prompt, completion, answer), blocking: the held-out evaluation's path."""
        for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
            self.submit(("score", i), p, [c], a, {**(meta or {}), "index": i})
        got = self.wait()
        return [got[("score", i)][0] for i in range(len(prompts))]

    def counts(self) -> dict[str, float]:
        """Errors and timeouts since the last call; when there are several terms, each term's sum over
        the samples scored (`reward/<name>`); with code_tests, the samples whose program tried to reach
        its own verdict (`reward/hostile`, code_tests.take_hostile); resets them."""
        out = {"reward_errors": self.errors, "reward_timeouts": self.timeouts}
        if len(self.terms) + self.n_model_terms > 1:
            out.update({f"reward/{t.name}": s for t, s in zip(self.terms, self.term_sums)})
        if self.sandboxed:  # the collector turns a reward/ key into a per-sample mean: the share of hostile ones
            out["reward/hostile"] = self.hostile
        self.errors = self.timeouts = self.hostile = 0
        self.term_sums = [0.0] * len(self.terms)
        return out

    def close(self) -> None:
        for s in self.slots:
            try:
                s.conn.send(None)
            except OSError:
                pass
        for s in self.slots:
            s.proc.join(timeout=2)
            if s.proc.is_alive():
                s.proc.kill()
        self.slots = []
        if self._dead_letter:
            self._dead_letter.close()

    # --- scoring and failures -----------------------------------------------------------------
    def _done(self, task: _Task, rows: list[list[float]]) -> None:
        self.results[task.key] = [total(self.terms, r) for r in rows]
        for r in rows:
            self.term_sums = [s + v for s, v in zip(self.term_sums, r)]

    def reject(self, prompt: str, completion: str, answer: str, error: str, meta: dict | None = None) -> None:
        """A value scored outside this scorer that is not a number (a reward model's NaN): counted
        and dead-lettered like a reward function's error (or raised, on_error=raise); the caller scores 0."""
        task = _Task(None, prompt, [completion], answer, meta or {})
        self._failed(task, "error", error)
        self.results.pop(None, None)

    def _failed(self, task: _Task, kind: str, error: str, detail: str = "") -> None:
        """Score the task 0, count it, write it to the dead-letter file; or raise (on_error=raise)."""
        if self.cfg.on_error == "raise":
            raise RewardError(
                f"reward function {_VERB[kind]} on prompt {task.prompt[:80]!r} (reward.on_error=raise): "
                f"{error}\n{detail}"
            )
        n = len(task.completions)
        if kind == "timeout":
            self.timeouts += n
        else:
            self.errors += n
        if self.errors + self.timeouts == n:  # the first failure this step: say so once
            log.warning(
                "reward function %s on prompt %r: %s; scoring 0 (see reward_dead_letter.jsonl)",
                _VERB[kind],
                task.prompt[:80],
                error,
            )
        self.results[task.key] = [0.0] * n
        if self.run_dir is not None:
            if self._dead_letter is None:  # a full disk or the cap: counted, the run goes on (journal.py)
                self._dead_letter = Journal(Path(self.run_dir) / "reward_dead_letter.jsonl", DEAD_LETTER_CAP)
            self._dead_letter.write(
                *(
                    {
                        "step": self.step,
                        "rank": self.rank,
                        **task.meta,
                        "kind": kind,
                        "error": error,
                        "prompt": task.prompt,
                        "completion": c,
                        "answer": task.answer,
                    }
                    for c in task.completions
                )
            )

    def _run_here(self, task: _Task) -> None:
        try:
            rows = evaluate(self.terms, task.prompt, task.completions, task.answer, self.cfg.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._failed(task, "timeout", f"no result within reward.timeout_s={self.cfg.timeout_s}")
            return
        except Exception as e:  # noqa: BLE001
            self._failed(task, "error", f"{type(e).__name__}: {e}", traceback.format_exc())
            return
        self.hostile += _hostile()
        self._done(task, rows)

    # --- the pool -----------------------------------------------------------------------------
    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker,
            daemon=True,
            name="hybridrl-reward",
            args=(child, self.cfg.fn, self.cfg.format_pattern, self.cfg.code_all_or_nothing, self.cfg.packages),
        )
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _replace(self, i: int) -> None:
        """Kill slot i's worker (hung or dead) and start a fresh one in its place."""
        s = self.slots[i]
        if s.proc.is_alive():
            s.proc.kill()
        s.proc.join(timeout=5)
        s.conn.close()
        self.slots[i] = self._start()

    def _pump(self, timeout: float) -> None:
        """Hand queued tasks to idle workers; wait up to `timeout` for messages; enforce deadlines."""
        self._dispatch()
        by_handle = {h: i for i, s in enumerate(self.slots) for h in (s.conn, s.proc.sentinel)}
        for i in sorted({by_handle[h] for h in wait_ready(list(by_handle), timeout)}):
            s, gone = self.slots[i], False
            try:
                while s.conn.poll():
                    self._message(s, s.conn.recv())
            except (EOFError, OSError):  # the pipe closed: the worker is gone
                gone = True
            if gone or not s.proc.is_alive():
                self._lost(i)
        now = time.monotonic()
        for i, s in enumerate(self.slots):
            if s.key is not None and now > s.deadline:
                task = self.running.pop(s.key)
                self._replace(i)
                self._failed(
                    task,
                    "timeout",
                    f"no result within reward.timeout_s={self.cfg.timeout_s}; its worker was killed and replaced",
                )
        self._dispatch()

    def _dispatch(self) -> None:
        for s in self.slots:
            if s.ready and s.key is None and self.pending:
                task = self.pending.pop(0)
                s.conn.send((task.key, task.prompt, task.completions, task.answer))
                s.key, s.deadline = task.key, time.monotonic() + self.cfg.timeout_s
                self.running[task.key] = task

    def _message(self, s: _Worker, msg: tuple) -> None:
        if msg[0] == "ready":
            s.ready = True
            return
        task = self.running.pop(msg[1])
        s.key = None
        if msg[0] == "ok":
            self.hostile += msg[3]
            self._done(task, msg[2])
        else:
            self._failed(task, "error", msg[2], msg[3])

    def _lost(self, i: int) -> None:
        """Slot i's worker died (segfault, os._exit, OOM kill): fail its task, start another."""
        s = self.slots[i]
        s.proc.join(timeout=5)
        code = s.proc.exitcode
        if not s.ready:  # it died loading the reward module: that will not get better by retrying
            raise RewardError(
                f"a reward worker died while loading reward.fn={self.cfg.fn!r} (exit code {code}; its "
                f"error is above). A script that calls hybridrl.train() needs an "
                f"`if __name__ == '__main__':` guard: workers are spawned and import it"
            )
        task = self.running.pop(s.key) if s.key is not None else None
        self._replace(i)
        if task is not None:
            self._failed(task, "crash", f"the worker process died (exit code {code}); it was replaced")
