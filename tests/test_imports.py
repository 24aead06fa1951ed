"""The package's import graph, read from the source (ast, nothing imported): the floors, no circles,
and only the entry points import the loop.

Floors, bottom to top (docs/design.md, "The floors"): core/ (what every floor needs: the config, its
recipe, what the model is, launch, the process environment, the journal, memory probes, faults, logs,
canaries, the platform switch) and algorithms/ (each estimator and policy loss declared once: the
config reads them) -> data/ and observe/ -> kernels/ (the fused math) ->
engines/ -> cycle/ -> run/ -> the public modules at the top of the package (`hybridrl`,
verifiers.py, rewards.py, envs.py, tasks.py, env.py: the roof, which may import anything). A module
imports from its own floor or below, never from a higher one, counting imports inside functions and
under TYPE_CHECKING (a lazy import only hides the dependency until the function runs). bench/,
scripts/ and tests/ sit above the package: it never imports them.

Before the ground floor (issue 52) 48 imports ran up the floors: run/config was imported from
every lower floor, data/collect drove the rollout engine, engines/vllm_compat asked cycle/plan for
its CUDA-graph sizes. Run this file to see each offending edge."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrl"
KERNELS = ROOT / "kernels"  # imported as hybridrl.kernels (hybridrl/kernels/__init__.py)
LOOP_IMPORTERS = {"hybridrl", "hybridrl.run.cli"}  # `hybridrl.train` and `hybridrl train`
# folder under hybridrl/ -> its floor; folders on one floor may import each other (no circles)
FLOORS = {
    "core": 0,
    "algorithms": 0,
    "data": 1,
    "sandbox": 1,
    "observe": 1,
    "kernels": 2,
    "engines": 3,
    "cycle": 4,
    "run": 5,
}
ROOF = 6  # hybridrl/__init__.py, __main__.py and the public modules beside it
ABOVE = 7  # bench/, scripts/, tests/: never imported by the package
OUTSIDE = ("bench", "scripts", "tests", "helpers")

pytestmark = pytest.mark.fast  # reads source files only (tests/README.md)


def _modules() -> dict[str, Path]:
    out = {}
    for path in [*PACKAGE.rglob("*.py"), *KERNELS.glob("*.py")]:
        if path.is_relative_to(KERNELS):
            parts = ["hybridrl", "kernels", path.stem]
        else:
            parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """What `name` imports anywhere in its source: the package's modules (a name imported from a
    package counts as its module when it is one, else as the package) and bench/scripts/tests."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    out = set()
    for target in found:
        if target.split(".")[0] in OUTSIDE:
            out.add(target.split(".")[0])
            continue
        if target != "hybridrl" and not target.startswith("hybridrl."):
            continue
        while target and target not in modules:  # hybridrl.core.config.Config -> hybridrl.core.config
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def floor(name: str) -> int:
    """The floor of a module of the package (or of bench/scripts/tests); a new folder needs one."""
    parts = name.split(".")
    if parts[0] in OUTSIDE:
        return ABOVE
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in FLOORS):
        return ROOF  # hybridrl, hybridrl.verifiers, ...
    if parts[1] not in FLOORS:
        raise KeyError(f"{name}: hybridrl/{parts[1]}/ has no floor; give it one in FLOORS (and docs/design.md)")
    return FLOORS[parts[1]]


def up_edges(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower floor to a higher one, as 'importer -> imported'."""
    return [
        f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if floor(b) > floor(a)
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle (its modules, the first repeated at the end) per strongly connected group
    of modules (Tarjan's algorithm); [] when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                group.add(stack.pop())
                if group and node in group:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the group's first module (breadth-first within the group)."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no circle in {group}")


def test_the_graph_sees_what_it_should():
    graph = _graph()
    assert "hybridrl.run.resolve" in graph["hybridrl.run.loop"]  # module level
    assert "hybridrl.run.resolve" in graph["hybridrl.run.evaluate"]  # inside `run`
    assert "hybridrl.run.loop" in graph["hybridrl"]  # inside `train`
    assert "hybridrl.kernels.logprob" in graph["hybridrl.kernels.fused_loss"]  # kernels/, under the package
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_floors_are_read_from_the_paths():
    assert floor("hybridrl.core.config") < floor("hybridrl.data.prompts") == floor("hybridrl.observe.progress")
    assert floor("hybridrl.algorithms.dapo") < floor("hybridrl.engines.rollout") < floor("hybridrl.cycle.sync")
    assert floor("hybridrl.cycle.sync") < floor("hybridrl.run.loop") < floor("hybridrl") == floor("hybridrl.verifiers")
    assert floor("hybridrl.data.tasks.arithmetic") == floor("hybridrl.data")
    assert floor("bench") > floor("hybridrl")
    with pytest.raises(KeyError, match="has no floor"):
        floor("hybridrl.attic.old")
    assert up_edges({"hybridrl.data.x": {"hybridrl.run.y", "hybridrl.core.z"}, "hybridrl.core.z": {"bench"}}) == [
        "hybridrl.core.z (floor 0) -> bench (floor 7)",
        "hybridrl.data.x (floor 1) -> hybridrl.run.y (floor 5)",
    ]


def test_no_import_runs_up_the_floors():
    edges = up_edges(_graph())
    assert not edges, (
        f"{len(edges)} imports from a lower floor to a higher one (move the module or the name):\n  "
        + "\n  ".join(edges)
    )


# What the pure math (algorithms/) may import of the package beyond itself: the config's types,
# which it reads under TYPE_CHECKING. core/ shares its floor but holds the distributed launcher
# (launch.all_sum) and the process environment, which a function of tensors must be handed, not reach.
MATH_MAY_IMPORT = {"hybridrl.core.config"}


def test_the_math_imports_only_itself_and_the_config():
    graph = _graph()
    edges = [
        f"{a} -> {b}"
        for a in sorted(graph)
        if a.startswith("hybridrl.algorithms")
        for b in sorted(graph[a])
        if not b.startswith("hybridrl.algorithms") and b not in MATH_MAY_IMPORT
    ]
    assert not edges, "algorithms/ reaches out of the math (pass the value or the function in):\n  " + "\n  ".join(
        edges
    )


def test_no_import_circles():
    found = circles(_graph())
    assert not found, f"{len(found)} import circles:\n  " + "\n  ".join(" -> ".join(c) for c in found)


def test_only_the_entry_points_import_the_loop():
    graph = _graph()
    assert {name for name, deps in graph.items() if "hybridrl.run.loop" in deps} == LOOP_IMPORTERS
