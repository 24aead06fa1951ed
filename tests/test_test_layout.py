"""The test tree's own rule: a test module imports no other test module; what tests share lives in
tests/helpers/ (or conftest fixtures). Before tests/helpers/, 23 files made 33 such imports: running
one test file imported (and collected the top level of) others, and `from tests.test_plan import`
loaded test_plan a second time under another name. Read with ast: nothing is imported."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def _imported(path: Path) -> set[str]:
    """Every module name `path` imports, at its top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def test_no_test_module_imports_another():
    offenders = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in sorted(_imported(path))
        if _is_test_module(name)
    ]
    assert not offenders, "move the shared helper into tests/helpers/: " + "; ".join(offenders)


def test_the_rule_sees_both_spellings(tmp_path):
    bad = tmp_path / "test_x.py"
    bad.write_text(
        "import pytest\nfrom test_train_e2e import train_cli\n\ndef f():\n    from tests.test_plan import shape\n"
    )
    assert {n for n in _imported(bad) if _is_test_module(n)} == {"test_train_e2e", "tests.test_plan"}
    assert not _is_test_module("helpers.cli")
