"""The package's import graph, read from the source (ast, nothing imported): no module imports one
that imports it back, counting imports inside functions too (a lazy import only hides a circle
until the function runs), and only the entry points import the loop. Before: run.evaluate imported
run.loop inside `run` while run.loop imported run.evaluate at the top. hybridrl.kernels (the
Triton/torch kernels, kernels/ in the repository) is left out: it imports nothing of hybridrl's."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridrl"
LOOP_IMPORTERS = {"hybridrl", "hybridrl.run.cli"}  # `hybridrl.train` and `hybridrl train`


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if not name.startswith("hybridrl.kernels"):
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (a name imported from a
    package counts as its module when it is one, else as the package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    out = set()
    for target in found:
        if not target.startswith("hybridrl") or target.startswith("hybridrl.kernels"):
            continue
        while target and target not in modules:  # hybridrl.run.config.Config -> hybridrl.run.config
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_what_it_should():
    graph = _graph()
    assert "hybridrl.run.resolve" in graph["hybridrl.run.loop"]  # module level
    assert "hybridrl.run.resolve" in graph["hybridrl.run.evaluate"]  # inside `run`
    assert "hybridrl.run.loop" in graph["hybridrl"]  # inside `train`
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_only_the_entry_points_import_the_loop():
    graph = _graph()
    assert {name for name, deps in graph.items() if "hybridrl.run.loop" in deps} == LOOP_IMPORTERS
