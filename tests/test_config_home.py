"""The configuration's one home (issue 52): declared in core/schema.py, loaded and set in
core/config.py and core/recipe.py, resolved in run/resolve.py, frozen before the engines start.

Read with ast, the package's source is checked for any other module that rewrites a Config (the
setter `config.put`, `dataclasses.replace` of a config, an assignment to one of its fields or
sources); the resolved config is checked to refuse changes. Before: engine_cycle.plan_rollout and
keep_base_weights, Resume.adopt, the checkpoint writer, the critic and `hybridrl eval` each
rewrote it, after the run had printed and recorded it."""

import ast
import copy
import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hybridrl.core import config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrl"
# where a Config may be rewritten: its loading and recipes, the resolver, and the memory plan's
# decision function (called from resolve, through plan.fit)
HOMES = {"core/config.py", "core/recipe.py", "run/resolve.py"}
FUNCTIONS = {
    ("cycle/plan.py", "decide"),
    # a run directory's saved config as it is loaded (`--resume DIR`), before resolve
    ("run/checkpoint.py", "from_run_dir"),
}

pytestmark = pytest.mark.fast  # reads source files; resolves the demo's config (no engine)


def _config_names(fn: ast.AST) -> set[str]:
    """Names that hold a Config in `fn`: `cfg`, and any argument annotated as a Config."""
    names = {"cfg"}
    args = fn.args if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    for a in (args.posonlyargs + args.args + args.kwonlyargs) if args else ():
        if a.annotation is not None and "Config" in ast.unparse(a.annotation):
            names.add(a.arg)
    return names


def _is_config(node: ast.AST, names: set[str]) -> bool:
    """`cfg`, `self.cfg`, or a part of one (`cfg.train`, `cfg.sources`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr == "cfg":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def _rewrites(source: str, where: str) -> list[str]:
    """Every rewrite of a Config in `source`, as 'file:line function: code', outside the homes."""
    found = []

    def visit(node: ast.AST, fn: str, names: set[str], nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):  # named by its outermost function
                visit(child, fn if nested else child.name, _config_names(child) | names, True)
                continue
            bad = False
            if isinstance(child, ast.Call) and child.args:
                bad = ast.unparse(child.func).split(".")[-1] in (
                    "replace",
                    "put",
                    "_set",
                    "setattr",
                    "apply",
                    "demo_recipe",
                ) and _is_config(child.args[0], names)
            elif isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = child.targets if isinstance(child, (ast.Assign, ast.Delete)) else [child.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                bad = any(isinstance(t, (ast.Attribute, ast.Subscript)) and _is_config(t.value, names) for t in flat)
            if bad and (where, fn) not in FUNCTIONS:
                found.append(f"{where}:{child.lineno} {fn}: {ast.unparse(child)[:100]}")
            visit(child, fn, names, nested)

    visit(ast.parse(source), "<module>", set(), False)
    return found


def _offenders(package: Path) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where not in HOMES:
            out += _rewrites(path.read_text(), where)
    return out


def test_no_module_outside_the_homes_rewrites_a_config():
    offenders = _offenders(PACKAGE)
    assert not offenders, (
        "a Config is rewritten outside core/config.py, core/recipe.py and run/resolve.py (resolve "
        "it there, or return a decision made after the engines start beside it, as "
        "engine_cycle.plan_rollout's EngineSizing): " + "; ".join(offenders)
    )


def test_knobs_are_declared_in_the_schema_only():
    """Every setting is a field declared with schema.knob (its default, help and range): no module
    but core/schema.py declares one, and each of its groups is reachable from Config."""
    elsewhere = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != "core/schema.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "knob"
    ]
    assert not elsewhere, elsewhere
    assert all(f.metadata.get("help") for f in config.leaves().values())


def test_the_walk_sees_each_way_of_rewriting():
    source = """
