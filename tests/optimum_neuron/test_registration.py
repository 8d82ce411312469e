"""Registration in every process that needs it: optimum-neuron's registry, transformers 4.57, vLLM's plugin,
and the start-up file an installed wheel puts in site-packages (the tests build the wheel and process its .pth the
way site.py does; test_editable_install.py checks the editable install's)."""

from __future__ import annotations

import json
import subprocess
import sysconfig
import sys
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from .conftest import last_json_line, run_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def startup_dir(tmp_path_factory):
    """A folder holding only the `optimum_qwen35.pth` of the wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp.glob("optimum_qwen35-*.whl")
    site = tmp / "site"
    site.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        assert "optimum_qwen35.pth" in archive.namelist(), "the wheel does not carry its start-up file"
        (site / "optimum_qwen35.pth").write_bytes(archive.read("optimum_qwen35.pth"))
        register = "optimum/commands/register/register_optimum_qwen35.py"
        assert register in archive.namelist(), "the wheel does not carry its optimum-cli command"
        (site / register).parent.mkdir(parents=True)
        (site / register).write_bytes(archive.read(register))
    return site


FIND_CLASSES = """
import json, site, sys
site.addsitedir(sys.argv[1])   # what the interpreter does with site-packages at start-up
import optimum.neuron
from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS
from transformers import AutoConfig
found = {t: _REGISTERED_NEURON_MODELS.get((t, "text-generation", "inference")) for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")}
print(json.dumps({t: None if c is None else f"{c.__module__}.{c.__qualname__}" for t, c in found.items()}
                 | {"config": [type(AutoConfig.for_model(t)).__name__ for t in ("qwen3_5_text", "qwen3_5_moe_text")]}))
"""


def test_import_optimum_neuron_finds_the_class_in_a_fresh_process(startup_dir):
    found = last_json_line(run_python(FIND_CLASSES, str(startup_dir)).stdout)
    expected = "optimum_qwen35.optimum_neuron.modeling.Qwen35NeuronModelForCausalLM"
    assert found == {"qwen3_5": expected, "qwen3_5_text": expected, "qwen3_5_moe": expected, "qwen3_5_moe_text": expected,
                     "config": ["Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"]}


def test_hf_configs_imported_first_registers_without_a_warning(startup_dir):
    """`import optimum_qwen35.config.transformers_configs` as a program's first import: that module imports transformers, whose import
    hook finds it half built; the registration must still happen, and no warning be printed."""
    code = (
        "import site, sys, warnings; site.addsitedir(sys.argv[1]); warnings.simplefilter('error')\n"
        "import optimum_qwen35.config.transformers_configs\n"
        "from transformers import AutoConfig\n"
        "print([type(AutoConfig.for_model(t)).__name__ for t in ('qwen3_5', 'qwen3_5_moe')])\n"
    )
    result = run_python(code, str(startup_dir))
    assert result.stdout.strip().splitlines()[-1] == "['Qwen3_5Config', 'Qwen3_5MoeConfig']"
    assert "could not register" not in result.stderr, result.stderr[-2000:]


def test_without_the_startup_file_nothing_is_registered():
    """The check above would pass for nothing if plain `import optimum.neuron` registered by itself.

    site-packages goes on the path without its .pth files being run (`python -S`): the nox sessions place the start-up
    file there, as a regular install does."""
    code = FIND_CLASSES.replace(
        "site.addsitedir(sys.argv[1])", "sys.path.append(sys.argv[1])"
    ).replace(' | {"config": [type(AutoConfig.for_model(t)).__name__ for t in ("qwen3_5_text", "qwen3_5_moe_text")]}', "")
    site_packages = sysconfig.get_paths()["purelib"]
    result = subprocess.run([sys.executable, "-S", "-c", code, site_packages], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "optimum_qwen35" not in result.stderr
    assert last_json_line(result.stdout) == {"qwen3_5": None, "qwen3_5_text": None, "qwen3_5_moe": None, "qwen3_5_moe_text": None}


def test_startup_file_imports_no_torch_or_transformers(startup_dir):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import site; site.addsitedir({str(startup_dir)!r})"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "optimum_qwen35" in imported and "optimum_qwen35._startup" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "numpy", "optimum", "safetensors"))
    assert not heavy, f"the start-up file imported {heavy}"


def test_export_subprocess_registration_reaches_a_child_interpreter(startup_dir):
    """optimum-cli runs `python3 -m optimum.exporters.neuron` in a child: registration must happen there too.
    (Without the Neuron SDK that module cannot run; its first step, resolving the class, is what is checked.)"""
    code = """
import json, site, sys
site.addsitedir(sys.argv[1])
from transformers import AutoConfig
from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS
import optimum.neuron  # noqa: F401  (what optimum.exporters.neuron imports first)
config = AutoConfig.from_pretrained(sys.argv[2]).get_text_config()
cls = _REGISTERED_NEURON_MODELS[(config.model_type, "text-generation", "inference")]
print(json.dumps([config.model_type, cls.__name__, str(config.dtype)]))
"""
    fixture = ROOT / "tests" / "fixtures" / "tiny-2b"
    assert last_json_line(run_python(code, str(startup_dir), str(fixture)).stdout) == [
        "qwen3_5_text", "Qwen35NeuronModelForCausalLM", "torch.float32",
    ]


def test_vllm_plugin_is_declared_and_runs_without_vllm():
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "optimum_qwen35"]
    assert plugin.value == "optimum_qwen35.serving.vllm_plugin:vllm_plugin"
    code = """
import json
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "optimum_qwen35"]
done = ep.load()()
from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS
print(json.dumps({"done": done, "registered": ("qwen3_5", "text-generation", "inference") in _REGISTERED_NEURON_MODELS}))
"""
    result = last_json_line(run_python(code).stdout)
    assert result["registered"]
    assert "optimum-neuron model class" in result["done"] and "vLLM architectures" not in result["done"]


def test_text_config_without_dtype_gets_one(tmp_path):
    """optimum-neuron 0.4.5's get_neuron_config reads the text config's dtype, and fails without one."""
    import json

    from transformers import AutoConfig

    from tests.kit import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "ckpt", "tiny-2b")
    raw = json.loads((folder / "config.json").read_text())
    del raw["text_config"]["dtype"]
    (folder / "config.json").write_text(json.dumps(raw))
    assert str(AutoConfig.from_pretrained(folder).get_text_config().dtype) == "torch.bfloat16"


# ------------------------------------------------------------------ optimum-neuron's own entry point (issue 21, item 1)
# `NeuronModelForCausalLM.from_pretrained` (the abstract class the user names) in a fresh process without the Neuron
# SDK, after each of the three ways Qwen3.5 gets registered. It prints the class it returned and its greedy tokens.
ABSTRACT_LOAD = """
import importlib.util, json, sys, torch
{register}
from optimum.neuron import NeuronModelForCausalLM
assert importlib.util.find_spec("neuronx_distributed") is None  # no Neuron SDK: the built-in NxD models cannot import
model = NeuronModelForCausalLM.from_pretrained(sys.argv[2], **json.loads(sys.argv[4]))
prompt = json.loads(sys.argv[3])
out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
print(json.dumps([type(model).__name__, out[0, len(prompt):].tolist()]))
"""
REGISTRATIONS = {
    "regular install (.pth)": "import site; site.addsitedir(sys.argv[1])",
    "editable install (import optimum_qwen35)": "import optimum_qwen35",
    "vLLM plugin": (
        "from importlib.metadata import entry_points\n"
        "[e.load()() for e in entry_points(group='vllm.general_plugins') if e.name == 'optimum_qwen35']"
    ),
}


@pytest.mark.parametrize("registration", sorted(REGISTRATIONS))
def test_abstract_neuron_model_class_loads_the_export_without_the_sdk(registration, startup_dir, export_dir):
    from ..conftest import load_reference

    ref = load_reference("tiny-2b")
    code = ABSTRACT_LOAD.format(register=REGISTRATIONS[registration])
    prompt = ref["gen_prompt_0"].tolist()
    args = (str(startup_dir), str(export_dir("tiny-2b", 1)), json.dumps(prompt), "{}")
    name, tokens = last_json_line(run_python(code, *args).stdout)
    assert name == "Qwen35NeuronModelForCausalLM"
    assert tokens == ref["gen_tokens_0"].tolist()[:8]


def test_abstract_neuron_model_class_loads_a_hub_export_and_checks_expectations(startup_dir, export_dir, hub_server, tmp_path):
    """A Hub id (the loopback stand-in Hub, through HF_ENDPOINT) and the keyword checks of from_pretrained."""
    from optimum_qwen35.hub import push_to_hub

    from ..conftest import load_reference

    ref = load_reference("tiny-2b")
    push_to_hub(export_dir("tiny-2b", 1), "alice/tiny-export", token="hf_alice_write", endpoint=hub_server.url)
    code = ABSTRACT_LOAD.format(register=REGISTRATIONS["regular install (.pth)"])
    prompt = ref["gen_prompt_0"].tolist()
    env = hub_server.client_env(tmp_path / "home")
    args = [str(startup_dir), "alice/tiny-export", json.dumps(prompt), json.dumps({"batch_size": 2})]
    name, tokens = last_json_line(run_python(code, *args, env=env).stdout)
    assert (name, tokens) == ("Qwen35NeuronModelForCausalLM", ref["gen_tokens_0"].tolist()[:8])
    args[-1] = json.dumps({"batch_size": 4})
    with pytest.raises(AssertionError, match="IncompatibleExportError: .* exported for batch_size=2, not 4"):
        run_python(code, *args, env=env)


def test_abstract_class_get_neuron_config_and_export_for_the_cpu_target(tmp_path):
    """optimum-neuron's documented flow, `NeuronModelForCausalLM.get_neuron_config` then `.export`, with
    instance_type="cpu" gives this package's cpu export; without the SDK and without instance_type, optimum-neuron's
    own default (trn1, 0 Neuron cores counted) is one line; "cpu" for another model stays optimum-neuron's refusal."""
    import torch
    from optimum.neuron import NeuronModelForCausalLM
    from transformers import LlamaConfig

    from optimum_qwen35.errors import UsageError
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM
    from optimum_qwen35.optimum_neuron.neuron_config import to_dict

    from ..conftest import FIXTURES, load_reference

    ref = load_reference("tiny-2b")
    source = str(FIXTURES / "tiny-2b")
    shape = dict(batch_size=1, sequence_length=128)
    neuron_config = NeuronModelForCausalLM.get_neuron_config(source, instance_type="cpu", **shape)
    direct = Qwen35NeuronModelForCausalLM.get_neuron_config(source, instance_type="cpu", **shape)
    assert to_dict(neuron_config) == to_dict(direct) and neuron_config.target == "cpu"
    model = NeuronModelForCausalLM.export(source, neuron_config, load_weights=True)
    assert type(model) is Qwen35NeuronModelForCausalLM
    prompt = ref["gen_prompt_0"].tolist()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out[0, len(prompt):].tolist() == ref["gen_tokens_0"].tolist()[:8]

    with pytest.raises(UsageError, match=r"no Neuron cores found .* instance_type='cpu'"):
        NeuronModelForCausalLM.get_neuron_config(source, **shape)
    LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cpu is not a valid instance type"):
        NeuronModelForCausalLM.get_neuron_config(str(tmp_path), instance_type="cpu", **shape)


