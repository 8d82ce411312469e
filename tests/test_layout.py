"""The package's layout, read from its source: no import cycle, no test kit in the product, and every deferred
import says why it is deferred.

The graph holds every import of the installed package (`optimum_qwen35/` and the repository's `kernels/`, installed
as `optimum_qwen35.kernels`), at module level and inside functions alike: a cycle through a deferred import is a
cycle of the design even where Python never trips on it. An edge goes to the most specific module named
(`from a.b import c` is an edge to `a.b.c` when that is a module, else to `a.b`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "optimum_qwen35"
# Where each part of the installed package lives in the repository.
SOURCES = {PACKAGE: ROOT / PACKAGE, f"{PACKAGE}.kernels": ROOT / "kernels"}
# What the product never imports: the test kit and the tests.
TEST_KIT = ("tests",)


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


class Import:
    def __init__(self, module: str, target: str, line: int, deferred: bool, comment: str):
        self.module, self.target, self.line, self.deferred, self.comment = module, target, line, deferred, comment

    def __repr__(self):
        return f"{self.module}:{self.line} -> {self.target}"


def _comments(source: str) -> dict[int, str]:
    out = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out[token.start[0]] = token.string
    return out


def _module_level(tree: ast.Module) -> set[int]:
    """Imports that run when the module is imported: its body, and inside module-level if / try / with blocks."""
    ids = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                ids.add(id(node))
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)) and isinstance(block, list):
                    visit(block)

    visit(tree.body)
    return ids


def imports(modules: dict[str, Path]) -> list[Import]:
    found = []
    for module, path in modules.items():
        source = path.read_text()
        tree = ast.parse(source)
        top, comments = _module_level(tree), _comments(source)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in modules else name for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            # The comment that says why: on the import's lines, or on the line just above.
            lines = range(node.lineno - 1, (node.end_lineno or node.lineno) + 1)
            comment = " ".join(comments.get(n, "") for n in lines)
            for target in dict.fromkeys(targets):
                found.append(Import(module, target, node.lineno, id(node) not in top, comment))
    return found


def cycles(modules: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({e.target for e in edges if e.module == m and e.target in modules and e.target != m}) for m in modules}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return components


MODULES = package_modules()
IMPORTS = imports(MODULES)


def test_the_graph_is_read():
    """The reader sees the package (a reader that found nothing would pass every check below)."""
    assert f"{PACKAGE}.modeling.decoder" in MODULES and f"{PACKAGE}.kernels.gated_delta_rule" in MODULES
    assert any(e.target == f"{PACKAGE}.modeling.deltanet" for e in IMPORTS)
    assert any(e.deferred for e in IMPORTS) and any(not e.deferred for e in IMPORTS)


def test_no_import_cycle():
    found = cycles(MODULES, IMPORTS)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    modules = {"a": Path("a.py"), "b": Path("b.py"), "c": Path("c.py")}
    edges = [Import("a", "b", 1, True, ""), Import("b", "c", 1, False, ""), Import("c", "a", 1, False, "")]
    assert cycles(modules, edges) == [["a", "b", "c"]]
    assert cycles(modules, edges[:2]) == []


def test_the_product_imports_no_test_kit():
    wrong = [e for e in IMPORTS if e.target.split(".")[0] in TEST_KIT or e.target.startswith(f"{PACKAGE}.testing")]
    assert not wrong, f"the installed package imports the tests or their kit: {wrong}"


BENCHMARKS = {f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py"))}


def test_the_benchmarks_import_no_test_kit():
    """Benchmarks run from a fresh clone on the product's code path: no import of the tests or their kit, at module
    level or in a function, and no loading of a file under tests/ by its path (data files, such as the shipped
    config.json copies, may be read)."""
    assert len(BENCHMARKS) > 10, "the benchmarks/ folder is read"
    wrong = [e for e in imports(BENCHMARKS) if e.target.split(".")[0] in TEST_KIT]
    loaded = [f"{m}: {line.strip()}" for m, path in BENCHMARKS.items() for line in path.read_text().splitlines()
              if re.search(r"tests[./](kit|oracle|conftest)|^\s*(from|import) tests\b", line)]
    assert not wrong and not loaded, f"benchmarks that use the tests or their kit: {wrong + loaded}"


def test_the_benchmark_import_check_finds_a_test_import(tmp_path):
    planted = tmp_path / "bench.py"
    planted.write_text("def main():\n    from tests.kit.neuron_xla import lower  # planted\n")
    assert [e.target for e in imports({"benchmarks.bench": planted})] == ["tests.kit.neuron_xla"]


@pytest.mark.parametrize("top_level", ["kernels", "testing"])
def test_nothing_imports_a_repository_folder_as_a_top_level_package(top_level):
    """`kernels/` is installed as `optimum_qwen35.kernels`: a top-level `kernels` is Hugging Face's package."""
    wrong = [e for e in IMPORTS if e.target == top_level or e.target.startswith(f"{top_level}.")]
    assert not wrong, wrong


def reason(comment: str) -> str:
    """What a comment says besides linter codes (`# noqa: PLC0415` alone gives no reason)."""
    return re.sub(r"noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?|#", "", comment).strip(" ()")


def test_every_deferred_import_says_why():
    """An import inside a function is there for an optional dependency or for start-up time: its line (or the line
    above) says which, in a comment."""
    assert reason("# noqa: PLC0415") == "" and reason("# noqa: PLC0415 (optional dependency)") == "optional dependency"
    silent = [e for e in IMPORTS if e.deferred and not reason(e.comment)]
    assert not silent, "deferred imports without a reason:\n" + "\n".join(map(repr, silent))


MAX_LINES = 500
LONG_FILES_ALLOWED = ("kernels.emulator",)  # the NKI emulator: one module per part of NKI's API, each its whole surface


def test_no_product_file_is_over_500_lines():
    """One job per file: a module of the installed package past 500 lines is split by its jobs (issue 50), except the
    NKI emulator's."""
    long = {m: n for m, path in package_modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES
            and not m.startswith(tuple(f"{PACKAGE}.{a}" for a in LONG_FILES_ALLOWED))}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    assert any(m.startswith(f"{PACKAGE}.kernels.emulator") for m in package_modules()), "the exception names a real folder"
