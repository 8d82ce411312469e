"""patches.py `torch_export_files_faster`: the cpu target's program files saved and loaded faster, unchanged.

torch.export's loader asks `typing.get_type_hints` of a schema class for every object it builds, and its saver deep
copies the program it has just serialized; the patch caches the first and pickles the second. What must hold: the
saved archive holds the same bytes entry by entry, the loaded program is the same graph and computes the same values,
the hints are computed once per class, and another torch version is left alone."""

from __future__ import annotations

import copy
import typing
import zipfile

import pytest
import torch
from torch._export.serde import serialize

from optimum_qwen35 import patches


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


def test_the_saved_file_and_the_loaded_program_do_not_change(unpatched, tmp_path):
    program = _program()
    torch.export.save(program, tmp_path / "plain.pt2")
    plain = torch.export.load(tmp_path / "plain.pt2")
    patches.torch_export_files_faster()
    assert isinstance(serialize.typing, patches._TypingWithCachedHints)
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
    assert "not a version its patch 'torch_export_files_faster' was written for" in caplog.text
