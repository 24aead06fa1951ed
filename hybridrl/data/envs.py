"""Environments for multi-turn rollouts: the protocol users implement, and `ToolEnv`, the built-in
tool-calling environment (Hermes / Qwen `<tool_call>{json}</tool_call>` calls, Python functions).

An environment is a class, named in `env.cls` as `module:Class` and instantiated with no arguments
once per episode (so `self` is the episode's state). Either method may be `async def`:

    class MyEnv:
        def reset(self, row: dict) -> list[dict] | None:
            '''row = {"prompt": ..., "answer": ..., "index": ...}. The first messages, rendered
            with the tokenizer's chat template (an attribute `schemas`, a list of JSON schemas, is
            passed to it too); None = the prompt as the data pipeline encoded it.'''
        def step(self, assistant_text: str):
            '''-> (observation, reward, done) or (observation, reward, done, info). observation:
            a list of messages ({"role": "tool" | "user", "content": ...}) appended to the
            conversation, or None to end the episode. info: counts to log (the keys of
            COUNTS, e.g. {"tools/calls": 2}) and "errors", a list of dicts for the dead letter.'''

Images (a vision-language model): `row["images"]` holds the prompt's, PIL and fitted to the model (do
not draw on them: the prompt's samples share them). A content may be a list of parts, {"type":
"text", "text": ...} and {"type": "image", "image": <a PIL image, bytes, a path or a datasets Image>};
a tool's screenshot or plot is an image part of its message (a ToolEnv tool returns the PIL image, or
a list of images and strings). In reset's messages an image part without "image", and each '<image>'
marker in a text, takes the row's next image (so `row["prompt"]` as it is places them); in an
observation only image parts are images. An episode holds at most rollout.images_per_prompt images.

The episode's reward is the sum of its steps' rewards plus the `reward.fn` terms on the final
assistant message (`--reward.fn none` for the environment's reward alone). Guards (multiturn.py):
each call runs under 2 x `env.tool_timeout_s` + 5 s; one that raises or hangs ends its episode,
counted (`env/errors`, `env/timeouts`) and dead-lettered. Sync methods run in a thread of their own,
so a hung one is abandoned, never joined: the run goes on (a tool that can spin a CPU forever
should run its work in a subprocess); at most MAX_ABANDONED hung threads are left running, past
which sync calls fail at once. An async method that blocks the event loop is abandoned with the
loop. A reward that is not a finite number, a malformed `info`, or reset messages the chat
template cannot render end their episode the same way.

Departs from verl's agent loop / TRL's tool loop in one way: an environment turn is rendered on its
own (multiturn.render_turn), never by re-rendering the whole conversation, so earlier token ids
stay exactly what the model saw and sampled.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from typing import Any, Callable

from hybridrl.core.config import ConfigError, import_spec

# the counters an environment's info may report (anything else is ignored); summed over episodes and ranks
COUNTS = ("tools/calls", "tools/errors", "tools/timeouts", "tools/malformed", "tools/truncated", "tools/latency_s")


def load(spec: str) -> type:
    """'mymod:Calc' -> the class; a one-line ConfigError naming the fix otherwise."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"env.cls={spec!r}: expected module:Class, e.g. mytools:Calc")
    cls = import_spec("env.cls", spec, spec)
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
        raise ConfigError(f"env.cls={spec!r}: {attr} must be a class with a step(assistant_text) method")
    return cls


