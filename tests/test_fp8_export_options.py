"""The FP8 export's options on each stack (issue 49, docs/fp8.md "Exports"): `weights_dtype` through the stack's
model class (optimum-neuron's subclass on the NxD stack, this package's own on TorchNeuron), `optimum-qwen35 export
--weights_dtype fp8`, `optimum-cli export neuron --weights_dtype fp8`, the dequantized export of an FP8 checkpoint
without the option, and the one-line refusals. Both the reference and the optimum sessions run them; the export's
numerics are tests/test_fp8_export.py."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import CHECKPOINT_DIR, COMPILED_DIR, GRAPHS_FILE, TP_SHARDS_FILE, rank_file
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

from .test_fp8_export import BF16, LENGTH, NEW, PROMPT, check_fp8_metadata, export, exported_tokens, model_class, rank_dtypes


def test_fp8_checkpoint_exported_without_the_option_is_dequantized(tmp_path):
    """Way (a): no float8 in the export, the tokens of the model dequantized at load."""
    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    folder = export(q, tmp_path / "out")
    assert "F8_E4M3" not in rank_dtypes(folder)
    assert "weights_dtype" not in json.loads((folder / CHECKPOINT_DIR / TP_SHARDS_FILE).read_text())
    assert "weights_dtype" not in json.loads((folder / COMPILED_DIR / GRAPHS_FILE).read_text())
    assert exported_tokens(folder) == Qwen35Runtime.from_pretrained(q, batch_size=1, max_length=LENGTH, dtype=BF16).generate([PROMPT], NEW)[0]


# An NxD target with FP8 weights is built (tests/neuron_xla/test_fp8_xla.py); without the Neuron SDK it is refused as
# any NxD export is: the stack or the SDK it needs, in one line.
NXD_NEEDS = ("NxD stack", "needs the Neuron backend, but the Neuron SDK")


@pytest.mark.parametrize("kwargs,needles", [
    ({"weights_dtype": "int8"}, ("weights_dtype 'int8' is not supported: 'fp8'",)),
    ({"weights_dtype": "fp8", "target": "trn1"}, NXD_NEEDS),
    ({"weights_dtype": "fp8", "target": "trn2", "neuron_backend": "nxd"}, NXD_NEEDS),
    ({"fp8_lm_head": True}, ("fp8_lm_head=True quantizes lm_head with the other FP8 weights: pass weights_dtype='fp8'",)),
    ({"weights_dtype": "fp8", "fp8_lm_head": "yes"}, ("fp8_lm_head must be True or False",)),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, kwargs, needles):
    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    cls = model_class()
    target = kwargs.pop("target", "cpu")
    nc = cls.get_neuron_config(q, target=target, batch_size=1, sequence_length=LENGTH, tensor_parallel_size=1, dtype="bfloat16")
    with pytest.raises((UsageError, IncompatibleExportError)) as error:
        cls.export(q, neuron_config=nc, **kwargs)
    assert any(n in str(error.value) for n in needles) and "\n" not in str(error.value), str(error.value)


def test_command_line_flag(tmp_path, capsys):
    """`optimum-qwen35 export --weights_dtype fp8 --fp8_lm_head` writes an FP8 export, lm_head too (quantized from the
    FP8 checkpoint's tied embedding, untied); an NxD target without the Neuron SDK is refused in one line before
    anything is written; an unknown value is refused by the parser."""
    from optimum_qwen35.cli import main

    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    common = ["export", "--model", str(q), "--sequence_length", str(LENGTH), "--torch_dtype", "bfloat16"]
    assert main([*common, "--target", "cpu", "--weights_dtype", "fp8", "--fp8_lm_head", str(tmp_path / "out")]) == 0
    check_fp8_metadata(tmp_path / "out", 1)
    with safe_open(tmp_path / "out" / CHECKPOINT_DIR / rank_file(0), "pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "F8_E4M3" and f.get_slice("embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert main([*common, "--target", "trn1", "--tensor_parallel_size", "1", "--weights_dtype", "fp8", str(tmp_path / "nxd")]) != 0
    err = capsys.readouterr().err
    assert any(n in err for n in NXD_NEEDS), err
    assert not (tmp_path / "nxd").exists()
    with pytest.raises(SystemExit):
        main([*common, "--target", "cpu", "--weights_dtype", "int4", str(tmp_path / "int4")])


def test_optimum_cli_passes_the_flag_on():
    """`optimum-cli export neuron --weights_dtype fp8` (where optimum-neuron's own command is not registered) hands the
    flag to `optimum-qwen35 export`."""
    from optimum_qwen35.cli.optimum_cli import translate

    export_args, instance_type, _ = translate(["-m", "q", "--instance_type", "cpu", "--weights_dtype", "fp8", "--fp8_lm_head", "out"])
    assert instance_type == "cpu" and export_args == ["--model", "q", "--weights_dtype", "fp8", "--fp8_lm_head", "out"]
