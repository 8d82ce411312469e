"""Bad input that used to reach users raw or misleading, and the noise other libraries printed: each case is one line
of this package's own error types, and the commands print nothing else unless `--verbose`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import FIXTURES, load_reference  # noqa: E402


@pytest.fixture()
def export(export_dir, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(export_dir("tiny-2b", 1), folder)
    return folder


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimum_qwen35", *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", r"holds a JSON list, not an object of neuron config fields; export the model again"),
        ('"cpu"', r"holds a JSON str, not an object"),
    ],
)
def test_neuron_config_that_is_not_an_object(export, content, message):
    (export / "neuron_config.json").write_text(content)
    with pytest.raises(IncompatibleExportError, match=message):
        Qwen35NeuronModelForCausalLM.from_pretrained(export)
    # The Hub commands read it too: one line, exit status 1, nothing pushed anywhere.
    result = cli("pull", export)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "holds a JSON" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("target", "gpu", r"names target 'gpu', which is not one of cpu, trn1, trn2"),
        ("batch_size", "2", r"batch_size is '2' \(str\), not a positive integer"),
        ("tp_degree", 0, r"tp_degree is 0 \(int\), not a positive integer"),
        ("sequence_length", 12.5, r"sequence_length is 12.5 \(float\)"),
        ("torch_dtype", "int8", r"torch_dtype is 'int8', not one of float32, bfloat16"),
    ],
)
def test_neuron_config_fields_of_the_wrong_kind(export, field, value, message):
    path = export / "neuron_config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(IncompatibleExportError, match=message) as error:
        Qwen35NeuronModelForCausalLM.from_pretrained(export)
    assert "Neuron SDK" not in str(error.value) and "\n" not in str(error.value)


def test_decode_that_would_leave_a_gap_in_the_cache(export):
    """decode() at a position past a slot's next one is refused, and refused before anything runs: the slot then
    continues with transformers' greedy tokens."""
    ref = load_reference("tiny-2b")
    prompt, expected = ref["gen_prompt_0"].tolist(), ref["gen_tokens_0"].tolist()
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export)
    first = int(model.prefill(torch.tensor([prompt]), None, seq_ids=[0]).argmax())
    with pytest.raises(UsageError, match=rf"position {len(prompt) + 2} in slot 0 would leave a gap .* the next position is {len(prompt)}$"):
        model.decode(torch.tensor([[first]]), torch.tensor([[len(prompt) + 2]]), seq_ids=[0])
    with pytest.raises(UsageError, match=r"in slot 1 would leave a gap in the cache: the slot holds no sequence \(prefill it first\)"):
        model.decode(torch.tensor([[first]]), torch.tensor([[3]]), seq_ids=[1])
    token = int(model.decode(torch.tensor([[first]]), torch.tensor([[len(prompt)]]), seq_ids=[0]).argmax())
    assert [first, token] == expected[:2]


def test_export_checks_its_destination_before_compiling(tmp_path):
    """Each refused destination: exit status 2, one line, before the first graph is compiled (no progress bar), and
    nothing written."""
    from tests.kit import build_tiny_checkpoint

    source = build_tiny_checkpoint(tmp_path / "ckpt", "tiny-2b")
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    cases = [
        (source, ["--overwrite"], "is the source checkpoint"),
        (a_file, [], "is a file: choose a folder"),
        (tmp_path / "other-ckpt", ["--overwrite"], "holds a model checkpoint: it is never overwritten"),
    ]
    shutil.copytree(source, tmp_path / "other-ckpt")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    for out, extra, words in cases:
        result = cli("export", "--model", source, "--sequence_length", 128, "--target", "cpu", *extra, out)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
        assert "compile" not in result.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    assert a_file.read_text() == "keep me"


# ------------------------------------------------------------------------------------------------ quiet by default
NEURON_NOISE = ("No major for neuron device", "override the platform target to trn1")


def test_commands_print_no_optimum_neuron_noise_unless_verbose(tmp_path):
    """A command that imports optimum-neuron (export, refused here after the import for a TP degree the model does not
    allow) prints its one line; --verbose shows what optimum-neuron says about this machine."""
    args = ("export", "--model", FIXTURES / "tiny-2b", "--tensor_parallel_size", 3, "--target", "cpu", tmp_path / "out")
    quiet = cli(*args)
    assert quiet.returncode == 2 and quiet.stderr.count("\n") == 1, quiet.stderr
    assert quiet.stderr.startswith("optimum-qwen35: error:") and "tensor" in quiet.stderr
    assert not (tmp_path / "out").exists()
    verbose = cli("--verbose", *args)
    assert verbose.returncode == 2
    assert "override the platform target to trn1" in verbose.stderr, "--verbose must show what is hidden by default"
    if Path("/proc/devices").exists():
        assert "No major for neuron device" in verbose.stderr


