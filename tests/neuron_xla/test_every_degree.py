"""Every (target, degree) the package calls valid, built and lowered as the export builds them (issue 42, item 2).

neuronx-distributed's parallel state reads os.environ["LOCAL_WORLD_SIZE"] on trn1-family hardware (trn1, inf2) at
TP 4, which nothing sets outside `torchrun`: the package sets it (to the export's world size, when unset) where it
builds the graphs (`create_graph_builders`, called by the export and by the load before any parallel state). The
cases test_neuron_graphs.py's alias test does not already build (TP 1 and 2) are built here: TP 4 on each target.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.optimum_neuron.neuron_config import NEURON_TARGETS
from tests.kit.neuron_xla import (
    CONTEXT, LOGITS, TOKENS, build_graphs, export_config, lower, model_class, neuron_config, traced_parallel_state,
)

from ..conftest import FIXTURES
from .test_neuron_graphs import ALIAS_CASES

LAYOUT = FIXTURES / "tiny-nv3x"
TARGETS = ("trn1", "inf2", "trn2")
DEGREES = Qwen35Config.from_pretrained(LAYOUT).valid_tp_degrees()
NEW_CASES = [(target, 4, dtype) for target, dtype in (("trn1", torch.float32), ("inf2", torch.bfloat16),
                                                       ("trn2", torch.bfloat16))]


def test_every_valid_target_and_degree_is_built_somewhere():
    assert set(TARGETS) == set(NEURON_TARGETS) - {"trn1n"}  # trn1n: trn1's graphs
    built = {(t, p) for t, p, _ in ALIAS_CASES + NEW_CASES}
    assert built == {(t, d) for t in TARGETS for d in DEGREES}, DEGREES


@pytest.fixture
def no_local_world_size(monkeypatch):
    """The environment of a plain `optimum-cli export neuron` / `from_pretrained` (no torchrun)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize(("target", "tp", "dtype"), NEW_CASES, ids=[f"{t}-tp{p}-{str(d)[6:]}" for t, p, d in NEW_CASES])
def test_tp4_graphs_build_and_lower_on_every_target(no_local_world_size, target, tp, dtype):
    nc = neuron_config(LAYOUT, target, tp, dtype)
    # what the export does first: the graph builders (they set what neuronx-distributed's parallel state reads)
    model_class().create_graph_builders(export_config(LAYOUT, nc), nc)
    assert os.environ.get("LOCAL_WORLD_SIZE") == str(tp)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(LAYOUT, nc)
        assert sorted(graphs) == sorted([CONTEXT, TOKENS, LOGITS])
        for key, graph in graphs.items():
            lowered = lower(graph)
            if key == LOGITS:
                assert lowered.num_outputs == 1 and graph.alias_names == {}
                continue
            # every held state resolves to its aliased output, as at TP 1 and 2
            for name, output in graph.alias_names.items():
                assert lowered.parameter_ids[name] >= 0, (key, name, output)


def test_a_given_local_world_size_is_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    nc = neuron_config(LAYOUT, "trn1", 4, torch.bfloat16)
    model_class().create_graph_builders(export_config(LAYOUT, nc), nc)
    assert os.environ["LOCAL_WORLD_SIZE"] == "8"


def test_a_second_export_in_the_same_process_gets_its_own_world_size(no_local_world_size):
    for tp in (1, 4, 2):
        nc = neuron_config(LAYOUT, "trn1", tp, torch.bfloat16)
        model_class().create_graph_builders(export_config(LAYOUT, nc), nc)
        assert os.environ["LOCAL_WORLD_SIZE"] == str(tp)
