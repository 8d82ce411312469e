"""The nox sessions' split of the tests (noxfile.py): what the optimum session leaves to the reference session must
not depend on the environment that differs between them (transformers 4.57 vs 5, optimum-neuron)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
ENVIRONMENT_PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "optimum.")


def _noxfile_list(name: str) -> list[str]:
    for node in ast.walk(ast.parse((ROOT / "noxfile.py").read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py has no {name}")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
    return names


def test_the_tests_only_the_reference_session_runs_import_nothing_environment_specific():
    paths = []
    for entry in _noxfile_list("ENVIRONMENT_FREE_TESTS"):
        path = ROOT / entry
        assert path.exists(), entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for path in paths:
        found = sorted(m for m in _imports(path) if m == "optimum" or m.startswith(ENVIRONMENT_PACKAGES))
        assert not found, f"{path.relative_to(ROOT)} imports {found}: the optimum session must run it too"


def test_the_heaviest_files_are_collected_first_and_the_others_keep_their_order():
    """tests/conftest.py's SLOW_FILES_FIRST names test files that exist, and puts their tests first in its order."""
    from tests.conftest import SLOW_FILES_FIRST, _slow_files_first

    assert [path for path in SLOW_FILES_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(SLOW_FILES_FIRST)) == len(SLOW_FILES_FIRST)

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    first, second = SLOW_FILES_FIRST[:2]
    names = ["tests/a.py::x", f"{second}::y", "tests/b.py::z", f"{first}::u", f"{second}::v", "tests/a.py::w"]
    items = [Item(name) for name in names]
    _slow_files_first(items)
    assert [item.nodeid for item in items] == [
        f"{first}::u", f"{second}::y", f"{second}::v", "tests/a.py::x", "tests/b.py::z", "tests/a.py::w"]
