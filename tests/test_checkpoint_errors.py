"""Checkpoint loading and sharded-export error paths, and what loading must tolerate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum_qwen35.checkpoint import CheckpointError, CheckpointReader
from optimum_qwen35.checkpoint.convert import check_checkpoint, convert_checkpoint
from optimum_qwen35.checkpoint.shard import MANIFEST, convert_and_shard, rank_file
from optimum_qwen35.checkpoint.sharded_files import load_sharded, save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.runtime.eager import load_decoder
from tests.kit import build_tiny_checkpoint

PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {layout: build_tiny_checkpoint(root / layout, layout, seed=1) for layout in ("tiny-2b", "tiny-nv2x")}


@pytest.fixture
def nv2x(pristine, tmp_path):
    """A private copy of the single-file tiny-nv2x checkpoint, free to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(pristine["tiny-nv2x"], path)
    return path


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def check(path):
    check_checkpoint(CheckpointReader(path), Qwen35Config.from_pretrained(path))


def test_pristine_checkpoints_pass_and_skip_vision_and_mtp(pristine):
    for path in pristine.values():
        reader = CheckpointReader(path)
        check_checkpoint(reader, Qwen35Config.from_pretrained(path))
        assert not any(n.startswith(("visual", "mtp", "model.")) for n in reader.names())
    keys = load_file(pristine["tiny-nv2x"] / "model.safetensors").keys()
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("mtp.") for k in keys)


def test_missing_tensor_is_listed(nv2x):
    rewrite(nv2x, lambda t: t.pop(PREFIX + "layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): layers.1.linear_attn.A_log"):
        check(nv2x)


def test_unexpected_tensor_is_listed(nv2x):
    rewrite(nv2x, lambda t: t.__setitem__(PREFIX + "layers.0.mlp.experts.weight", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"unexpected \(1\): layers.0.mlp.experts.weight"):
        check(nv2x)


def test_wrong_shape_is_listed(nv2x):
    def edit(t):
        name = PREFIX + "layers.3.self_attn.k_proj.weight"
        t[name] = t[name][:32].clone()

    rewrite(nv2x, edit)
    with pytest.raises(CheckpointError, match=r"wrong shape \(1\): layers.3.self_attn.k_proj.weight: \(32, 96\)"):
        check(nv2x)


def test_all_problems_in_one_error_and_every_entry_point_raises_it(nv2x, tmp_path):
    def edit(t):
        t.pop(PREFIX + "norm.weight")
        t[PREFIX + "layers.9.mlp.up_proj.weight"] = torch.zeros(1)
        t[PREFIX + "embed_tokens.weight"] = t[PREFIX + "embed_tokens.weight"][:100].clone()

    rewrite(nv2x, edit)
    config = Qwen35Config.from_pretrained(nv2x)
    for call in (
        lambda: check(nv2x),
        lambda: next(convert_checkpoint(CheckpointReader(nv2x), config)),
        lambda: next(convert_and_shard(CheckpointReader(nv2x), config, 2, 0)),
        lambda: load_decoder(nv2x),
        lambda: save_sharded(nv2x, None, 2, tmp_path / "out", progress=False),
    ):
        with pytest.raises(CheckpointError) as err:
            call()
        message = str(err.value)
        assert "missing (1): norm.weight" in message
        assert "unexpected (1): layers.9.mlp.up_proj.weight" in message
        assert "wrong shape (1): embed_tokens.weight: (100, 96)" in message
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_bare_text_only_checkpoint_and_tied_lm_head_copy(nv2x, pristine):
    """`model.*` keys (a text-only export) load the same, and a tied checkpoint may carry lm_head.weight."""

    def edit(t):
        for key in list(t):
            if key.startswith(PREFIX):
                t["model." + key[len(PREFIX) :]] = t.pop(key)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    rewrite(nv2x, edit)
    config = Qwen35Config.from_pretrained(nv2x)
    assert config.tie_word_embeddings
    check(nv2x)
    bare = dict(convert_checkpoint(CheckpointReader(nv2x), config))
    original = dict(convert_checkpoint(CheckpointReader(pristine["tiny-nv2x"]), config))
    assert bare.keys() == original.keys() and all(torch.equal(bare[k], original[k]) for k in bare)


def test_index_naming_a_missing_file(pristine, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(pristine["tiny-2b"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"index names missing files \\['{victim}'\\]"):
        CheckpointReader(path)
    with pytest.raises(FileNotFoundError, match="missing files"):
        load_decoder(path)


def test_no_safetensors(pristine, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(pristine["tiny-2b"] / "config.json", path / "config.json")
    torch.save({}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        CheckpointReader(path)


def test_invalid_tp_degree_names_valid_ones(pristine, tmp_path):
    path = pristine["tiny-2b"]
    config = Qwen35Config.from_pretrained(path)
    assert config.valid_tp_degrees() == [1, 2, 4]
    for call in (
        lambda: load_decoder(path, tp_degree=3),
        lambda: next(convert_and_shard(CheckpointReader(path), config, 8, 0)),
        lambda: save_sharded(path, None, 3, tmp_path / "out", progress=False),
    ):
        with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4\]"):
            call()
    from tests.kit.tp import run_tensor_parallel  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4\]"):
        run_tensor_parallel(path, 8, [[1, 2]], 1)


class FailingReader(CheckpointReader):
    """A reader whose disk 'fails' on one tensor, to interrupt an export halfway."""

    def get(self, name):
        if name == "layers.2.mlp.up_proj.weight":
            raise OSError("simulated read failure")
        return super().get(name)


def test_interrupted_export_does_not_look_complete(pristine, tmp_path):
    """A failed export leaves no folder behind; a failed --overwrite leaves the previous export whole."""
    path, out = pristine["tiny-2b"], tmp_path / "out"
    with pytest.raises(OSError, match="simulated read failure"):
        save_sharded(FailingReader(path), None, 2, out, progress=False)
    assert not out.exists() and not list(tmp_path.iterdir()), "a failed first export left files behind"
    save_sharded(path, None, 2, out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(OSError, match="simulated read failure"):
        save_sharded(FailingReader(path), None, 2, out, progress=False, overwrite=True)
    # The good export is untouched (manifest included) and no temporary folder or file is left.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert load_sharded(out, 1, 2)[1] == 2  # still a complete, loadable TP = 2 export
    # A complete export for another degree replaces it whole: no stale rank_1 file.
    save_sharded(path, None, 1, out, progress=False, overwrite=True)
    assert sorted(p.name for p in out.glob("rank_*")) == ["rank_0.safetensors"]
    load_decoder(out)
    # An export folder without its manifest (from an older version, or a copy) is refused as incomplete.
    (out / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete sharded export"):
        load_decoder(out, tp_degree=1)


def test_export_with_a_damaged_rank_file(pristine, tmp_path):
    out = save_sharded(pristine["tiny-2b"], None, 1, tmp_path / "out", progress=False)
    with open(out / rank_file(0), "ab") as f:
        f.write(b"junk")
    with pytest.raises(CheckpointError, match="wrong size"):
        load_decoder(out)


def test_corrupt_safetensors_file_gets_a_clear_error(tmp_path):
    from optimum_qwen35.checkpoint import CheckpointReader
    from tests.kit import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "ckpt", "tiny-nv2x")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + data[8:200])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        CheckpointReader(folder)
