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
longer than `data.max_prompt_len` tokens (images counted expanded) are dropped and counted.

Images (a vision-language model's, `images.Vision`): a row's `images` column (a list; or `image`,
one) holds paths (relative to the directory of the data file or dataset directory), bytes, `datasets`
Image dicts or PIL images; the text says where each goes, in order, with an `<image>` marker (verl's
`prompt`) or a `{"type": "image"}` content part (TRL's `messages`, whose turns' content may be a
list of `{"type": "text", "text": ...}` and image parts). Each becomes the family's placeholder
string in the text before the chat template (any template works), so `Prompt.ids` hold one image
token per image, as vLLM takes them; the reward sees the text with `<image>` markers. A missing or
unreadable image, markers and images that differ in number, or images for a text-only model are
malformed rows like the others.
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
from hybridrl.core.families import VISION_FAMILIES
from hybridrl.data import images as image_io

log = logging.getLogger("hybridrl")


class DataError(UserError):
    """Malformed or missing data; names the file and line."""


@dataclass
class Prompt:
    text: str  # what the reward sees as the prompt (images as '<image>' markers)
    ids: list[int]  # token ids vLLM receives (chat template applied if any): one image token per image
    answer: str
    images: tuple = ()  # PIL images, RGB, fitted to the model's patch grid and pixel bounds (Vision.fit)
    image_tokens: tuple[int, ...] = ()  # the tokens each image becomes (Vision.tokens)

    @property
    def length(self) -> int:
        """Tokens of the prompt as the model runs it: each image's one token expanded to its own."""
        return len(self.ids) + sum(self.image_tokens) - len(self.image_tokens)


@dataclass
class Row:
    where: str  # how a user finds it: "train.jsonl:12", "train.parquet row 3"
    value: Any  # the parsed row; a dict when well formed
    problem: str = ""  # set by a reader that could not parse the row at all
    base: Path | None = None  # the directory an image path is relative to: the data file's


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
    reader = (lambda p: _saved_dataset(p, split)) if p.is_dir() else READERS.get(p.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown format {p.suffix!r}; use .jsonl, .json, .parquet, .csv "
            "or a directory written by datasets' save_to_disk"
        )
    rows = reader(p)
    for r in rows:
        r.base = p.parent  # an image path is relative to where the data is
    return rows


def load_rows(cfg: DataConfig, split: str) -> list[Row]:
    """split is 'train' or 'heldout'."""
    from hybridrl.data import tasks

    if cfg.path in tasks.BUILT_IN and not (split == "heldout" and cfg.heldout_path):
        return [Row(f"{cfg.path} {split} row {i}", r) for i, r in enumerate(tasks.task(cfg.path).load(split))]
    path = cfg.path if split == "train" else cfg.heldout_path
    return read_rows(path, cfg.split if split == "train" else cfg.heldout_split) if path else []


# --- rows -> prompts -----------------------------------------------------------------------------
MARKER = "<image>"  # where a plain prompt's (verl's) image goes


def _turns(row: dict, cfg: DataConfig) -> list[dict] | None:
    """A chat-format row's turns up to the last non-assistant one: `data.messages_key`'s, or a
    `data.prompt_key` that holds turns (verl's and TRL's conversational rows); None for a plain-prompt row."""
    if isinstance(row.get(cfg.prompt_key), list):
        turns = list(row[cfg.prompt_key])
    elif cfg.prompt_key in row or cfg.messages_key not in row:
        return None
    else:
        turns = list(row[cfg.messages_key] or [])
    while turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
        turns.pop()  # the reference reply of a chat dataset: the model writes its own
    return turns


def _part_ok(part: Any) -> bool:
    """A turn's content part: {"type": "text", "text": "..."} or {"type": "image"} (TRL's layout)."""
    return isinstance(part, dict) and (
        part.get("type") == "image" or (part.get("type") == "text" and isinstance(part.get("text"), str))
    )


def _chat_problem(turns: list, key: str) -> str:
    if not turns or not all(
        isinstance(t, dict)
        and isinstance(t.get("role"), str)
        and (
            isinstance(t.get("content"), str)
            or (isinstance(t.get("content"), list) and all(map(_part_ok, t["content"])))
        )
        for t in turns
    ):
        return (
            f'\'{key}\' must be a list of {{"role": ..., "content": "..."}} turns with at least one before the '
            'assistant\'s (a content may be a list of {"type": "text", "text": "..."} and {"type": "image"} parts)'
        )
    if not any(t["role"] == "user" and t["content"] for t in turns):
        return f"'{key}' has no non-empty user turn"
    return ""


def _image_values(row: dict) -> list:
    """The row's images: its `images` column (a list, TRL's and verl's) or its `image` (one)."""
    value = row.get("images")
    if value is None:
        value = row.get("image")
        return [] if value is None else [value]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def render(content: str | list, placeholder: str) -> tuple[str, str, int]:
    """A prompt's or turn's content as (the text the tokenizer gets, each image `placeholder`;
    the text the reward sees, each image a '<image>' marker; the images it places)."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    model, reward, n = [], [], 0
    for part in parts:
        if part["type"] == "image":
            model.append(placeholder)
            reward.append(MARKER)
            n += 1
        else:
            model.append(part["text"].replace(MARKER, placeholder))
            reward.append(part["text"])
            n += part["text"].count(MARKER)
    return "".join(model), "".join(reward), n


def _image_problem(row: Row, vision: image_io.Vision | None, placed: int) -> tuple[list, list[int], str]:
    """The row's images loaded and fitted, the tokens each becomes, and what is wrong with them ('')."""
    values, problem = _image_values(row.value), ""
    if vision is None:
        problem = (
            f"a row with {max(len(values), placed)} image(s), but the model is text-only (not a vision-language "
            f"family: {', '.join(sorted(VISION_FAMILIES))}); train a vision-language model or give rows "
            "without images"
        )
    elif placed != len(values):
        problem = (
            f'{placed} image marker(s) (\'{MARKER}\' in the text or {{"type": "image"}} parts) for '
            f"{len(values)} image(s) in 'images': give one marker per image, in the images' order"
        )
    if problem or vision is None:
        return [], [], problem
    loaded = []
    for i, value in enumerate(values):
        try:
            loaded.append(vision.fit(image_io.load(value, row.base)))
        except ValueError as e:
            why = str(e)
            if "no such file" in why:
                why += "; a path is relative to the data file's directory"
            elif "unreadable" in why:
                why += "; give an image file PIL reads (PNG, JPEG, WebP, ...)"
            return [], [], f"images[{i}]: {why}"
    return loaded, [vision.tokens(im) for im in loaded], ""


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
    spec, bad = _code_tests(row)
    if bad:
        return bad
    if spec is not None and cfg.answer_key and cfg.answer_key not in row:  # its tests are its answer
        row = {**row, cfg.answer_key: ""}
    turns = _turns(row, cfg)
    if turns is not None:
        if cfg.answer_key and cfg.answer_key not in row:
            return f"no '{cfg.answer_key}' field (has {sorted(map(str, row))}); set data.answer_key"
        key = cfg.prompt_key if cfg.prompt_key in row else cfg.messages_key
        return _chat_problem(turns, key) or (
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


def _prompt(
    row: Row, tokenizer, cfg: DataConfig, vision: image_io.Vision | None, template: bool, as_given: bool
) -> tuple[Prompt | None, str]:
    """A well-formed row as a Prompt, or what is wrong with its images. `template`: wrap a plain
    prompt in the chat template; `as_given`: it carries the template's markers already."""
    value = row.value
    turns = _turns(value, cfg)
    placeholder = vision.placeholder if vision is not None else MARKER  # text-only: a marker stays text
    if turns is not None:
        rendered = [(t["role"], *render(t["content"], placeholder)) for t in turns]
        chat = [{"role": role, "content": text} for role, text, _, _ in rendered]
        text = [reward for role, _, reward, _ in rendered if role == "user"][-1]
        placed = sum(n for *_, n in rendered)
        parts = any(isinstance(t["content"], list) and any(p["type"] == "image" for p in t["content"]) for t in turns)
    else:
        model_text, text, placed = render(value[cfg.prompt_key], placeholder)
        chat, parts = [{"role": "user", "content": model_text}], False
    pictures: list = []
    tokens: list[int] = []
    if _image_values(value) or parts or (vision is not None and placed):
        pictures, tokens, problem = _image_problem(row, vision, placed)
        if problem:
            return None, problem
    if turns is not None and not getattr(tokenizer, "chat_template", None):  # chat format: always templated
        key = cfg.prompt_key if cfg.prompt_key in value else cfg.messages_key
        raise DataError(
            f"{row.where}: chat-format rows ('{key}') need a tokenizer with a chat "
            "template; set tokenizer.chat_template or give plain prompts"
        )
    if turns is not None or (template and not as_given):
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:  # a rendered prompt brings its own special tokens (a second BOS would not be the template's)
        model_text = chat[0]["content"]
        ids = (tokenizer(model_text, add_special_tokens=False) if as_given else tokenizer(model_text))["input_ids"]
    if vision is not None and list(ids).count(vision.image_token_id) != len(pictures):
        return None, (
            f"its tokens hold {list(ids).count(vision.image_token_id)} image token(s) for {len(pictures)} "
            f"image(s): the text holds {vision.family.image_token!r} itself, or the chat template drops an image; "
            f"mark images with '{MARKER}' only"
        )
    return Prompt(text, list(ids), _row_answer(value, cfg), tuple(pictures), tuple(tokens)), ""


def encode(
    rows: list[Row], tokenizer, cfg: DataConfig, source: str, vision: image_io.Vision | None = None
) -> tuple[list[Prompt], dict[str, int]]:
    """Check and tokenize rows; returns the kept prompts and how many were dropped, by reason
    ({"too_long": n, "malformed": m}). `data.answer_key` '' means rows carry no answer. `vision`:
    how the model takes images (`images.Vision.of`); None, a text-only model, refuses rows with images."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "on" and not has_template:
        raise ConfigError("data.chat_template=on but the tokenizer has no chat template; set data.chat_template=off")
    use_template = cfg.chat_template == "on" or (cfg.chat_template == "auto" and has_template)
    as_given = cfg.chat_template != "off" and has_template and rendered_prompts(rows, tokenizer, cfg, source)
    out, too_long, malformed, first = [], 0, 0, ""
    for row in rows:
        prompt, problem = None, row.problem or _problem(row.value, cfg)
        if not problem:
            prompt, problem = _prompt(row, tokenizer, cfg, vision, use_template, as_given)
        if problem or prompt is None:
            if cfg.on_error != "skip":
                raise DataError(f"{row.where}: {problem} (data.on_error=skip skips malformed rows)")
            malformed += 1
            first = first or f"{row.where}: {problem}"
            continue
        if prompt.length > cfg.max_prompt_len:  # images counted as the tokens they become
            too_long += 1
            continue
        out.append(prompt)
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
