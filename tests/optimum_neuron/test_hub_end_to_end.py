"""Export (cpu target) -> push to the stand-in Hub -> from_pretrained(repo id) in a fresh process with an
empty Hugging Face cache -> transformers' greedy tokens; for an export of a Hub model and of a local folder.

The Hub is the loopback stand-in (tests.kit.hub_server) driven only through HF_ENDPOINT and a
token: the product code does not know it is not huggingface.co.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from ..conftest import FIXTURES, load_reference  # noqa: E402
from .conftest import last_json_line, run_python  # noqa: E402

WRITE = "hf_alice_write"
SOURCE = "Qwen/Qwen3.5-tiny"
NEW_TOKENS = 16

EXPORT_FROM_HUB_AND_PUSH = """
import sys
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
source, repo = sys.argv[1], sys.argv[2]
neuron_config = Model.get_neuron_config(source, batch_size=1, sequence_length=128, tensor_parallel_size=1, dtype="float32", target="cpu")
model = Model.export(source, neuron_config)
print(model.neuron_config.checkpoint_id, model.neuron_config.checkpoint_revision)
model.push_to_hub(repo)
"""

LOAD_BY_ID = """
import json, sys, torch
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
repo, revision, prompt = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
model = Model.from_pretrained(repo, revision=revision)
out = model.generate(torch.tensor([prompt]), max_new_tokens=%d, do_sample=False, eos_token_id=None)
print(json.dumps({"tokens": out[0, len(prompt):].tolist(), "checkpoint_id": model.neuron_config.checkpoint_id}))
""" % NEW_TOKENS


@pytest.fixture()
def source_on_hub(hub_server):
    """The tiny-2b fixture checkpoint as a Hub model repo."""
    files = {p.name: p.read_bytes() for p in (FIXTURES / "tiny-2b").iterdir() if p.name != "reference.npz"}
    hub_server.create_repo(SOURCE)
    hub_server.upload(SOURCE, files)
    return SOURCE


def test_hub_model_export_push_and_load_by_id(hub_server, source_on_hub, tmp_path):
    ref = load_reference("tiny-2b")
    prompt = json.dumps(ref["gen_prompt_0"].tolist())
    exporter = hub_server.client_env(tmp_path / "exporter-home", token=WRITE)
    printed = run_python(EXPORT_FROM_HUB_AND_PUSH, SOURCE, "alice/qwen35-tiny-cpu", env=exporter).stdout.split()
    assert printed[0] == SOURCE and len(printed[1]) == 40  # the source's exact commit is recorded
    user = hub_server.client_env(tmp_path / "user-home")  # fresh, empty cache; no token (public repo)
    result = last_json_line(run_python(LOAD_BY_ID, "alice/qwen35-tiny-cpu", "", prompt, env=user).stdout)
    assert result == {"tokens": ref["gen_tokens_0"].tolist()[:NEW_TOKENS], "checkpoint_id": SOURCE}

    # Offline after that one download: it loads from the cache without the network.
    offline = hub_server.client_env(tmp_path / "user-home", HF_HUB_OFFLINE="1")
    requests = len(hub_server.requests)
    result = last_json_line(run_python(LOAD_BY_ID, "alice/qwen35-tiny-cpu", "", prompt, env=offline).stdout)
    assert result["tokens"] == ref["gen_tokens_0"].tolist()[:NEW_TOKENS]
    assert len(hub_server.requests) == requests, "offline mode reached the Hub"
    # Offline with an empty cache: one error that names what is missing.
    empty = hub_server.client_env(tmp_path / "empty-home", HF_HUB_OFFLINE="1")
    with pytest.raises(AssertionError, match="HubOfflineError: cannot load alice/qwen35-tiny-cpu offline"):
        run_python(LOAD_BY_ID, "alice/qwen35-tiny-cpu", "", prompt, env=empty)


def test_local_export_pushed_to_a_branch_loads_by_id_and_revision(hub_server, export_dir, tmp_path):
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    ref = load_reference("tiny-nv2x")
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-nv2x", 2))
    assert model.neuron_config.checkpoint_id is None  # exported from a local folder: the repo must carry weights
    model.push_to_hub("alice/qwen35-local", revision="tp2", token=WRITE, endpoint=hub_server.url)
    model.close()
    user = hub_server.client_env(tmp_path / "home")
    prompt = json.dumps(ref["gen_prompt_1"].tolist())
    result = last_json_line(run_python(LOAD_BY_ID, "alice/qwen35-local", "tp2", prompt, env=user).stdout)
    assert result == {"tokens": ref["gen_tokens_1"].tolist()[:NEW_TOKENS], "checkpoint_id": None}
    with pytest.raises(AssertionError, match="revision 'nope' does not exist"):
        run_python(LOAD_BY_ID, "alice/qwen35-local", "nope", prompt, env=user)


EXPORT_AND_SYNC = """
import sys
from optimum_qwen35 import hub
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
neuron_config = Model.get_neuron_config(sys.argv[1], batch_size=1, sequence_length=128, tensor_parallel_size=1, dtype="float32", target="cpu")
model = Model.export(sys.argv[1], neuron_config)
print(hub.sync_registry(model.folder).paths)
"""

LOAD_MODEL_ID_WITHOUT_COMPILING = """
import json, sys, torch
import optimum_qwen35.export.cpu as cpu_export
def no_compiling(*args, **kwargs):
    raise SystemExit("compile_graphs was called: the cached graphs were not used")
