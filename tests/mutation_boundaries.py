"""Boundary mutants of the runtime's bucket, chunk and slot arithmetic (issue 22), scored apart from mutmut's.

mutmut 3.8 swaps `<` and `<=` but has no operator that moves an integer expression by one (`n` -> `n - 1`), and it
does not mutate the runtime (`noxfile.py` MUTATED). This script does both for the functions of
`optimum_qwen35/runtime/eager.py` that choose buckets, split chunks, place positions and stop rows:
- comparisons: `<` <-> `<=`, `>` <-> `>=`;
- `bisect_left` <-> `bisect_right`;
- every integer expression of the bucket and chunk arithmetic moved by one, down and up: slice bounds, the arguments
  of `bucket_for`, `key_bucket_for`, `bisect_*`, `range`, `torch.arange`, `min`, `max`, the value of each
  augmented assignment (`done[i] += len(chunk)`, `b *= 2`), and the right side of `first = ...`, `end = ...`.

Each mutant is written into a staging copy of the committed tree (`git archive HEAD`, laid out as the package
installs, in `.mutation-boundaries/`), and the selected tests run against it (`-x`, one thread, a time limit of
3x the unmutated run: a mutant that makes a loop run forever counts as killed by the timeout). The result: one line per
mutant and the score, written to `.mutation-boundaries/results.txt`.

    python tests/mutation_boundaries.py            # every mutant (nox -s mutation_boundaries)
    python tests/mutation_boundaries.py --list     # list them only
    python tests/mutation_boundaries.py 3 17       # only these (numbers from --list)
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / ".mutation-boundaries"
TARGET = "optimum_qwen35/runtime/eager.py"
FUNCTIONS = {
    "default_buckets", "default_key_buckets", "bucket_for", "key_bucket_for", "_check_length", "_seq_ids",
    "prefill", "decode", "logits", "generate",
}  # fmt: skip
ARITHMETIC_CALLS = {"bucket_for", "key_bucket_for", "bisect_left", "bisect_right", "range", "arange", "min", "max"}
ASSIGNED = {"first", "end"}
# Not integers: moving these by one is a TypeError on the first call (a mutant any test kills, which says nothing).
NOT_INTEGERS = (ast.Starred, ast.List, ast.ListComp, ast.GeneratorExp, ast.Tuple, ast.Set, ast.Dict)
SEQUENCES = {"buckets", "key_buckets", "positions", "outputs", "prompts", "results"}
TESTS = [
    "tests/test_scenarios.py",
    "tests/test_generation_loop.py",
    "tests/test_fuzz_inputs.py",
    "tests/test_bad_input.py",
]
SELECT = "not nan_weights and not as_a_process"  # test_bad_input's slow cases, which no bucket arithmetic reaches
TIMEOUT_FACTOR, TIMEOUT_MIN_S = 3, 90  # a mutant's run may take 3x the unmutated run (at least 90 s)


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _offset(lines: list[str], line: int, col: int) -> int:
    return sum(len(x) for x in lines[: line - 1]) + col


def mutants(source: str) -> list[tuple[str, int, str, str]]:
    """(description, line, old text, new source) of every boundary mutant of `source`."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    found: dict[tuple[int, int, str], tuple[str, int, str, str]] = {}

    def splice(node, new_text, what):
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno, node.end_col_offset)
        old = source[start:end]
        key = (start, end, new_text)
        if key not in found:
            found[key] = (f"{what}: `{old}` -> `{new_text}`", node.lineno, old, source[:start] + new_text + source[end:])

    def move(node, why):
        if isinstance(node, ast.Constant) and not isinstance(node.value, int) or isinstance(node, NOT_INTEGERS):
            return
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in SEQUENCES:
            return
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno, node.end_col_offset)
        text = source[start:end]
        for sign in ("-", "+"):
            splice(node, f"({text}) {sign} 1", f"{why} {sign} 1")

    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name not in FUNCTIONS:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Compare):
                for op, right, left in zip(node.ops, node.comparators, [node.left, *node.comparators]):
                    swap = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}.get(type(op))
                    if swap is None:
                        continue
                    a = _offset(lines, left.end_lineno, left.end_col_offset)
                    b = _offset(lines, right.lineno, right.col_offset)
                    gap = source[a:b]
                    new_gap = gap.replace(gap.strip(), swap)
                    key = (a, b, new_gap)
                    if key not in found:
                        found[key] = (
                            f"comparison in {function.name}: `{gap.strip()}` -> `{swap}`",
                            left.end_lineno,
                            gap.strip(),
                            source[:a] + new_gap + source[b:],
                        )
            elif isinstance(node, ast.Call):
                name = _call_name(node)
                if name in ("bisect_left", "bisect_right"):
                    other = "bisect_right" if name == "bisect_left" else "bisect_left"
                    splice(node.func, ast.unparse(node.func).replace(name, other), f"{name} in {function.name}")
                if name in ARITHMETIC_CALLS:
                    for arg in node.args:
                        move(arg, f"argument of {name} in {function.name}")
            elif isinstance(node, ast.Slice):
                for bound in (node.lower, node.upper):
                    if bound is not None:
                        move(bound, f"slice bound in {function.name}")
            elif isinstance(node, ast.AugAssign):
                move(node.value, f"augmented assignment in {function.name}")
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ASSIGNED for t in node.targets):
                move(node.value, f"`{node.targets[0].id} = ...` in {function.name}")
    return sorted(found.values(), key=lambda m: (m[1], m[0]))


