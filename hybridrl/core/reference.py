"""The settings reference docs/configuration.md carries, made from the schema (never written by hand):
every knob `hybridrl train --help` lists, by group, with its default, the demo's value, its choices or
valid range, and its help. `python -m bench.render` writes it between the file's markers and its
`--check` (a test) fails when the schema and the page differ."""

from __future__ import annotations

import dataclasses
import typing

from hybridrl.core.config import DEMO, GROUPS, _field_type, leaves


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, bool):
        return str(value).lower()
    return '`""`' if value == "" else f"`{value}`"


def _accepts(key: str, f: dataclasses.Field) -> str:
    tp = _field_type(*key.split("."))
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(tp))
    return f.metadata.get("valid", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_markdown() -> str:
    """One table per config group: setting, default (the demo's where it has its own), what it
    accepts, and the help text."""
    out = []
    for group in GROUPS:
        rows = [f"### {group}", "", "| setting | default | accepts | what it does |", "|---|---|---|---|"]
        for key, f in leaves().items():
            if key.split(".")[0] != group:
                continue
            default = _default(f) + (f" (demo: `{DEMO[key]}`)" if key in DEMO else "")
            rows.append(f"| `--{key}` | {default} | {_accepts(key, f)} | {_cell(f.metadata['help'])} |")
        out.append("\n".join(rows))
    return "\n\n".join(out)
