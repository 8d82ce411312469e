"""benchmarks/torchneuron_vs_transformers.py in its smallest form (`--smoke`: 3 short prompts, 4 new tokens): it runs
end to end through the check backend and prints its tables. Its numbers are not checked, the structure is, and
what must hold whatever the numbers: every side ran the same decode steps, no graph break, ours compiled only
graphs its export lists, and both sides' greedy tokens are equal (the same fp32 checkpoint)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
try:
    import torchneuron_vs_transformers as bench
finally:
    sys.path.pop(0)

HEADER = "| side | graphs compiled | known before the first prompt | recompilations |"


def summary_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def check_smoke_output(out: str) -> None:
    """What the smallest form's output must show (3 prompts of 17-90 tokens, 4 new tokens, 1 default-cache prompt)."""
    rows = summary_rows(out)
    assert sorted(rows) == sorted(bench.SIDES)
    for side, cells in rows.items():
        assert len(cells) == 9, (side, cells)
        assert cells[3] == "0", f"{side}: graph breaks"
    ours, static, default = rows["ours"], rows["transformers, static cache"], rows["transformers, default cache"]
    # 3 prompts x 3 decode steps (the first new token comes from the prefill) on both full sides; 1 prompt by default.
    assert ours[6] == static[6] == "9" and default[6] == "3"
    assert int(ours[0]) <= int(ours[1]) and ours[4] == "0"  # within the export's list, nothing ran uncompiled
    assert int(static[0]) >= 3 + 1  # a prefill graph per prompt length (17-90 tokens: one chunk each) and decode
    assert sum(line.startswith("| ours | context_encoding_128 |") for line in out.splitlines()) == 1
    assert "Greedy tokens, ours vs transformers static cache: 3/3 prompts identical" in out
    assert re.search(r"^Verdict: fixed set of graphs: (yes|NO) .* reads no more per decode step than transformers "
                     r"\(static cache\): (yes|NO) ", out, re.M)


def test_the_smallest_form_runs_and_prints_both_sides(capsys):
    threads = torch.get_num_threads()
    try:
        bench.main(["--smoke"])
    finally:
        torch.set_num_threads(threads)
    check_smoke_output(capsys.readouterr().out)
