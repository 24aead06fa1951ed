"""Prompts in: read rows from a file, a saved `datasets` dataset or the demo task, tokenize once,
hand out seeded batches.

Formats: .jsonl (one object per line), .json (a list of objects, or JSON lines as `datasets`'
`to_json` writes them), .parquet, .csv (with a header row), and a directory written by
`datasets`' `save_to_disk`: a Dataset, or a DatasetDict whose split `data.split` (held out:
`data.heldout_split`) is read. Columns are `data.prompt_key` and `data.answer_key`; a row
without a prompt may be in chat format instead: `data.messages_key` holds a list of
{"role", "content"} turns (system, user, ...) as in Hugging Face chat datasets, rendered with the
tokenizer's chat template; a trailing assistant turn is left out, and the reward sees the last
user turn as the prompt. A plain prompt is wrapped in the chat template (data.chat_template=auto,
where the tokenizer has one) unless it carries the template's markers already (data converted
from verl or OpenRLHF often comes rendered): then it is used as given, never templated twice
(`rendered_prompts`).

Readers never judge a row; `encode` does, in one place: a malformed row (bad JSON, not an
object, a missing key, a prompt that is not a non-empty string, bytes that are not UTF-8) fails
with its location (`file:line` for line formats, `file row i`, 0-based, for tables) and what to
change, or with
`data.on_error=skip` is skipped, counted, and logged once with the first location. Prompts
longer than `data.max_prompt_len` tokens are dropped and counted.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.core.config import ConfigError, DataConfig, UserError

log = logging.getLogger("hybridrl")


class DataError(UserError):
    """Malformed or missing data; names the file and line."""


@dataclass
class Prompt:
    text: str
    ids: list[int]  # token ids vLLM receives (chat template applied if any)
    answer: str


@dataclass
class Row:
    where: str  # how a user finds it: "train.jsonl:12", "train.parquet row 3"
    value: Any  # the parsed row; a dict when well formed
    problem: str = ""  # set by a reader that could not parse the row at all


# --- readers: path -> rows (a broken file raises; a broken row is passed on with its problem) ----
def _text(p: Path) -> str:
    """The file as UTF-8 (a BOM dropped), bytes that are not UTF-8 kept as lone surrogates, so that
    a reader can name the row that holds them (`_bad_utf8`) and data.on_error=skip can skip it."""
    return p.read_bytes().decode("utf-8-sig", errors="surrogateescape")


def _bad_utf8(text: str) -> str:
    """'' or the problem of a row's text that holds bytes that are not UTF-8."""
    m = re.search("[\udc80-\udcff]", text)
    return (
        ""
        if m is None
        else (
            f"not valid UTF-8 (byte 0x{ord(m.group()) - 0xDC00:02x} at character "
            f"{m.start() + 1}); save the file as UTF-8"
        )
    )


