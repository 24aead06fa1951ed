"""The built-in tasks `data.path` names: the demo's addition, its long-tailed variant (partial
rollouts), the code task (code_tests) and the vision-language task (cells: an image in every
prompt). Each module has `load(split)`; those with a model of their own (the demo model warmed on
the task) name it in `MODEL_DIR`."""

from __future__ import annotations

import importlib
from types import ModuleType

BUILT_IN = {"demo": "arithmetic", "longtail": "longtail", "code": "code", "vision": "cells"}  # data.path -> module


def task(name: str) -> ModuleType:
    return importlib.import_module(f"hybridrl.data.tasks.{BUILT_IN[name]}")
