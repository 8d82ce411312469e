"""Exports cast to another dtype (`save_sharded(dtype=...)`, `shard --dtype`), and the checkpoint reader's other paths:
several .safetensors files without an index, a truncated file, a header whose byte counts disagree with the shapes."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from optimum_qwen35.checkpoint import CheckpointReader
from optimum_qwen35.checkpoint.shard import MANIFEST, convert_and_shard, rank_file
from optimum_qwen35.checkpoint.sharded_files import save_sharded
from optimum_qwen35.cli import main
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import CheckpointError
from optimum_qwen35.runtime import Qwen35Runtime
from tests.kit import build_tiny_checkpoint

PROMPTS = [[5, 17, 300, 42, 7, 99, 12], [3, 200]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """fp32 on disk, nv = 3 nk, dk != dv, untied: every sharding kind has something to do."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("src") / "nv3x", "tiny-nv3x", seed=4)


def dtypes_on_disk(file):
    with safe_open(file, "pt") as f:
        return {key: f.get_slice(key).get_dtype() for key in f.keys()}


@pytest.mark.parametrize("tp_degree", [1, 2])
def test_export_cast_to_bf16(ckpt, tmp_path, tp_degree):
    """Every rank file holds bf16 tensors whose values are the fp32 shards rounded to bf16, except the DeltaNet gate
    parameters (A_log, dt_bias), which the precision policy keeps fp32; the manifest says so."""
    out = save_sharded(ckpt, None, tp_degree, tmp_path / "bf16", dtype="bfloat16", progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dtype"] == ["BF16", "F32"] and manifest["tp_degree"] == tp_degree
    reader, config = CheckpointReader(ckpt), Qwen35Config.from_pretrained(ckpt)
    for rank in range(tp_degree):
        on_disk = dtypes_on_disk(out / rank_file(rank))
        saved = load_file(out / rank_file(rank))
        want = dict(convert_and_shard(reader, config, tp_degree, rank))
        assert saved.keys() == want.keys()
        for name, tensor in want.items():
            assert tensor.dtype == torch.float32  # the source is fp32: the cast is the export's
            kept_fp32 = name.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))
            assert on_disk[name] == ("F32" if kept_fp32 else "BF16"), name
            assert torch.equal(saved[name], tensor if kept_fp32 else tensor.to(torch.bfloat16)), name


def test_export_keeps_the_source_dtype_unless_told(tmp_path):
    """A bf16 checkpoint (as on the Hub) exports bf16 without --dtype, fp32 with dtype=float32, exactly."""
    src = build_tiny_checkpoint(tmp_path / "src", "tiny-nv2x", seed=2, dtype="bfloat16")
    kept = save_sharded(src, None, 1, tmp_path / "kept", progress=False)
    widened = save_sharded(src, None, 1, tmp_path / "fp32", dtype=torch.float32, progress=False)
    assert set(dtypes_on_disk(kept / rank_file(0)).values()) == {"BF16"}
    assert set(dtypes_on_disk(widened / rank_file(0)).values()) == {"F32"}
    a, b = load_file(kept / rank_file(0)), load_file(widened / rank_file(0))
    assert all(torch.equal(a[n].float(), b[n]) for n in a)
    # Loaded at the same dtype, the export and the checkpoint are the same model.
    whole = Qwen35Runtime.from_pretrained(src, batch_size=2, max_length=64).logits(PROMPTS)
    for folder in (kept, widened):
        got = Qwen35Runtime.from_pretrained(folder, batch_size=2, max_length=64).logits(PROMPTS)
        assert all(torch.equal(x, y) for x, y in zip(got, whole))


def test_shard_command_dtype_writes_what_save_sharded_writes(ckpt, tmp_path, capsys):
    args = ["shard", "--model", str(ckpt), "--tensor-parallel-size", "2", "--dtype", "bfloat16", str(tmp_path / "cli")]
    assert main(args) == 0
    api = save_sharded(ckpt, None, 2, tmp_path / "api", dtype=torch.bfloat16, progress=False)
    for rank in range(2):
        assert (tmp_path / "cli" / rank_file(rank)).read_bytes() == (api / rank_file(rank)).read_bytes()


