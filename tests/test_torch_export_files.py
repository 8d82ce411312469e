"""patches/torch_export.py `torch_export_files_faster`: the cpu target's program files saved and loaded faster,
unchanged; and export/compile.py's traces without per-node stack traces.

torch.export's loader works out a schema class's fields and hints for every object it builds, and its saver deep
copies the program it has just serialized; the patch caches the first (on torch 2.13 / 2.14, the whole conversion
per class) and pickles the second. What must hold: the saved archive holds the same bytes entry by entry, the loaded
program is the same graph and computes the same values, the JSON converts to the same schema objects as torch's own
function gives, the hints are computed once per class, and another torch version is left alone."""

from __future__ import annotations

import copy
import json
import typing
import zipfile

import pytest
import torch
from torch._export.serde import serialize

from optimum_qwen35 import patches
from optimum_qwen35.export.compile import _export
from optimum_qwen35.patches import torch_export

NEW_LOADER = torch.__version__.startswith(("2.13.", "2.14."))  # where _dict_to_dataclass itself is replaced


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, state):
        state.index_copy_(0, torch.tensor([0]), x[:1])  # an in-place state update, as the model's graphs do
        return torch.nn.functional.softplus(self.linear(x)).cumsum(-1) + state.sum()


def _program():
    torch.manual_seed(0)
    return torch.export.export(Small(), (torch.randn(2, 8), torch.zeros(2, 8)))


def _entries(path) -> list[bytes]:
    with zipfile.ZipFile(path) as archive:  # the entries' names carry the file's own name
        return [archive.read(name) for name in archive.namelist()]


@pytest.fixture
def unpatched(monkeypatch):
    """The serializer as torch ships it, whatever this process patched before; the patch undone afterwards."""
    monkeypatch.setattr(serialize, "typing", typing)
    monkeypatch.setattr(serialize, "copy", copy)
    current = serialize._dict_to_dataclass  # (this process may have exported or loaded a program before)
    monkeypatch.setattr(serialize, "_dict_to_dataclass", getattr(current, "original", current))


def test_the_saved_file_and_the_loaded_program_do_not_change(unpatched, tmp_path):
    program = _program()
    torch.export.save(program, tmp_path / "plain.pt2")
    plain = torch.export.load(tmp_path / "plain.pt2")
    patches.torch_export_files_faster()
    assert isinstance(serialize.typing, torch_export._TypingWithCachedHints)
    assert isinstance(serialize._dict_to_dataclass, torch_export._SchemaFromJson) == NEW_LOADER
    torch.export.save(program, tmp_path / "patched.pt2")
    assert _entries(tmp_path / "patched.pt2") == _entries(tmp_path / "plain.pt2")
    loaded = torch.export.load(tmp_path / "plain.pt2")
    assert loaded.graph_module.code == plain.graph_module.code
    x, state = torch.randn(2, 8), torch.zeros(2, 8)
    expected_state = state.clone()
    expected = plain.module()(x, expected_state)
    assert torch.equal(loaded.module()(x, state), expected) and torch.equal(state, expected_state)


def test_the_loader_asks_each_classs_hints_once(unpatched, tmp_path, monkeypatch):
    torch.export.save(_program(), tmp_path / "program.pt2")
    asked = []
    original = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda obj, *a, **k: asked.append(obj) or original(obj, *a, **k))
    torch.export.load(tmp_path / "program.pt2")
    plain = list(asked)
    assert len(plain) > 2 * len(set(plain))  # what the patch is for: the same classes asked again and again
    asked.clear()
    patches.torch_export_files_faster()
    torch.export.load(tmp_path / "program.pt2")
    torch.export.load(tmp_path / "program.pt2")
    assert len(asked) == len(set(asked)) == len(set(plain))  # each class once, over two loads


def test_another_torch_version_is_left_alone(unpatched, monkeypatch, caplog):
    monkeypatch.setitem(patches.SUPPORTED, "torch", ("0.1.",))
    patches._supported.cache_clear()
    try:
        patches.torch_export_files_faster()
    finally:
        patches._supported.cache_clear()
    assert serialize.typing is typing and serialize.copy is copy
    assert not isinstance(serialize._dict_to_dataclass, torch_export._SchemaFromJson)
    assert "not a version its patch 'torch_export_files_faster' was written for" in caplog.text


@pytest.mark.skipif(not NEW_LOADER, reason="torch 2.8 keeps its own _dict_to_dataclass (the cached hints only)")
def test_the_json_converts_to_the_same_schema_objects(unpatched):
    """Every schema object of a real program (graph, nodes, arguments, tensor metadata, signature) is what torch's own
    function builds, and so are the branches a program seldom takes: None for an Optional, a key the class does not
    declare (ignored), an empty list (returned as it is), a malformed union (the same error)."""
    original = serialize._dict_to_dataclass
    converter = torch_export._SchemaFromJson(serialize)
    artifact = serialize.serialize(_program())
    data = json.loads(artifact.exported_program.decode("utf-8"))
    assert converter(serialize.ExportedProgram, data) == original(serialize.ExportedProgram, data)
    signature = data["graph_module"]["signature"]
    for cls, value in [
        (serialize.GraphSignature, {**signature, "a key of a newer torch": 1}),
        (typing.Optional[serialize.TensorMeta], None),
        (typing.List[serialize.Node], []),
        (serialize.Argument, {"as_int": 3}),
        (float, 2),
    ]:
        assert converter(cls, value) == original(cls, value), cls
    assert type(converter(float, 2)) is float
    empty = []
    assert converter(typing.List[serialize.Node], empty) is empty
    for bad in ({"as_int": 1, "as_float": 2.0}, [1]):
        with pytest.raises(AssertionError) as theirs:
            original(serialize.Argument, bad)
        with pytest.raises(AssertionError) as ours:
            converter(serialize.Argument, bad)
        assert str(ours.value) == str(theirs.value)


def test_export_records_no_stack_traces_and_restores_torchs_setting():
    """export/compile.py `_export`: no node carries the Python stack trace that torch.fx would record (paths of the
    machine that made the export, a fifth of the trace's time) where torch can leave it out; the setting is torch's
    own again afterwards."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    torch.manual_seed(0)
    program = _export(Small(), (torch.randn(2, 8), torch.zeros(2, 8)))
    assert getattr(config, "do_not_emit_stack_traces", None) == before
    def traces(program):
        return [node.meta.get("stack_trace") for node in program.graph.nodes if node.op == "call_function"]

    plain = torch.export.export(Small(), (torch.randn(2, 8), torch.zeros(2, 8)))
    assert traces(plain) and all(traces(plain))  # what torch records by default
    if before is None:  # torch 2.8: no such setting; the traces are recorded as torch does
        assert all(traces(program))
    else:
        assert traces(program) and not any(traces(program))
