"""Bad input gets this package's error, with a message that says what was wrong and what to do (issue 11).

One table per entry point: the Python API (TP = 1 and, where it applies, TP = 2), the checkpoint and export
writers, and the command line (one line on stderr, exit status 2 for usage errors and 1 for failures, no
traceback). Every case is a real call on a real tiny checkpoint; nothing is mocked, except that `mp.spawn`
is replaced by a function that fails the test, to show that a TP = 2 error is raised before any process
starts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum_qwen35.checkpoint.shard import MANIFEST, rank_file
from optimum_qwen35.checkpoint.sharded_files import load_sharded, save_sharded
from optimum_qwen35.cli import main
from optimum_qwen35.errors import (
    CheckpointError,
    IncompatibleExportError,
    ModelNotFoundError,
    Qwen35Error,
    UsageError,
)
from tests.kit import tp as tp_runtime
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder
from tests.kit.tp import run_tensor_parallel
from tests.kit import build_tiny_checkpoint

VOCAB = 512  # the tiny checkpoints' vocabulary
PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny single-file checkpoint (tiny-nv2x, tied embeddings), shared read-only."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bad-input") / "ckpt", "tiny-nv2x", seed=1)


@pytest.fixture(scope="module")
def export2(ckpt, tmp_path_factory):
    return save_sharded(ckpt, None, 2, tmp_path_factory.mktemp("export") / "tp2", progress=False)


@pytest.fixture(scope="module")
def model(ckpt):
    return Qwen35Runtime.from_pretrained(ckpt, batch_size=2, max_length=32)


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if any worker process would start."""

    def spawn(*args, **kwargs):
        raise AssertionError("a worker process was started before the input was checked")

    monkeypatch.setattr(tp_runtime.mp, "spawn", spawn)


def nan_checkpoint(ckpt, path, name=PREFIX + "layers.0.mlp.up_proj.weight", value=float("nan")):
    shutil.copytree(ckpt, path)
    tensors = load_file(path / "model.safetensors")
    tensors[name][0, :3] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------------------------------ token ids, sizes
BAD_IDS = [
    ("negative id", [[1, -5, 2]], "prompts[0][1] = -5 is negative: it must be in [0, 512)"),
    ("id == vocab", [[1, 512]], "prompts[0][1] = 512 is outside this model's vocabulary of 512"),
    ("id 10**6", [[10**6]], "prompts[0][0] = 1000000 is outside this model's vocabulary of 512"),
    ("float ids", [[1.9, 2.2]], "prompts[0][0] = 1.9 (float) is not an integer"),
    ("bool id", [[True, 2]], "prompts[0][0] = True (bool) is not an integer"),
    ("float tensor", [torch.tensor([1.0, 2.0])], "prompts[0] has dtype torch.float32; token ids must be integers"),
    ("string prompt", ["hello"], "prompts[0] is a string; token ids are integers: tokenize the text first"),
    ("flat list", [1, 2, 3], "wrap one prompt as [[...]]"),
    ("empty prompt", [[5], []], "empty prompt: prompts[1] has no token; every prompt needs at least one"),
    ("second prompt bad", [[5], [3, 600]], "prompts[1][1] = 600 is outside"),
]