# --- calling user code: sync or async, with a timeout, never blocking the caller ----------------
class Runner:
    """An asyncio loop in a daemon thread. `submit(fn, *args, timeout=)` runs fn (sync: in a fresh
    daemon thread; async: on the loop) and returns a concurrent.futures.Future that fails with
    TimeoutError after `timeout` seconds. A timed-out sync call is abandoned, not joined."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="hybridrl-env")
        self.thread.start()

    def submit(self, fn: Callable, *args, timeout: float):
        return asyncio.run_coroutine_threadsafe(call(fn, *args, timeout=timeout), self.loop)

    def responsive(self, wait_s: float = 1.0) -> bool:
        """Whether the loop still runs its callbacks (an async call that blocks it stops them all)."""
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(timeout=wait_s)
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# sync calls abandoned at their timeout whose threads still run; at MAX_ABANDONED a sync call fails at once
# instead of starting one more thread (a tool that hangs on every call would otherwise grow them without end).
# Room for several steps of episodes whose tool hangs for a while (each thread holds little but its stack).
MAX_ABANDONED = 512
_abandoned: set[threading.Thread] = set()
_lock = threading.Lock()


def abandoned_threads() -> int:
    """Threads of timed-out sync calls that are still running."""
    with _lock:
        _abandoned.difference_update([t for t in _abandoned if not t.is_alive()])
        return len(_abandoned)


async def call(fn: Callable, *args, timeout: float, **kwargs) -> Any:
    """Await fn(*args, **kwargs) for at most `timeout` s (asyncio.TimeoutError past it), from a
    running loop; a sync fn runs in a daemon thread of its own, so a hung one costs that thread only,
    and at most MAX_ABANDONED of them are left running (past that a sync call raises RuntimeError)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout)
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error):
        if not fut.done():  # it may have been cancelled by the timeout
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run():
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 (user code may raise anything)
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while this call hung
            pass

    if abandoned_threads() >= MAX_ABANDONED:
        raise RuntimeError(
            f"{MAX_ABANDONED} earlier calls of sync tools/environments are still running past their "
            f"timeout, each in a thread; refusing to start more: make {getattr(fn, '__name__', fn)} "
            "return within env.tool_timeout_s, or run its work in a subprocess"
        )
    thread = threading.Thread(target=run, daemon=True, name="hybridrl-env-call")
    thread.start()
    try:
        return await asyncio.wait_for(fut, timeout)
    except (asyncio.TimeoutError, TimeoutError):
        with _lock:
            _abandoned.add(thread)
        raise


# --- the built-in tool-calling environment --------------------------------------------------------
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def schema(fn: Callable) -> dict:
    """The OpenAI-style function schema chat templates render: name, first docstring line, and the
    parameters from the signature (annotated types; those without a default are required)."""
    params, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        params[name] = {"type": _TYPES.get(p.annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or fn.__name__).strip().splitlines()[0]
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc,
            "parameters": {"type": "object", "properties": params, "required": required},
        },
    }