def stage() -> None:
    """The committed tree (HEAD), laid out as the package installs (kernels/<sub> as optimum_qwen35/kernels/<sub>)."""
    shutil.rmtree(STAGE, ignore_errors=True)
    STAGE.mkdir()
    archive = STAGE / "head.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), "HEAD", "optimum_qwen35", "kernels", "tests",
                    "setup.cfg"], cwd=ROOT, check=True)  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(STAGE)
    archive.unlink()
    for sub in (STAGE / "kernels").iterdir():  # kernels/<sub> is optimum_qwen35.kernels.<sub> (setup.py)
        shutil.move(sub, STAGE / "optimum_qwen35" / "kernels" / sub.name)
    (STAGE / "kernels").rmdir()


def run_tests(timeout: float | None = None) -> tuple[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(STAGE)}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", SELECT, *TESTS]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=STAGE, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if result.returncode == 0:
        return "survived", seconds
    if result.returncode == 1:
        failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
        return f"killed by {failed[0] if failed else 'a failing test'}", seconds
    return f"error (pytest exit {result.returncode}): {result.stdout[-300:]}", seconds


def main(argv: list[str]) -> int:
    source = (ROOT / TARGET).read_text() if "--list" in argv else None
    if source is None:
        stage()
        source = (STAGE / TARGET).read_text()
    found = mutants(source)
    chosen = [int(a) for a in argv if a.isdigit()] or list(range(len(found)))
    if "--list" in argv:
        for i in chosen:
            print(f"{i:3d}  line {found[i][1]:4d}  {found[i][0]}")
        print(f"{len(found)} boundary mutants of {TARGET}")
        return 0
    target = STAGE / TARGET
    outcome, seconds = run_tests()
    if outcome != "survived":
        print(f"the tests fail on the unmutated tree ({outcome}): fix that first")
        return 1
    timeout = max(TIMEOUT_MIN_S, TIMEOUT_FACTOR * seconds)
    print(f"unmutated: the selected tests pass in {seconds:.0f} s (time limit {timeout:.0f} s); {len(chosen)} mutants")
    results = []
    try:
        for i in chosen:
            description, line, _, mutated = found[i]
            target.write_text(mutated)
            outcome, seconds = run_tests(timeout)
            results.append(f"{i:3d}  line {line:4d}  {outcome:60s} {seconds:5.0f} s  {description}")
            print(results[-1], flush=True)
    finally:
        target.write_text(source)
    killed = sum("killed" in r for r in results)
    survived = [r for r in results if "survived" in r]
    summary = f"{TARGET}: {len(results)} boundary mutants, {killed} killed, {len(survived)} survived, score {killed / max(len(results), 1):.1%}"
    (STAGE / "results.txt").write_text("\n".join(results + ["", summary, ""]))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