import dataclasses
from dataclasses import replace
def f(cfg, other: Config, k):
    a = dataclasses.replace(cfg, train=replace(cfg.train, lr=1))
    b = config.put(other, "train.lr", 1, "x")
    cfg.train.lr = 2
    other.sources["train.lr"] = "x"
    del cfg.sources["x"]
    setattr(cfg.model, "path", "y")
    c = replace(k, zero=3)  # not a config
class T:
    def __init__(self, cfg):
        self.cfg = cfg  # kept, not changed
    def g(self):
        self.cfg.train.lr = 3
        return replace(self.cfg, log=None)
"""
    lines = [line.split(" ", 1)[0] for line in _rewrites(source, "x.py")]
    assert lines == ["x.py:5", "x.py:5", "x.py:6", "x.py:7", "x.py:8", "x.py:9", "x.py:10", "x.py:16", "x.py:17"]


def test_the_loop_hands_the_engines_the_resolved_config():
    """loop.train takes its config from resolve.run_config once and never assigns it again, so
    the Trainer, the Rollout and every engine built from `cfg` receive the frozen, resolved one."""
    tree = ast.parse((PACKAGE / "run" / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assigned = [
        n
        for n in ast.walk(train)
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "cfg"
            for t in ast.walk(ast.Tuple(elts=n.targets, ctx=ast.Store()) if isinstance(n, ast.Assign) else n.target)
        )
    ]
    values = [n.value.elts[0] if isinstance(n.value, ast.Tuple) else n.value for n in assigned]
    assert [ast.unparse(v) for v in values] == ["res.cfg"]
    calls = {ast.unparse(n.func): n for n in ast.walk(train) if isinstance(n, ast.Call)}
    for engine in ("Trainer", "Rollout"):
        assert ast.unparse(calls[engine].args[0]) == "cfg", engine


def test_the_resolved_config_refuses_changes(monkeypatch):
    """What resolve.run_config returns (the config the trainer and Rollout receive) is frozen: an
    assignment to a field, a group or its sources raises; dataclasses.replace and config.put still
    give a settable copy; the caller's config stays settable; it pickles and copies frozen."""
    import torch

    from hybridrl.core import recipe
    from hybridrl.run import resolve

    monkeypatch.setattr(recipe, "_free_ram", lambda: 8 << 30)
    world = SimpleNamespace(device=torch.device("cpu"), size=1, main=True, rank=0)
    mine = config.load(None, {"train.steps": 2})
    cfg = resolve.run_config(mine, world).cfg
    assert config.frozen(cfg) and not config.frozen(mine)
    with pytest.raises(dataclasses.FrozenInstanceError, match="resolved and frozen"):
        cfg.train.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout = config.RolloutConfig()
    with pytest.raises(TypeError, match="frozen"):
        cfg.sources["train.lr"] = "flag"
    with pytest.raises(TypeError, match="frozen"):
        cfg.sources.pop("train.steps")
    assert cfg.train.steps == 2 and cfg.sources["train.steps"] == "flag"
    with pytest.raises(TypeError, match="frozen"):
        cfg.rollout.stop.append("\n")  # a list-valued knob too
    with pytest.raises(TypeError, match="frozen"):
        cfg.train.betas[0] = 0.5
    assert cfg.train.betas == [0.9, 0.99] and yaml.safe_dump(config.to_dict(cfg))
    mine.train.lr = 1.0  # a notebook's own config: still its own to change
    copied = config.put(cfg, "train.lr", 0.5, "a test")
    assert copied.train.lr == 0.5 and cfg.train.lr != 0.5 and not config.frozen(copied)
    copied.train.lr = 0.25
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert again == cfg and config.frozen(again) and dict(again.sources) == dict(cfg.sources)
        with pytest.raises(dataclasses.FrozenInstanceError):
            again.train.lr = 1.0
    assert config.to_dict(cfg) == config.to_dict(dataclasses.replace(cfg))
