"""Qwen3.5 as an optimum-neuron model (the NxD stack): `Qwen35NeuronModelForCausalLM`, a `NeuronModelForCausalLM`.

The optimum-neuron flow, unchanged:

    from optimum_qwen35 import NeuronModelForCausalLM     # this class where optimum-neuron is installed

    neuron_config = NeuronModelForCausalLM.get_neuron_config(
        "path/or/hub-id", batch_size=4, sequence_length=4096, tensor_parallel_size=4, dtype="bfloat16", target="cpu"
    )
    model = NeuronModelForCausalLM.export("path/or/hub-id", neuron_config, load_weights=True)
    model.save_pretrained("out/")
    model = NeuronModelForCausalLM.from_pretrained("out/")      # in any process
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_k=50)

Everything but the NxD backend is the stack-neutral base, `neuron_model/base.py` (the TorchNeuron stack's class,
`neuron_model/modeling.py`, is the same base without optimum-neuron). This subclass adds optimum-neuron's side: its
`NeuronModelForCausalLM` (the `export` entry point, the registry, its vLLM runner), its `NxDNeuronConfig` as the
config object, its default target and core count, and the NxD backend: on a Neuron target the backend is chosen by
backends/selection.py (`neuron_backend=` overrides); NxD (trn1, inf2, and trn2 on SDK <= 2.33;
`optimum_qwen35/backends/nxd/`, needs the Neuron SDK) `export`s and loads as its `Qwen35NxDModelForCausalLM`, with
optimum-neuron's folder (model.pt, checkpoint/weights/).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from transformers import AutoConfig

from optimum_qwen35.patches import optimum_neuron_import

with optimum_neuron_import():  # no device-probe error or trn1-override warning on a machine without Neuron
    from optimum.neuron.models.inference.modeling_utils import NeuronModelForCausalLM
    from optimum.neuron.utils.instance import get_default_compilation_target
    from optimum.neuron.utils.system import get_available_cores

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.export.compile import MTP_MAX_SPECULATIVE_TOKENS
from optimum_qwen35.export.cpu import check_image_buckets, export_config
from optimum_qwen35.modeling.vision import VisionConfig
from optimum_qwen35.neuron_model.base import Qwen35ExportedModel
from optimum_qwen35.optimum_neuron import neuron_config as nc
from optimum_qwen35.optimum_neuron import registration
from optimum_qwen35.optimum_neuron.loading import local_or_download
from optimum_qwen35.runtime.images import DEFAULT_IMAGE_BUCKETS

logger = logging.getLogger(__name__)


def _neuron_sdk_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch_neuronx", "neuronx_distributed"))


def _neuron_backend_unavailable(target: str) -> IncompatibleExportError:
    return IncompatibleExportError(
        f"target {target!r} needs the Neuron backend, but the Neuron SDK (torch-neuronx, neuronx-distributed) is not "
        "installed here: on a Neuron instance install it (`pip install \"optimum-qwen35[neuronx]\"` from AWS's Neuron "
        "package index); on this machine use target='cpu' (`--target cpu`)"
    )


def _neuron_model_class(target: str, fp8_weights: bool = False):
    """The class that builds and runs the Neuron targets' graphs (`backends/nxd/model.py`; imports the Neuron SDK);
    an export with FP8 weights compiles with one more flag (`Qwen35NxDFp8ModelForCausalLM`)."""
    if not _neuron_sdk_available():
        raise _neuron_backend_unavailable(target)
    from optimum_qwen35.backends.nxd.model import (  # optional dependency: the Neuron SDK
        Qwen35NxDFp8ModelForCausalLM,
        Qwen35NxDModelForCausalLM,
    )

    return Qwen35NxDFp8ModelForCausalLM if fp8_weights else Qwen35NxDModelForCausalLM


class Qwen35NeuronModelForCausalLM(Qwen35ExportedModel, NeuronModelForCausalLM):
    """Qwen3.5 (dense or MoE, text and vision) for optimum-neuron, on a Neuron target or on this project's cpu target."""

    @classmethod
    def _default_target(cls) -> str:
        """cpu where the Neuron SDK is not installed, else optimum-neuron's default compilation target."""
        return "cpu" if not _neuron_sdk_available() else get_default_compilation_target()

    @classmethod
    def _available_neuron_cores(cls) -> int:
        return _available_neuron_cores()

    _make_neuron_config = staticmethod(nc.nxd_neuron_config)
    _read_neuron_config = staticmethod(nc.load)

    @classmethod
    def _nxd_model_class(cls, folder, neuron_config):
        config = json.loads((Path(folder) / "config.json").read_text())
        return _neuron_model_class(neuron_config.target, bool(config.get(layout.FP8_EXPORT_KEY)))

    @classmethod
    def _export_nxd(cls, model_id, config, neuron_config, token=None, revision=None, cache_dir=None,
                    force_download=False, local_files_only=False, trust_remote_code=False, load_weights=False,
                    vision=False, image_buckets=None, mtp=False, weights_dtype=None, fp8_lm_head=False):
        """optimum-neuron's NxD flow (trace, compile, load the weights split by this project's layout); a vision
        export's graphs and tower weights come with it, named in the config it saves, and so do the float8 weights of
        an export with FP8 weights (`weights_dtype="fp8"`, backends/nxd/fp8.py)."""
        model_class = _neuron_model_class(neuron_config.target, weights_dtype == "fp8")
        fp8_weights = None
        if weights_dtype == "fp8":
            from optimum_qwen35.backends.nxd.fp8 import export_fp8_weight_names  # start-up time: an FP8 export only

            source = local_or_download(model_id, revision, token, allow_patterns=layout.CHECKPOINT_PATTERNS)
            fp8_weights = export_fp8_weight_names(source, lm_head=fp8_lm_head)
        neuron_vision = None
        if vision:
            # `config` is the text part (optimum-neuron's export hands that on): the tower is in the whole one.
            tower = VisionConfig.from_dict(AutoConfig.from_pretrained(model_id, revision=revision, token=token).to_dict())
            if tower is None:
                raise UsageError(f"vision=True, but {model_id} has no vision tower (a text-only config): export it without vision")
            neuron_vision = (tower, check_image_buckets(image_buckets or DEFAULT_IMAGE_BUCKETS, tower))
        return model_class._export(
            model_id,
            export_config(config, model_id, neuron_config.torch_dtype, neuron_vision,
                          MTP_MAX_SPECULATIVE_TOKENS if mtp else 0, fp8_weights, fp8_lm_head),
            neuron_config,
            token=token,
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
            load_weights=load_weights,
        )


def _available_neuron_cores() -> int:
    return get_available_cores()


registration.register_model_class(Qwen35NeuronModelForCausalLM)