def _jsonl(p: Path) -> list[Row]:
    rows = []
    for n, line in enumerate(_text(p).splitlines(), 1):
        if not line.strip():
            continue
        if _bad_utf8(line):
            rows.append(Row(f"{p}:{n}", None, _bad_utf8(line)))
            continue
        try:
            rows.append(Row(f"{p}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            rows.append(Row(f"{p}:{n}", None, f"not valid JSON ({e.msg}); each line must be one JSON object"))
    return rows


def _json(p: Path) -> list[Row]:
    text = _text(p)
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON lines under a .json name
            return _jsonl(p)
        raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
    bad = re.search("[\udc80-\udcff]", text)
    if bad:  # one JSON document: no row to skip alone
        line = text.count("\n", 0, bad.start()) + 1
        raise DataError(f"{p}:{line}: {_bad_utf8(text.splitlines()[line - 1])}")
    if not isinstance(items, list):
        raise DataError(f"{p}: expected a JSON list of objects (or one object per line), got {type(items).__name__}")
    return [Row(f"{p} item {i}", r) for i, r in enumerate(items)]


def _parquet(p: Path) -> list[Row]:
    import pyarrow.parquet as pq  # pyarrow, not pandas: an int column with a null stays int

    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise DataError(f"{p}: not a readable parquet file ({e})") from None
    return [Row(f"{p} row {i}", r) for i, r in enumerate(table.to_pylist())]


def _csv(p: Path) -> list[Row]:
    rows = []
    with io.StringIO(_text(p), newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, [])
            if _bad_utf8(",".join(header)):
                raise DataError(f"{p}:1: the header is {_bad_utf8(','.join(header))}")
            for fields in reader:  # line_num: the row's last line (a quoted field may span lines)
                where = f"{p}:{reader.line_num}"
                if not fields:
                    continue
                if _bad_utf8(",".join(fields)):
                    rows.append(Row(where, None, _bad_utf8(",".join(fields))))
                elif len(fields) != len(header):
                    rows.append(Row(where, None, f"has {len(fields)} fields, the header has {len(header)}"))
                else:
                    rows.append(Row(where, dict(zip(header, fields))))
        except csv.Error as e:
            raise DataError(f"{p}:{reader.line_num}: not valid CSV ({e})") from None
    return rows


def _saved_dataset(p: Path, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{p} is a directory: reading a saved dataset needs `pip install datasets`") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError:
        raise DataError(f"{p}: a directory, but not one written by datasets' save_to_disk") from None
    where = str(p)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{p}: no split {split!r} (has {', '.join(ds)}); set data.split / data.heldout_split")
        ds, where = ds[split], f"{p} [{split}]"
    return [Row(f"{where} row {i}", r) for i, r in enumerate(ds.to_list())]


READERS = {".jsonl": _jsonl, ".ndjson": _jsonl, ".json": _json, ".parquet": _parquet, ".csv": _csv}


def read_rows(path: str, split: str = "train") -> list[Row]:
    """Rows of a file, or of a dataset directory (`split` picks a DatasetDict's split)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} not found")
    if p.is_dir():
        return _saved_dataset(p, split)
    reader = READERS.get(p.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown format {p.suffix!r}; use .jsonl, .json, .parquet, .csv "
            "or a directory written by datasets' save_to_disk"
        )
    return reader(p)


def load_rows(cfg: DataConfig, split: str) -> list[Row]:
    """split is 'train' or 'heldout'."""
    from hybridrl.data import tasks

    if cfg.path in tasks.BUILT_IN and not (split == "heldout" and cfg.heldout_path):
        return [Row(f"{cfg.path} {split} row {i}", r) for i, r in enumerate(tasks.task(cfg.path).load(split))]
    path = cfg.path if split == "train" else cfg.heldout_path
    return read_rows(path, cfg.split if split == "train" else cfg.heldout_split) if path else []


# --- rows -> prompts -----------------------------------------------------------------------------
def _turns(row: dict, cfg: DataConfig) -> list[dict] | None:
    """A chat-format row's turns up to the last non-assistant one; None for a plain-prompt row."""
    if cfg.prompt_key in row or cfg.messages_key not in row:
        return None
    turns = list(row[cfg.messages_key] or [])
    while turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
        turns.pop()  # the reference reply of a chat dataset: the model writes its own
    return turns


def _chat_problem(turns: list, cfg: DataConfig) -> str:
    if not turns or not all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
    ):
        return (
            f'\'{cfg.messages_key}\' must be a list of {{"role": ..., "content": "..."}} turns with at least '
            "one before the assistant's"
        )
    if not any(t["role"] == "user" and t["content"] for t in turns):
        return f"'{cfg.messages_key}' has no non-empty user turn"
    return ""


def _code_tests(row: dict) -> tuple[dict | None, str]:
    """The row's code tests (code_tests.spec_of) and what is wrong with them ('' if nothing)."""
    from hybridrl.data import code_tests

    try:
        return code_tests.spec_of(row), ""
    except ValueError as e:
        return None, str(e)


def _problem(row: Any, cfg: DataConfig) -> str:
    """What is wrong with a parsed row ('' if nothing)."""
    if not isinstance(row, dict):
        return f"expected an object with a '{cfg.prompt_key}' field, got {type(row).__name__}"
    if row.get("images") or row.get("image"):  # TRL's and verl's image columns: read as text, they would be lost
        return (
            "a row with images needs vision-language RL, which is not built yet (docs/design/vision.md): "
            "give text prompts without the 'images' column"
        )
    spec, bad = _code_tests(row)
    if bad:
        return bad
    if spec is not None and cfg.answer_key and cfg.answer_key not in row:  # its tests are its answer
        row = {**row, cfg.answer_key: ""}
    turns = _turns(row, cfg)
    if turns is not None:
        if cfg.answer_key and cfg.answer_key not in row:
            return f"no '{cfg.answer_key}' field (has {sorted(map(str, row))}); set data.answer_key"
        return _chat_problem(turns, cfg) or (
            f"'{cfg.answer_key}' is null" if cfg.answer_key and row[cfg.answer_key] is None else ""
        )
    if cfg.prompt_key not in row:
        return (
            f"no '{cfg.prompt_key}' field (has {sorted(map(str, row))}); set data.prompt_key (or give chat turns "
            f"in '{cfg.messages_key}': data.messages_key)"
        )
    for key, knob in ((cfg.prompt_key, "prompt_key"), (cfg.answer_key, "answer_key")):
        if key and key not in row:
            return f"no '{key}' field (has {sorted(map(str, row))}); set data.{knob}"
    text = row[cfg.prompt_key]
    if not isinstance(text, str) or not text:
        return f"'{cfg.prompt_key}' must be a non-empty string, got {repr(text)[:40]}"
    if cfg.answer_key and row[cfg.answer_key] is None:
        return f"'{cfg.answer_key}' is null"
    return ""


def _answer(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _row_answer(row: dict, cfg: DataConfig) -> str:
    """What the reward gets as the answer: the row's code tests, as JSON, when it has them (the
    code_tests reward reads them), else its `data.answer_key` column."""
    spec, _ = _code_tests(row)
    if spec is not None:
        return json.dumps({"code_tests": spec})
    return _answer(row[cfg.answer_key]) if cfg.answer_key else ""


def template_markers(tokenizer) -> list[str]:
    """The special tokens the tokenizer's chat template writes around a user turn ('<|im_start|>',
    '<|start_header_id|>', ...): a prompt carrying one was rendered with a template already."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "\x00"}], add_generation_prompt=True, tokenize=False
    )
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    return sorted(t for t in special if len(t) > 1 and t in text)


def rendered_prompts(rows: list[Row], tokenizer, cfg: DataConfig, source: str) -> bool:
    """Whether the plain prompts of `rows` already carry the chat template's markers, so that they
    are used as given (tokenized without added special tokens) instead of wrapped again. All or
    none: a mix, or rendered prompts under data.chat_template=on, stops in one line naming the fix."""
    markers = template_markers(tokenizer)
    if not markers:
        return False
    plain = [
        r.value[cfg.prompt_key]
        for r in rows
        if not r.problem and isinstance(r.value, dict) and isinstance(r.value.get(cfg.prompt_key), str)
    ]
    carry = sum(any(m in text for m in markers) for text in plain)
    if not carry:
        return False
    if carry < len(plain):
        raise DataError(
            f"{source}: {carry} of {len(plain)} prompts already carry the chat template's markers "
            f"({', '.join(markers)}) and the others do not: render all of them or none (plain prompts are "
            "wrapped under data.chat_template=auto)"
        )
    if cfg.chat_template == "on":
        raise ConfigError(
            f"{source}: the prompts already carry the chat template's markers ({', '.join(markers)}) and "
            "data.chat_template=on would wrap them again; set data.chat_template=auto (use them as "
            "given) or give plain prompts"
        )
    return True


def template_choice(rows: list[Row], tokenizer, cfg: DataConfig) -> dict[str, tuple[str, str]]:
    """What data.chat_template=auto does with these rows, for the recipe the run prints at start:
    {"data.chat_template": (value, why)}; {} where nothing was left to decide."""
    if cfg.chat_template != "auto" or not getattr(tokenizer, "chat_template", None):
        return {}
    if rendered_prompts(rows, tokenizer, cfg, cfg.path):
        return {
            "data.chat_template": (
                "as given",
                "auto, the prompts carry the chat template's " + " ".join(template_markers(tokenizer)),
            )
        }
    return {"data.chat_template": ("on", "auto, the tokenizer has a chat template")}


def encode(rows: list[Row], tokenizer, cfg: DataConfig, source: str) -> tuple[list[Prompt], dict[str, int]]:
    """Check and tokenize rows; returns the kept prompts and how many were dropped, by reason
    ({"too_long": n, "malformed": m}). `data.answer_key` '' means rows carry no answer."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "on" and not has_template:
        raise ConfigError("data.chat_template=on but the tokenizer has no chat template; set data.chat_template=off")
    use_template = cfg.chat_template == "on" or (cfg.chat_template == "auto" and has_template)
    as_given = cfg.chat_template != "off" and has_template and rendered_prompts(rows, tokenizer, cfg, source)
    out, too_long, malformed, first = [], 0, 0, ""
    for row in rows:
        problem = row.problem or _problem(row.value, cfg)
        if problem:
            if cfg.on_error != "skip":
                raise DataError(f"{row.where}: {problem} (data.on_error=skip skips malformed rows)")
            malformed += 1
            first = first or f"{row.where}: {problem}"
            continue
        turns = _turns(row.value, cfg)
        if turns is not None:  # chat format: always through the template
            if not has_template:
                raise DataError(
                    f"{row.where}: chat-format rows ('{cfg.messages_key}') need a tokenizer with a chat "
                    "template; set tokenizer.chat_template or give plain prompts"
                )
            text = [t["content"] for t in turns if t["role"] == "user"][-1]
            ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        elif use_template and not as_given:
            text = row.value[cfg.prompt_key]
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:  # a rendered prompt brings its own special tokens (a second BOS would not be the template's)
            text = row.value[cfg.prompt_key]
            ids = (tokenizer(text, add_special_tokens=False) if as_given else tokenizer(text))["input_ids"]
        if len(ids) > cfg.max_prompt_len:
            too_long += 1
            continue
        out.append(Prompt(text, list(ids), _row_answer(row.value, cfg)))
    if malformed:
        log.warning(
            "%s: skipped %d of %d malformed rows (data.on_error=skip); the first: %s",
            source,
            malformed,
            len(rows),
            first,
        )
    if too_long:
        log.warning(
            "%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
            source,
            too_long,
            len(rows),
            cfg.max_prompt_len,
        )
    return out, {"too_long": too_long, "malformed": malformed}


class Sampler:
    """Seeded shuffled epochs over n items with a cursor, so a run's data order is fixed."""

    def __init__(self, n: int, seed: int):
        if n == 0:
            raise DataError("no prompts left to train on (all filtered?); check data.path and data.max_prompt_len")
        self.n, self.seed, self.cursor = n, seed, 0
        self._epoch, self._cached = -1, []

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            import random

            self._cached = list(range(self.n))
            random.Random(self.seed * 100_003 + epoch).shuffle(self._cached)
            self._epoch = epoch
        return self._cached

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            epoch, pos = divmod(self.cursor, self.n)
            out.append(self._order(epoch)[pos])
            self.cursor += 1
        return out