def test_dispatch_leaves_other_model_types_to_optimum_neuron():
    """Only the Qwen3.5 model types (dense and MoE) skip optimum-neuron's import of its built-in models; any other model type
    still goes through optimum-neuron's own lookup (which, without the SDK, fails as it always did)."""
    code = """
import json, optimum_qwen35
from optimum.neuron.models import auto_model
import optimum.neuron  # the hook registers here
found = {t: auto_model.has_neuron_model_class(t, "text-generation", "inference") for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")}
try:
    auto_model.has_neuron_model_class("llama", "text-generation", "inference")
    llama = "answered"
except ModuleNotFoundError as error:
    llama = error.name
print(json.dumps([found, llama, auto_model.has_neuron_model_class.__wrapped__.__module__]))
"""
    found, llama, original = last_json_line(run_python(code).stdout)
    assert found == {"qwen3_5": True, "qwen3_5_text": True, "qwen3_5_moe": True, "qwen3_5_moe_text": True}
    assert llama == "neuronx_distributed" and original == "optimum.neuron.models.auto_model"


def test_optimum_cli_export_neuron_instance_type_cpu_exports_without_the_sdk(startup_dir, tmp_path):
    """optimum-cli registers `export neuron` only with the Neuron SDK; the installed register file makes it export for
    the cpu target with `--instance_type cpu` (optimum-neuron's flags, compiler options left out), and say in one line
    what to run for a Neuron instance type (tests/optimum_neuron/test_optimum_cli.py checks that line's command)."""
    import os
    import shlex

    optimum_cli = Path(sys.executable).with_name("optimum-cli")
    args = ["export", "neuron", "--model", str(ROOT / "tests" / "fixtures" / "tiny-2b"), "--batch_size", "1",
            "--sequence_length", "128", "--num_cores", "2", "--auto_cast_type", "bf16", "--instance_type", "trn1",
            str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(startup_dir)}  # site-packages as a regular install leaves it
    hooked = subprocess.run([optimum_cli, *args], capture_output=True, text=True, timeout=300, env=env)
    assert hooked.returncode == 2 and not (tmp_path / "out").exists()
    assert hooked.stderr.count("\n") == 1, hooked.stderr  # the one line, no optimum-neuron import noise before it
    last = hooked.stderr.strip().splitlines()[-1]
    assert last.startswith("optimum-cli export neuron: error: --instance_type trn1 needs the Neuron SDK")
    command = shlex.split(last.split("on this machine export Qwen3.5 for the cpu target: ")[1])
    assert command[:3] == ["optimum-cli", "export", "neuron"] and command[-2:] == ["--instance_type", "cpu"]
    exported = subprocess.run([optimum_cli, *command[1:]], capture_output=True, text=True, timeout=600, env=env)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "out" / "neuron_config.json").read_text())["tp_degree"] == 2
    assert f"to {tmp_path / 'out'}" in exported.stdout
    # Progress per graph (each named as it compiles).
    assert "compile (cpu: torch.export)" in exported.stderr and "3/3" in exported.stderr
    for name in ("context_encoding_128", "token_generation_128", "context_logits_128"):
        assert name in exported.stderr


PIPELINE_BY_PATH = """
import json, site, sys
site.addsitedir(sys.argv[1])   # the start-up file, as site-packages holds it
from transformers import pipeline
chat = pipeline("text-generation", model=sys.argv[2])
out = chat("The capital of France is", max_new_tokens=6, do_sample=False, return_full_text=False)
print(json.dumps([type(chat.model).__name__, out[0]["generated_text"]]))
"""


@pytest.mark.parametrize("first", ["", "import optimum.neuron"])
def test_transformers_pipeline_with_an_export_path_loads_the_export(startup_dir, export_dir, first):
    """transformers 4.57 has no Qwen3.5 model: `pipeline("text-generation", model="out/")` used to fail with
    "Unrecognized configuration class" and ~150 class names. The export's class answers it, with the tokens the
    loaded model gives."""
    from transformers import AutoTokenizer

    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    folder = export_dir("tiny-2b", 1)
    code = PIPELINE_BY_PATH.replace("from transformers import pipeline", f"{first}\nfrom transformers import pipeline")
    result = run_python(code, str(startup_dir), str(folder))
    name, text = last_json_line(result.stdout)
    assert "is not supported for text-generation" not in result.stderr
    assert name == "Qwen35NeuronModelForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
    tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