def parse_calls(text: str, names) -> tuple[list[tuple[str, dict]], list[str]]:
    """Hermes / Qwen tool calls in an assistant message: ([(name, arguments)], [problems]). A
    problem is a call the model got wrong (bad JSON, no name, an unknown tool, arguments that are
    not an object, an unclosed tag), said in words the model can learn from."""
    calls, problems = [], []
    for raw in _CALL.findall(text):
        try:
            obj = json.loads(raw.strip())
        except json.JSONDecodeError as e:
            problems.append(f"the tool call is not valid JSON ({e.msg}): {raw.strip()[:200]}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            problems.append('a tool call must be {"name": ..., "arguments": {...}}')
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if obj["name"] not in names:
            problems.append(f"unknown tool {obj['name']!r}; the tools are {', '.join(sorted(names))}")
        elif not isinstance(args, dict):
            problems.append(f"the arguments of {obj['name']} must be a JSON object")
        else:
            calls.append((obj["name"], args))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        problems.append("a <tool_call> was not closed with </tool_call>")
    return calls, problems


class ToolEnv:
    """Tool calling: the model calls the functions in `tools` as `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>`; each call's result (str() of what the function returns) comes
    back as a tool message; a message without a call is the final answer and ends the episode.

    Subclass it and list the functions (sync or async, typed, with a docstring: their schemas go to
    the chat template):

        class Calc(ToolEnv):
            tools = [calculator]

    A call that raises, runs past `tool_timeout_s` (set from env.tool_timeout_s) or returns more
    than `max_output_chars` comes back as an error / truncated result, and a malformed call as a
    message saying what is wrong; the episode goes on, and each is counted (tools/errors,
    tools/timeouts, tools/truncated, tools/malformed) and dead-lettered. `score(final_text)` (0 by
    default) is the environment's reward for the final answer, beside `reward.fn`'s.
    """

    tools: list[Callable] = []
    tool_timeout_s: float = 10.0
    max_output_chars: int = 1000

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    @property
    def schemas(self) -> list[dict]:  # the chat template's `tools`
        return [schema(fn) for fn in self.tools]

    def score(self, final_text: str) -> float:
        return 0.0

    async def step(self, text: str):
        table = {fn.__name__: fn for fn in self.tools}
        calls, problems = parse_calls(text, table)
        info: dict = {"tools/malformed": len(problems), "errors": [{"kind": "malformed", "error": p} for p in problems]}
        if not calls and not problems:
            return None, self.score(text), True, info
        results = await asyncio.gather(*(self._run(table[name], args, info) for name, args in calls))
        msgs: list[dict] = [{"role": "tool", "content": r} for r in results]
        msgs += [{"role": "tool", "content": f"error: {p}"} for p in problems]
        return msgs, 0.0, False, info

    async def _run(self, fn: Callable, args: dict, info: dict) -> str | list[dict]:
        """One call -> the tool message's content: its text, or its parts where it returned images;
        failures become text too (and counts in info)."""
        t0, name = time.perf_counter(), fn.__name__

        def fail(kind, error):
            key = {"timeout": "tools/timeouts", "error": "tools/errors", "truncated": "tools/truncated"}[kind]
            info[key] = info.get(key, 0) + 1
            info["errors"].append({"kind": kind, "tool": name, "arguments": args, "error": error})

        cap = self.max_output_chars
        try:
            got = await call(fn, timeout=self.tool_timeout_s, **args)
            parts = _parts(got)
            if parts is not None:
                out: str | list[dict] = parts
                text = sum(len(p["text"]) for p in parts if p["type"] == "text")
                if text > cap:
                    fail("truncated", f"{text} characters of text, more than max_output_chars={cap}")
                    out = _cut(parts, cap)
            else:
                out = str(got)
                if len(out) > cap:
                    fail("truncated", f"{len(out)} characters, more than max_output_chars={cap}")
                    out = out[:cap] + f"... [truncated {len(out) - cap} characters]"
        except (asyncio.TimeoutError, TimeoutError):
            fail("timeout", f"no result within {self.tool_timeout_s} s")
            out = f"error: {name} timed out after {self.tool_timeout_s} s"
        except Exception as e:  # noqa: BLE001 (a tool may raise anything)
            fail("error", f"{type(e).__name__}: {e}")
            out = f"error: {name} raised {type(e).__name__}: {e}"[:cap]
        info["tools/calls"] = info.get("tools/calls", 0) + 1
        info["tools/latency_s"] = info.get("tools/latency_s", 0.0) + time.perf_counter() - t0
        return out


def _is_image(x) -> bool:
    return type(x).__module__.startswith("PIL.") and hasattr(x, "convert")


def _parts(out) -> list[dict] | None:
    """A tool's result as content parts where it returned images (a PIL image, or a list or tuple of
    images and other values, each of those as its text); None for a result without images (its str)."""
    items = list(out) if isinstance(out, (list, tuple)) else [out]
    if not any(_is_image(x) for x in items):
        return None
    return [{"type": "image", "image": x} if _is_image(x) else {"type": "text", "text": str(x)} for x in items]


def _cut(parts: list[dict], cap: int) -> list[dict]:
    """`parts` with their text cut to `cap` characters in all (the images kept)."""
    out, left = [], cap
    for p in parts:
        if p["type"] == "text":
            p = {"type": "text", "text": p["text"][: max(left, 0)]}
            left -= len(p["text"])
        out.append(p)
    return out + [{"type": "text", "text": "... [truncated]"}]


# --- model-written code as a tool: the sandbox --------------------------------------------------
TOOL_LIMITS = {"wall_s": 8.0, "cpu_s": 5, "memory_mb": 512, "output_bytes": 4000, "fork": False}


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout; then the error, if it raised)."""
    from hybridrl import sandbox

    res = sandbox.run(code, limits=sandbox.Limits(**TOOL_LIMITS))
    out = res.stdout
    if res.status == "timeout":
        out += f"\n[timed out after {TOOL_LIMITS['wall_s']} s]"
    elif res.status == "killed":
        out += "\n[killed: CPU, memory or output limit]"
    elif res.status == "jail":
        raise RuntimeError(res.stderr.strip())  # the sandbox itself failed: an error, counted, not the model's
    elif not res.ok:
        out += "\n" + "\n".join(res.stderr.strip().splitlines()[-3:])  # the traceback's last lines
    return out.strip() or "(no output)"


class PythonEnv(ToolEnv):
    """A ReTool-style environment: the model may call `python` (its code runs in the code sandbox,
    what it prints comes back as the tool turn) before it answers; `reward.fn` scores the answer."""

    tools = [python]