def split_without_index(src, dst):
    """The checkpoint's tensors spread over three files, no index (as some exporters write)."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    keys = sorted(tensors)
    for i in range(3):
        save_file({k: tensors[k] for k in keys[i::3]}, dst / f"part-{i}.safetensors", metadata={"format": "pt"})
    return keys


def test_several_files_without_an_index(ckpt, tmp_path):
    keys = split_without_index(ckpt, tmp_path / "split")
    reader = CheckpointReader(tmp_path / "split")
    assert sorted(reader.names()) == sorted(CheckpointReader(ckpt).names())
    assert len({reader._files[n] for n in reader.names()}) == 3 and len(keys) > len(reader.names())  # mtp.* skipped
    whole = Qwen35Runtime.from_pretrained(ckpt, batch_size=2, max_length=64)
    split = Qwen35Runtime.from_pretrained(tmp_path / "split", batch_size=2, max_length=64)
    assert all(torch.equal(x, y) for x, y in zip(split.logits(PROMPTS), whole.logits(PROMPTS)))


def single_file_copy(ckpt, dst):
    dst.mkdir()
    (dst / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    (dst / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    return dst / "model.safetensors"


def last_tensor(file):
    size = int.from_bytes(file.read_bytes()[:8], "little")
    header = json.loads(file.read_bytes()[8 : 8 + size])
    text = [k for k in header if k.startswith(("model.language_model.", "lm_head."))]
    return max(text, key=lambda k: header[k]["data_offsets"][1]), header, size


def test_truncated_file_names_the_file_and_the_tensor(ckpt, tmp_path):
    file = single_file_copy(ckpt, tmp_path / "cut")
    key, header, size = last_tensor(file)
    data = file.read_bytes()
    file.write_bytes(data[: 8 + size + header[key]["data_offsets"][1] - 100])  # ends 100 bytes into its last tensor
    reader = CheckpointReader(file.parent)
    name = next(n for n in reader.names() if reader._keys[n] == key)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors is truncated \(tensor {key}\)"):
        reader.get(name)
    with pytest.raises(CheckpointError, match="is truncated"):
        Qwen35Runtime.from_pretrained(file.parent, max_length=16)


def test_byte_count_that_disagrees_with_the_shape(ckpt, tmp_path):
    """A header that says F16 for an F32 tensor (same header length): the byte count gives it away."""
    file = single_file_copy(ckpt, tmp_path / "bad")
    key, header, size = last_tensor(file)
    assert header[key]["dtype"] == "F32"
    header[key]["dtype"] = "F16"
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (size - len(blob))
    assert len(blob) == size
    data = file.read_bytes()
    file.write_bytes(data[:8] + blob + data[8 + size :])
    start, end = header[key]["data_offsets"]
    numel = torch.Size(header[key]["shape"]).numel()
    reader = CheckpointReader(file.parent)
    name = next(n for n in reader.names() if reader._keys[n] == key)
    with pytest.raises(CheckpointError, match=rf"tensor {key} has {end - start} bytes, {numel * 2} expected"):
        reader.get(name)


def test_export_folder_describes_itself_and_reports_progress(ckpt, tmp_path, capsys):
    """What an export holds besides the weights: the manifest (exactly), each rank file's safetensors metadata, the
    source's config and side files unchanged, and a progress bar counting the source's bytes."""
    import shutil

    from tqdm import tqdm

    from optimum_qwen35.checkpoint.shard import MANIFEST_FORMAT, MANIFEST_VERSION

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    (src / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    out = save_sharded(src, None, 2, tmp_path / "out")  # progress is on by default

    config = Qwen35Config.from_pretrained(src)
    manifest = json.loads((out / MANIFEST).read_text())
    files = [{"rank": r, "file": rank_file(r), "bytes": (out / rank_file(r)).stat().st_size} for r in range(2)]
    assert manifest == {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "tp_degree": 2, "dtype": ["F32"],
        "tie_word_embeddings": config.tie_word_embeddings, "source": str(src), "files": files,
    }
    for r in range(2):
        with safe_open(out / rank_file(r), "pt") as f:
            assert f.metadata() == {"format": "pt", "tp_degree": "2", "rank": str(r)}
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name

    with safe_open(src / "model.safetensors", "pt") as f:  # the decoder's fp32 tensors, counted from the file itself
        decoder_keys = [k for k in f.keys() if k.startswith("model.language_model.") or k == "lm_head.weight"]
        total = sum(4 * torch.Size(f.get_slice(k).get_shape()).numel() for k in decoder_keys)
    size = tqdm.format_sizeof(total, divisor=1024)
    err = capsys.readouterr().err
    assert "shard TP=2: 100%" in err and f"{size}/{size}" in err and "B/s" in err, err[-300:]


def test_convert_and_shard_yields_owned_contiguous_copies_in_the_requested_dtype(ckpt):
    """Each yielded shard owns exactly its bytes (it keeps no source tensor alive), is contiguous, and is the shard in
    the requested dtype (the DeltaNet gate parameters stay fp32)."""
    reader, config = CheckpointReader(ckpt), Qwen35Config.from_pretrained(ckpt)
    fp32 = dict(convert_and_shard(reader, config, 2, 1))
    for name, shard in convert_and_shard(reader, config, 2, 1, dtype=torch.bfloat16):
        kept_fp32 = name.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))
        assert shard.dtype == (torch.float32 if kept_fp32 else torch.bfloat16), name
        assert shard.is_contiguous() and shard.untyped_storage().nbytes() == shard.numel() * shard.element_size(), name
        assert torch.equal(shard, fp32[name].to(shard.dtype)), name
    for name, shard in fp32.items():
        assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size(), name


def _rewrite(out, rank, tensors):
    """Replace a rank file of an export and fix its byte count in the manifest (so only the content is wrong)."""
    save_file(tensors, out / rank_file(rank), metadata={"format": "pt"})
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][rank]["bytes"] = (out / rank_file(rank)).stat().st_size
    (out / MANIFEST).write_text(json.dumps(manifest))


def test_loading_an_export_checks_rank_manifest_and_tensors(ckpt, tmp_path):
    """load_sharded refuses, each with its own message: a rank outside the export, a manifest of another format or
    version (or not an object), a rank file missing a tensor or holding one of the wrong shape (named)."""
    from optimum_qwen35.checkpoint.sharded_files import load_sharded
    from optimum_qwen35.errors import UsageError

    out = save_sharded(ckpt, None, 2, tmp_path / "out", progress=False)
    for rank in (-1, 2):
        with pytest.raises(UsageError, match=r"outside 0\.\.1"):
            load_sharded(out, rank)
    good = (out / MANIFEST).read_text()
    for change in ({"format": "other"}, {"version": 99}):
        (out / MANIFEST).write_text(json.dumps({**json.loads(good), **change}))
        with pytest.raises(CheckpointError, match="is not a optimum-qwen35-tp-shards v1 manifest"):
            load_sharded(out, 0)
    (out / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointError, match="is not a optimum-qwen35-tp-shards v1 manifest"):
        load_sharded(out, 0)
    (out / MANIFEST).write_text(good)

    tensors = load_file(out / rank_file(1))
    del tensors["norm.weight"]
    tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:-1].clone()
    _rewrite(out, 1, tensors)
    with pytest.raises(CheckpointError) as err:
        load_sharded(out, 1)
    assert "missing ['norm.weight'], unexpected [], wrong shape ['layers.0.mlp.up_proj.weight']" in str(err.value)


def test_streaming_writer_header_checks_and_abort(tmp_path):
    """The writer's header is 8-byte aligned (as safetensors writes it), it refuses a tensor whose name, dtype or
    shape differs from the header's, and abort() removes the partial file, even after a commit elsewhere."""
    from optimum_qwen35.checkpoint.sharded_files import StreamingSafetensorsWriter

    entries = [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (5,))]
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", entries, {"k": "v"})
    for bad in (("a", torch.zeros(2, 3, dtype=torch.float64)), ("a", torch.zeros(3, 2)), ("b", torch.zeros(2, 3))):
        with pytest.raises(Exception):
            writer.write(*bad)
    writer.abort()
    assert writer.file.closed and list(tmp_path.iterdir()) == []  # the descriptor released, the partial file gone

    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", entries, {"k": "v"})
    writer.write("a", torch.arange(6.0).reshape(2, 3))
    writer.write("b", torch.ones(5, dtype=torch.bfloat16))
    writer.commit()
    writer.abort()  # after a commit (an error in another rank's file): nothing to remove, no error
    for n in range(9):  # headers of nine consecutive lengths: every padding case
        path = tmp_path / f"pad{n}.safetensors"
        padded = StreamingSafetensorsWriter(path, [("a", torch.float32, (1,))], {"k": "v" * n})
        padded.write("a", torch.ones(1))
        padded.commit()
        assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0, n
        assert load_file(path)["a"].item() == 1.0
    loaded = load_file(tmp_path / "x.safetensors")
    assert torch.equal(loaded["a"], torch.arange(6.0).reshape(2, 3)) and loaded["b"].dtype == torch.bfloat16
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_export_errors_name_the_command_and_the_source(ckpt, tmp_path):
    from optimum_qwen35.errors import UsageError

    with pytest.raises(UsageError, match="^shard needs a model"):
        save_sharded(None, None, 1, tmp_path / "out")
    src = tmp_path / "nan"
    import shutil

    shutil.copytree(ckpt, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.language_model.norm.weight"][0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        save_sharded(src, None, 2, tmp_path / "out", progress=False)
    assert str(src) in str(err.value) and "norm.weight (1 NaN" in str(err.value)