cpu_export.compile_graphs = no_compiling
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
model = Model.from_pretrained(sys.argv[1], batch_size=int(sys.argv[2]), sequence_length=128, dtype="float32")
prompt = json.loads(sys.argv[3])
out = model.generate(torch.tensor([prompt]), max_new_tokens=%d, do_sample=False, eos_token_id=None)
print(json.dumps(out[0, len(prompt):].tolist()))
""" % NEW_TOKENS


def test_a_synced_configuration_loads_by_model_id_without_compiling(hub_server, source_on_hub, tmp_path):
    """`cache sync` files the entry and the cpu graphs; from_pretrained(<model id>, matching options) in a fresh
    process then downloads them instead of compiling, and `optimum-cli neuron cache lookup` lists the entry."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    hub_server.create_repo("alice/neuron-cache")
    exporter = hub_server.client_env(tmp_path / "exporter-home", token=WRITE, CUSTOM_CACHE_REPO="alice/neuron-cache")
    paths = run_python(EXPORT_AND_SYNC, SOURCE, env=exporter).stdout
    assert "0_REGISTRY" in paths

    ref = load_reference("tiny-2b")
    prompt = json.dumps(ref["gen_prompt_0"].tolist())
    user = hub_server.client_env(tmp_path / "user-home", CUSTOM_CACHE_REPO="alice/neuron-cache")
    tokens = last_json_line(run_python(LOAD_MODEL_ID_WITHOUT_COMPILING, SOURCE, "1", prompt, env=user).stdout)
    assert tokens == ref["gen_tokens_0"].tolist()[:NEW_TOKENS]
    # Another batch size is not cached: one line saying what to do (never a silent compile).
    with pytest.raises(AssertionError, match="the compile cache has no configuration of it matching"):
        run_python(LOAD_MODEL_ID_WITHOUT_COMPILING, SOURCE, "4", prompt, env=user)

    cli = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))
    shim = tmp_path / "shim"  # register in the child explicitly, whatever start-up file the environment has
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import optimum_qwen35\n")
    listed = subprocess.run(
        [cli, "neuron", "cache", "lookup", SOURCE, "--task", "text-generation"],
        env={**user, "PYTHONPATH": str(shim)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = [line.split() for line in listed.stdout.splitlines() if line.split()[-1:] == ["cpu"]]
    assert rows == [["1", "128", "1", "float32", "cpu"]], listed.stdout
