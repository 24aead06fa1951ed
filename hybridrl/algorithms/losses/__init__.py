"""The policy losses, one module each; importing this package registers every one of them
(algorithms/registry.py). A new loss is a new module here and its test (docs/losses.md says how)."""

import importlib
import pkgutil

# ppo, the default, first: the order of the schema's choices
for _module in sorted((m.name for m in pkgutil.iter_modules(__path__)), key=lambda name: (name != "ppo", name)):
    importlib.import_module(f"{__name__}.{_module}")