def test_python_import_prints_nothing():
    code = "from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM; Qwen35NeuronModelForCausalLM"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_import_optimum_neuron_itself_prints_nothing_with_the_startup_file():
    """What optimum-neuron users write first: with the start-up file in site-packages (a regular install, and this
    session), its device probe and trn1-override warning are not printed; OPTIMUM_QWEN35_VERBOSE=1 shows them."""
    import os

    code = "from optimum.neuron import NeuronModelForCausalLM; NeuronModelForCausalLM"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    env = {**os.environ, "OPTIMUM_QWEN35_VERBOSE": "1"}
    verbose = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "override the platform target to trn1" in verbose.stderr


def test_greedy_calls_raise_no_generation_flag_warning(export, caplog):
    """The export's generation_config.json samples (temperature, top_k, top_p): a greedy call from this package (or
    a pipeline's do_sample=False) does not make transformers warn that those flags "are not valid"."""
    from transformers import AutoTokenizer, pipeline

    model = Qwen35NeuronModelForCausalLM.from_pretrained(export)
    assert model.generation_config.do_sample and model.generation_config.top_k not in (None, 50)
    ids = torch.tensor([[1, 2, 3]])
    greedy = model.generate(ids, max_new_tokens=4, do_sample=False)
    chat = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(export))
    chat("Hello", max_new_tokens=4, do_sample=False)
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=4, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    assert not [r for r in caplog.records if "are not valid" in r.getMessage()]
    # The reset is of the config's defaults only: greedy is argmax, whatever the saved sampling flags.
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=4, do_sample=True, top_k=1))


def test_a_neuron_target_without_a_tensor_parallel_size_says_there_are_no_cores_to_size_it_by(capsys):
    """optimum-neuron counts the machine's Neuron cores for a missing degree: none here. The message used to be
    "tensor_parallel_size must be a positive integer, got 0" (a number the user never gave)."""
    from optimum_qwen35.cli import main

    for target, compiled_for in (("trn1", "trn1"), ("trn2", "trn2"), ("inf2", "trn1")):  # inf2 compiles as trn1
        with pytest.raises(UsageError) as error:
            Qwen35NeuronModelForCausalLM.get_neuron_config(str(FIXTURES / "tiny-2b"), target=target)
        text = str(error.value)
        assert f"no Neuron cores (nor the Neuron SDK) to size a {compiled_for} export" in text and "got 0" not in text
        assert "[1, 2, 4] split this model" in text and "--target cpu" in text
    assert main(["export", "--model", str(FIXTURES / "tiny-2b"), "--target", "trn1", "never-written/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass tensor_parallel_size (--tensor_parallel_size" in err
    assert not Path("never-written").exists()


@pytest.mark.parametrize("name, error, says", [
    ("outt/", "ModelNotFoundError", "no such folder: 'outt/'"),
    ("my-org/no-such-export", "HubConnectionError", "cannot be reached; there is no local folder 'my-org/no-such-export' either"),
    ("tinyy", "HubConnectionError", "cannot be reached; there is no local folder 'tinyy' either"),
])
def test_the_abstract_class_answers_a_missing_model_in_one_line_without_waiting(monkeypatch, name, error, says):
    """optimum-neuron's `NeuronModelForCausalLM.from_pretrained` used to give transformers' OSError for a mistyped
    folder, and to wait 23 s through five retries for a Hub it cannot reach."""
    import time

    from huggingface_hub import constants
    from optimum.neuron import NeuronModelForCausalLM

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    start = time.perf_counter()
    with pytest.raises(Exception) as raised:
        NeuronModelForCausalLM.from_pretrained(name)
    assert time.perf_counter() - start < 3
    assert type(raised.value).__name__ == error and type(raised.value).__module__ == "optimum_qwen35.errors"
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_the_abstract_class_offline_says_so(monkeypatch, tmp_path):
    from huggingface_hub import constants
    from optimum.neuron import NeuronModelForCausalLM

    from optimum_qwen35.errors import HubOfflineError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(HubOfflineError, match=r"offline mode \(HF_HUB_OFFLINE=1\) and it is not in the local cache"):
        NeuronModelForCausalLM.from_pretrained("my-org/no-such-export")