@pytest.mark.parametrize("label,prompts,message", BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_bad_token_ids_tp1(model, label, prompts, message):
    for call in (
        lambda: model.generate(prompts, max_new_tokens=2),
        lambda: model.logits(prompts),
        lambda: model.prefill(prompts, list(range(len(prompts)))),
    ):
        with pytest.raises(UsageError) as err:
            call()
        assert message in str(err.value)


@pytest.mark.parametrize("tp_degree", [1, 2])
@pytest.mark.parametrize("label,prompts,message", BAD_IDS[:5], ids=[c[0] for c in BAD_IDS[:5]])
def test_bad_token_ids_tensor_parallel(ckpt, no_spawn, tp_degree, label, prompts, message):
    """The same error at TP = 1 and TP = 2, raised before any process starts."""
    with pytest.raises(UsageError) as err:
        run_tensor_parallel(ckpt, tp_degree, prompts, 2)
    assert message in str(err.value)


BAD_SIZES = [
    ("max_new_tokens=0", dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens=-1", dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1, got -1"),
    ("max_new_tokens=2.0", dict(max_new_tokens=2.0), "max_new_tokens must be an integer >= 1, got 2.0 (float)"),
    ("max_new_tokens too many", dict(max_new_tokens=40), "exceeds max_length 32 (room for 29 new tokens); lower max_new_tokens"),
    ("eos float", dict(eos_token_id=[1.5]), "eos_token_id[0] = 1.5 (float) is not an integer"),
    ("streamer not callable", dict(streamer=3), "streamer must be a callable"),
]


@pytest.mark.parametrize("label,kwargs,message", BAD_SIZES, ids=[c[0] for c in BAD_SIZES])
def test_bad_generate_arguments(model, label, kwargs, message):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(UsageError) as err:
        model.generate([[1, 2, 3]], **kwargs)
    assert message in str(err.value)


def test_bad_slots_and_positions(model):
    cases = [
        (lambda: model.prefill([[1], [2]], [0, 0]), "slots must be distinct and in [0, 2)"),
        (lambda: model.prefill([[1]], [2]), "slots must be distinct and in [0, 2)"),
        (lambda: model.prefill([[1]], [-1]), "slots must be distinct and in [0, 2)"),
        (lambda: model.prefill([[1]], [0.0]), "slots must be distinct and in [0, 2)"),
        (lambda: model.prefill([[1], [2]], [0]), "prefill needs one slot per prompt: got 2 prompts and 1 slots"),
        (lambda: model.prefill([[1] * 33], [0]), "prompt of 33 tokens is longer than the model's max_length (32)"),
        (lambda: model.decode([1], [32], [0]), "positions[0] = 32 is past max_length 32"),
        (lambda: model.decode([1], [-1], [0]), "positions[0] = -1 is negative"),
        (lambda: model.decode([512], [3], [0]), "tokens[0] = 512 is outside this model's vocabulary"),
        (lambda: model.decode([1, 2], [3], [0]), "decode needs one token and one position per slot"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError) as err:
            call()
        assert message in str(err.value)


BAD_CONSTRUCTION = [
    ("batch_size=0", dict(batch_size=0), UsageError, "batch_size must be an integer >= 1, got 0"),
    ("batch_size='2'", dict(batch_size="2"), UsageError, "batch_size must be an integer >= 1, got '2' (str)"),
    ("max_length=0", dict(max_length=0), UsageError, "max_length must be an integer >= 1, got 0"),
    ("bucket > max_length", dict(max_length=16, buckets=[8, 32]), UsageError, "bucket 32 is longer than max_length 16"),
    ("bucket 0", dict(buckets=[0, 8]), UsageError, "each bucket must be an integer >= 1, got 0"),
    ("dtype int32", dict(dtype=torch.int32), UsageError, "dtype torch.int32 is not a floating-point dtype"),
    ("dtype 'int8'", dict(dtype="int8"), UsageError, "dtype 'int8' is not a dtype this model runs in"),
    ("dtype None", dict(dtype=None), UsageError, "dtype must be a torch dtype or its name"),
]


@pytest.mark.parametrize("label,kwargs,error,message", BAD_CONSTRUCTION, ids=[c[0] for c in BAD_CONSTRUCTION])
def test_bad_model_arguments(ckpt, label, kwargs, error, message):
    with pytest.raises(error) as err:
        Qwen35Runtime.from_pretrained(ckpt, **kwargs)
    assert message in str(err.value)


def test_constructor_needs_a_decoder(ckpt):
    with pytest.raises(UsageError, match=r"takes a loaded decoder, got PosixPath; to load a folder use .*from_pretrained"):
        Qwen35Runtime.from_decoder(ckpt)


def test_dtype_by_name(ckpt):
    """`dtype="bfloat16"` (and "bf16", "torch.bfloat16") means torch.bfloat16, not a device string."""
    for name in ("bfloat16", "bf16", "torch.bfloat16", "BF16"):
        decoder = load_decoder(ckpt, name)
        assert decoder.embed_tokens.weight.dtype == torch.bfloat16
    model = Qwen35Runtime.from_pretrained(ckpt, dtype="float32", max_length=16)
    assert model.generate([[1, 2, 3]], 2) == Qwen35Runtime.from_pretrained(ckpt, max_length=16).generate([[1, 2, 3]], 2)


# ------------------------------------------------------------------------------------------ tensor parallel
def test_tensor_parallel_arguments_checked_before_any_process(ckpt, export2, no_spawn):
    cases = [
        (lambda: run_tensor_parallel(export2, 4, [[1, 2]], 2), IncompatibleExportError,
         "holds shards for tensor_parallel_size=2, not 4; pass tp_degree=2"),
        (lambda: run_tensor_parallel(export2, 1, [[1, 2]], 2), IncompatibleExportError,
         "holds shards for tensor_parallel_size=2, not 1"),
        (lambda: run_tensor_parallel(ckpt, 3, [[1, 2]], 2), UsageError, "Valid degrees: [1, 2, 4]"),
        (lambda: run_tensor_parallel(ckpt, 0, [[1, 2]], 2), UsageError, "tensor_parallel_size must be an integer >= 1"),
        (lambda: run_tensor_parallel(ckpt, 2, [[1, 2]], 0), UsageError, "max_new_tokens must be an integer >= 1"),
        (lambda: run_tensor_parallel(ckpt, 2, [[1, 2]], decode_steps=32), UsageError,
         "decode_steps was renamed max_new_tokens"),
        (lambda: run_tensor_parallel(ckpt, 2, [[1, 2]], 2, dtype="int8"), UsageError, "dtype 'int8'"),
        (lambda: run_tensor_parallel(ckpt, 2, [[1, 2]], 4, max_length=3), UsageError, "max_length 3 is too short"),
        (lambda: run_tensor_parallel(ckpt, 2, [], 2), UsageError, "prompts is empty"),
        (lambda: run_tensor_parallel("Qwen/Qwen3.5-2B", 2, [[1]], 2), ModelNotFoundError, "If it is a Hugging Face Hub id, "),
    ]
    for call, error, message in cases:
        with pytest.raises(error) as err:
            call()
        assert message in str(err.value)


@pytest.mark.parametrize("tp_degree", [1, 2])
def test_nan_weights_refused_with_the_tensor_name(ckpt, tmp_path, tp_degree):
    """NaN in a weight used to give token 0 repeated ('!!!!!!!!'); now the load names the tensor, at TP = 1 and 2
    (at TP = 2 the error is raised in rank 0's process and re-raised, with its type, in the caller)."""
    path = nan_checkpoint(ckpt, tmp_path / "nan")
    with pytest.raises(CheckpointError) as err:
        run_tensor_parallel(path, tp_degree, [[1, 2, 3]], 2)
    message = str(err.value)
    assert "layers.0.mlp.up_proj.weight (3 NaN, 0 Inf of" in message
    assert "download or export it again" in message
    if tp_degree == 2:
        assert "(rank 0 of 2)" in message


def test_inf_in_the_embedding_and_every_load_path(ckpt, tmp_path):
    path = nan_checkpoint(ckpt, tmp_path / "inf", PREFIX + "embed_tokens.weight", float("inf"))
    for call in (
        lambda: Qwen35Runtime.from_pretrained(path),
        lambda: load_decoder(path, "bf16"),
        lambda: save_sharded(path, None, 2, tmp_path / "never-written", progress=False),
    ):
        with pytest.raises(CheckpointError, match=r"embed_tokens.weight \(0 NaN, 3 Inf of"):
            call()
    assert not (tmp_path / "never-written").exists()
    # An export damaged after it was written: NaN in rank 1's file is named at load.
    out = save_sharded(ckpt, None, 2, tmp_path / "export", progress=False)
    tensors = load_file(out / rank_file(1))
    tensors["norm.weight"][0] = float("nan")
    save_file(tensors, out / rank_file(1), metadata={"format": "pt", "tp_degree": "2", "rank": "1"})
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][1]["bytes"] = (out / rank_file(1)).stat().st_size
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank_1.safetensors: weights hold NaN or Inf values: norm.weight \(1 NaN"):
        load_sharded(out, 1, 2)


# ------------------------------------------------------------------------------------------ folders
def folder_cases(ckpt, tmp):
    only_config = tmp / "only-config"
    only_config.mkdir()
    shutil.copy(ckpt / "config.json", only_config / "config.json")
    bin_only = tmp / "bin-only"
    shutil.copytree(only_config, bin_only)
    torch.save({}, bin_only / "pytorch_model.bin")
    half_export = tmp / "half-export"  # what an interrupted shard of an older version left
    shutil.copytree(only_config, half_export)
    (half_export / rank_file(0)).write_bytes(b"")
    a_file = tmp / "file.txt"
    a_file.write_text("x")
    bad_json = tmp / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (bad_json / "model.safetensors").write_bytes(b"")
    return [
        ("missing folder", tmp / "nope", ModelNotFoundError, "no such folder"),
        ("hub id", "Qwen/Qwen3.5-2B", ModelNotFoundError, "If it is a Hugging Face Hub id, "),
        ("a file", a_file, ModelNotFoundError, "is a file, not a folder"),
        ("no config.json", tmp, ModelNotFoundError, "has no config.json"),
        ("only config.json", only_config, CheckpointError, "has a config.json but no weights"),
        (".bin weights", bin_only, CheckpointError, "holds PyTorch .bin weights"),
        ("incomplete export", half_export, CheckpointError, "not a complete sharded export"),
        ("config not JSON", bad_json, Qwen35Error, "is not valid JSON"),
    ]


def test_bad_model_folders(ckpt, tmp_path):
    for label, path, error, message in folder_cases(ckpt, tmp_path):
        for call in (lambda: Qwen35Runtime.from_pretrained(path), lambda: load_decoder(path)):
            with pytest.raises(error) as err:
                call()
            assert message in str(err.value), label


def test_shard_refuses_to_destroy_data(ckpt, tmp_path):
    # Into the model's own folder (was shutil.SameFileError), or a folder that holds it.
    for out in (ckpt, ckpt.parent):
        with pytest.raises(UsageError, match="is the source folder|contains the source folder"):
            save_sharded(ckpt, None, 2, out, progress=False)
    # Into an existing export: refused unless overwrite, then replaced whole (was: stale rank_2/rank_3).
    out = save_sharded(ckpt, None, 4, tmp_path / "out", progress=False)
    with pytest.raises(UsageError, match="already holds a model or an export: .* pass --overwrite"):
        save_sharded(ckpt, None, 2, out, progress=False)
    assert json.loads((out / MANIFEST).read_text())["tp_degree"] == 4
    save_sharded(ckpt, None, 2, out, progress=False, overwrite=True)
    assert sorted(p.name for p in out.glob("rank_*")) == [rank_file(0), rank_file(1)]
    # A folder of other files is never replaced, even with overwrite.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(UsageError, match="does not hold a model or an export"):
        save_sharded(ckpt, None, 2, other, progress=False, overwrite=True)
    assert (other / "todo.txt").read_text() == "keep me"
    # Sharding an export again (was: 108 "missing" tensors).
    with pytest.raises(UsageError, match="is a sharded export .* not a checkpoint: shard the original"):
        save_sharded(out, None, 2, tmp_path / "again", progress=False)
    with pytest.raises(UsageError, match="dtype 'int8'"):
        save_sharded(ckpt, None, 2, tmp_path / "x", dtype="int8", progress=False)
    assert not (tmp_path / "again").exists() and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ command line
def run_cli(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as e:  # argparse usage errors
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line(err, message):
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert message in err, err


def test_cli_usage_errors_exit_2(ckpt, tmp_path, capsys):
    gen = ["generate", "--model", str(ckpt), "--prompt", "hi", "--dtype", "float32"]
    export = tmp_path / "export"
    save_sharded(ckpt, None, 2, export, progress=False)
    optimum_export = tmp_path / "optimum-export"
    optimum_export.mkdir()
    (optimum_export / "config.json").write_text((ckpt / "config.json").read_text())
    (optimum_export / "neuron_config.json").write_text("{}")
    cases = [
        (gen + ["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
        (gen + ["--max-new-tokens", "-3"], "argument --max-new-tokens: must be an integer >= 1, got -3"),
        (gen + ["--max-new-tokens", "many"], "argument --max-new-tokens: 'many' is not an integer"),
        (["shard", "--model", str(ckpt), "--tensor-parallel-size", "3", str(tmp_path / "o")], "Valid degrees: [1, 2, 4]"),
        (["shard", "--model", str(ckpt), "--tensor-parallel-size", "0", str(tmp_path / "o")], "must be an integer >= 1"),
        # Spelled as `export` (and optimum-cli) spell it: the same check, not "the following arguments are required".
        (["shard", "--model", str(ckpt), "--tensor_parallel_size", "3", str(tmp_path / "o")], "Valid degrees: [1, 2, 4]"),
        (gen + ["--max_new_tokens", "0"], "must be an integer >= 1, got 0"),
        (["shard", "--model", str(ckpt), "--tensor-parallel-size", "2", str(ckpt)], "is the source folder"),
        (["shard", "--model", str(ckpt), "--tensor-parallel-size", "4", str(export)], "pass --overwrite"),
        (["shard", "--model", str(export), "--tensor-parallel-size", "2", str(tmp_path / "o")], "is a sharded export"),
        (["generate", "--model", str(ckpt)], "the following arguments are required: --prompt"),
        # The rank shards of TP 2 (an export's checkpoint/): generate has no TP flag to suggest.
        (["generate", "--model", str(export), "--prompt", "hi"], "holds rank shards for tensor_parallel_size=2; generate runs one process"),
        # An optimum-neuron export folder: its weights are in checkpoint/, and generate is not the way to run it.
        (["generate", "--model", str(optimum_export), "--prompt", "hi"], "is an export folder (neuron_config.json): generate runs a checkpoint"),
        (["build-tiny", str(ckpt)], "already holds a model or an export"),
        (["demo", "--out", str(export)], "already holds a model or an export"),
    ]
    for argv, message in cases:
        status, out, err = run_cli(argv, capsys)
        assert status == 2, (argv, err)
        assert_one_line(err, message)
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in export.glob("rank_*")) == [rank_file(0), rank_file(1)]


def test_every_long_flag_of_every_command_is_spelled_both_ways(capsys):
    """`--tensor_parallel_size` (optimum-cli's spelling) and `--tensor-parallel-size` everywhere, or a user who copies
    a flag from one command to another is told it is missing."""
    commands = [["demo"], ["export"], ["generate"], ["shard"], ["build-tiny"], ["push"], ["pull"], ["cache", "sync"],
                ["cache", "lookup"]]
    for command in commands:
        status, out, _ = run_cli([*command, "--help"], capsys)
        assert status == 0
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", out)) - {"--help"}
        for flag in flags:
            if "_" in flag or "-" in flag[2:]:
                other = "--" + (flag[2:].replace("_", "-") if "_" in flag else flag[2:].replace("-", "_"))
                assert other in flags, f"{' '.join(command)}: {flag} but not {other}"


def test_cli_failures_exit_1(ckpt, export2, tmp_path, capsys):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(ckpt, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    cases = [(path, message) for _, path, _, message in folder_cases(ckpt, tmp_path)]
    cases.append((no_tokenizer, "has no tokenizer files"))
    cases.append((nan_checkpoint(ckpt, tmp_path / "nan"), "layers.0.mlp.up_proj.weight (3 NaN"))
    for path, message in cases:
        start = time.perf_counter()
        status, out, err = run_cli(["generate", "--model", str(path), "--prompt", "hi", "--dtype", "float32"], capsys)
        assert status == 1, (path, err)
        assert_one_line(err, message)
        assert time.perf_counter() - start < 20, f"{path}: took {time.perf_counter() - start:.0f} s (a network wait?)"


def test_cli_debug_shows_the_traceback(tmp_path, capsys):
    with pytest.raises(ModelNotFoundError):
        main(["--debug", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])


def test_cli_as_a_process_prints_one_line(tmp_path):
    """The real `python -m optimum_qwen35`: a Hub-like id answers at once, without reaching the network."""
    for argv, status, message in (
        (["generate", "--model", "someone/missing-model", "--prompt", "hi"], 1, "If it is a Hugging Face Hub id, "),
        (["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "-3"], 2, "must be an integer >= 1"),
    ):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "optimum_qwen35", *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == status, proc.stderr
        assert_one_line(proc.stderr, message)
        assert proc.stdout == ""
        assert time.perf_counter() - start < 30


def test_a_step_that_would_leave_a_gap_in_the_cache_is_refused(ckpt):
    """prefill(starts=) and decode() past a slot's next position are refused before any graph runs; the next
    position itself is accepted, and a refused call leaves the slot as it was (the same logits follow)."""
    model = Qwen35Runtime.from_pretrained(ckpt, batch_size=2, max_length=32)
    model.prefill([[1, 2, 3]], [0])
    with pytest.raises(UsageError, match=r"^prefill at position 5 in slot 0 would leave a gap in the cache: the slot holds positions 0..2; the next position is 3$"):
        model.prefill([[4]], [0], starts=[5])
    with pytest.raises(UsageError, match=r"^decode at position 4 in slot 0 would leave a gap .* the next position is 3$"):
        model.decode([4], [4], [0])
    with pytest.raises(UsageError, match=r"in slot 1 would leave a gap in the cache: the slot holds no sequence \(prefill it first\)"):
        model.decode([4], [1], [1])
    continued = model.prefill([[4]], [0], starts=[3])
    fresh = Qwen35Runtime.from_pretrained(ckpt, batch_size=2, max_length=32)
    torch.testing.assert_close(continued, fresh.prefill([[1, 2, 3, 4]], [0]), rtol=0, atol=1e-5)
    torch.testing.assert_close(model.decode([5], [4], [0]), fresh.decode([5], [4], [0]), rtol=0, atol=1e-5)
