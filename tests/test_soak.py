"""The soak's short variant (benchmarks/soak.py, issue 50 item 1) and the faults it survives.

- A few dozen seeded requests through one loaded cpu export (mixed prompt lengths, per-row limits, shared prefixes
  under a prefix cache that evicts all the time, speculative calls interleaved with plain ones, seeded sampled rows)
  at TP 1 and at TP 2: every row equals its solo run, the cache stays within its budget, nothing fails.
- A TP 2 worker killed during `generate`: the call ends within seconds with one line (`WorkerLostError`), the next
  call starts the workers again and answers exactly; a slot whose state the dead workers held is refused, not
  continued from nothing.
- KeyboardInterrupt inside `generate` (from a streamer, and SIGINT while the workers run a step): the model answers
  the next call exactly.

The long run (2,000 requests per TP degree) and its figures: docs/testing.md, "Soak".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from optimum_qwen35.errors import UsageError, WorkerLostError
from optimum_qwen35.runtime import Qwen35Runtime

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import soak  # noqa: E402

BATCH, MAX_LENGTH, BUCKETS = 2, 128, [64, 128]
PROMPT = [(7 * i + 3) % 512 for i in range(70)]  # 70 tokens: a block of 64 and a piece after it


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The TP 1 and TP 2 exports (QWEN35_SOAK_EXPORTS=DIR keeps them in DIR and reuses them: a rerun compiles nothing)."""
    keep = os.environ.get("QWEN35_SOAK_EXPORTS")
    root = Path(keep) if keep else tmp_path_factory.mktemp("soak")
    folders = {}
    for tp in (1, 2):
        folder = root / f"tp{tp}" / f"export-tp{tp}"
        if not (folder / "compiled" / "graphs.json").is_file():
            # One cache bucket and no per-position logits programs: a dozen programs, what the soak needs.
            folder = soak.build_export(root / f"tp{tp}", tp, BATCH, MAX_LENGTH, BUCKETS, token_buckets=[MAX_LENGTH],
                                       logits_buckets=[])
        folders[tp] = folder
    return folders


# TP 1 is a matrix point: TP 2 runs the same requests through the same runtime, plus the worker processes.
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.matrix), 2])
def test_a_short_soak_gives_every_request_its_solo_answer(exports, tp):
    lines = []
    figures = soak.soak(exports[tp], n=24, seed=tp, n_faults=1, log=lines.append, budget_blocks=4)
    assert figures["mismatches"] == [] and figures["leaks"] == [], "\n".join(lines)
    assert figures["faults"]["failed"] == [], "\n".join(lines)
    assert figures["faults"]["survived"] == (1 if tp == 1 else 2)
    assert figures["evictions"] > 0 and figures["cache_bytes_max"] <= figures["cache_budget"]
    assert figures["kinds"]["speculative"] and figures["kinds"]["sampled"]


def test_a_killed_worker_ends_the_call_in_one_line_and_the_next_call_restarts(exports):
    model = Qwen35Runtime.from_export(exports[2])
    try:
        expected = model.generate([PROMPT], max_new_tokens=12)
        victim = model.graphs.pids[1]
        killed = []

        def kill_at_step(step, tokens):
            if step == 3:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())

        with pytest.raises(WorkerLostError) as error:
            model.generate([PROMPT, PROMPT[:40]], max_new_tokens=12, streamer=kill_at_step)
        assert time.monotonic() - killed[0] < 10
        message = str(error.value)
        assert "\n" not in message and "rank 1" in message and "SIGKILL" in message, message
        assert model.graphs.pids == []  # every worker stopped: none left waiting on the dead rank
        # The slots' state died with the workers: continuing one is refused in one line, not computed from zeros.
        with pytest.raises(UsageError, match="holds no sequence"):
            model.decode([5], [len(PROMPT)], [0])
        assert model.generate([PROMPT], max_new_tokens=12) == expected
        assert model.graphs.restarts == 1 and len(model.graphs.pids) == 2
    finally:
        model.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_keyboard_interrupt_inside_generate_leaves_the_model_usable(exports, tp):
    model = Qwen35Runtime.from_export(exports[tp])
    try:
        expected = model.generate([PROMPT, PROMPT[:50]], max_new_tokens=10)

        def interrupt(step, tokens):
            if step == 2:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            model.generate([PROMPT[:30], PROMPT], max_new_tokens=10, streamer=interrupt)
        assert model.generate([PROMPT, PROMPT[:50]], max_new_tokens=10) == expected
        # SIGINT at a random moment of a long call (at TP 2, mostly while the workers run a step). Python's own
        # handler: a shell starts a background command with SIGINT ignored.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                try:
                    model.generate([PROMPT] * 12, max_new_tokens=40)
                finally:
                    timer.join()
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, previous)
        assert model.generate([PROMPT, PROMPT[:50]], max_new_tokens=10) == expected
    finally:
        model.close()
