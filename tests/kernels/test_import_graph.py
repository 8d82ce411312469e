"""No import cycle among the kernels' modules (kernels/ and optimum_qwen35/kernels/, as the package installs them),
counting every import, at module level or inside a function; and every import inside a function says why it is
deferred (a comment on its line or the line above)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "optimum_qwen35.kernels"


def modules() -> dict[str, Path]:
    """Module name -> file, laid out as setup.py installs them (kernels/<sub> is optimum_qwen35.kernels.<sub>)."""
    found = {PACKAGE + ".__init__": ROOT / "optimum_qwen35" / "kernels" / "__init__.py"}
    for path in (ROOT / "optimum_qwen35" / "kernels").glob("*.py"):
        found[f"{PACKAGE}.{path.stem}"] = path
    for path in (ROOT / "kernels").rglob("*.py"):
        found[PACKAGE + "." + ".".join(path.relative_to(ROOT / "kernels").with_suffix("").parts)] = path
    return found


def package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    return name.rsplit(".", 2)[0] if name.endswith(".__init__") else name.rsplit(".", 1)[0]


def imports(name: str, path: Path, known: set[str]):
    """(imported module, line, deferred) for every import of a module of `known` (a package counts as its
    __init__)."""

    def resolve(module: str) -> str | None:
        if module in known:
            return module
        if module + ".__init__" in known:
            return module + ".__init__"
        return None

    tree = ast.parse(path.read_text())
    deferred_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f)}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(name, path)
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name`, the module.
            targets = [f"{module}.{alias.name}" if resolve(f"{module}.{alias.name}") else module for alias in node.names]
        for target in targets:
            resolved = resolve(target)
            if resolved and resolved != name:
                yield resolved, node.lineno, id(node) in deferred_nodes


def test_no_import_cycle_among_the_kernels_modules():
    found = modules()
    graph = {name: {target for target, _, _ in imports(name, path, set(found))} for name, path in found.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_deferred_imports_say_why():
    found = modules()
    missing = []
    for name, path in found.items():
        lines = path.read_text().splitlines()
        for _, line, deferred in imports(name, path, set(found)):
            if deferred and "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {lines[line - 1].strip()}")
    assert missing == [], "\n".join(missing)
