"""Prompts in: read rows from a file (or the demo task), tokenize once, hand out seeded batches.

Malformed input fails with the file and line and what to change; prompts longer than
`data.max_prompt_len` tokens are dropped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .config import DataConfig, UserError

log = logging.getLogger("hybridrl")


class DataError(UserError):
    """Malformed or missing data; names the file and line."""


@dataclass
class Prompt:
    text: str
    ids: list[int]  # token ids vLLM receives (chat template applied if any)
    answer: str


def read_rows(path: str) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} not found")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        return rows
    if suffix == ".json":
        rows = json.loads(p.read_text())
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of objects")
        return rows
    if suffix in (".parquet", ".csv"):
        try:
            import pandas as pd
        except ImportError:
            raise DataError(f"{path}: reading {suffix} needs pandas (and pyarrow for parquet): pip install pandas pyarrow") from None
        frame = pd.read_parquet(p) if suffix == ".parquet" else pd.read_csv(p, dtype=str, keep_default_na=False)
        return frame.to_dict(orient="records")
    raise DataError(f"{path}: unknown format {suffix!r}; use .jsonl, .json, .parquet or .csv")


def load_rows(cfg: DataConfig, split: str) -> list[dict]:
    """split is 'train' or 'heldout'."""
    if cfg.path == "demo" and not (split == "heldout" and cfg.heldout_path):
        from .tasks import arithmetic
        return arithmetic.load(split)
    path = cfg.path if split == "train" else cfg.heldout_path
    return read_rows(path) if path else []


def encode(rows: list[dict], tokenizer, cfg: DataConfig, source: str) -> tuple[list[Prompt], int]:
    """Tokenize rows; returns the kept prompts and how many were too long."""
    use_template = cfg.chat_template == "on" or (cfg.chat_template == "auto" and getattr(tokenizer, "chat_template", None))
    out, too_long = [], 0
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{source} row {n}: expected an object with a '{cfg.prompt_key}' field, "
                            f"got {type(row).__name__}")
        if cfg.prompt_key not in row:
            raise DataError(f"{source} row {n}: no '{cfg.prompt_key}' field (has {sorted(row)}); set data.prompt_key")
        text = row[cfg.prompt_key]
        if not isinstance(text, str) or not text:
            raise DataError(f"{source} row {n}: '{cfg.prompt_key}' must be non-empty text, got {text!r}; "
                            "fix or drop that row")
        if use_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text)["input_ids"]
        if len(ids) > cfg.max_prompt_len:
            too_long += 1
            continue
        out.append(Prompt(text, list(ids), str(row.get(cfg.answer_key, ""))))
    if too_long:
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
                    source, too_long, len(rows), cfg.max_prompt_len)
    return out, too_long


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
