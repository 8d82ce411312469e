"""Registration of Qwen3.5 with transformers 4.57 and optimum-neuron, in every process that needs it.

- transformers 4.57 (optimum-neuron's pin) has no `qwen3_5`: its AutoConfig learns this package's config classes
  (`config/transformers_configs.py`), so Qwen3.5 folders and exports load there; its `AutoModelForCausalLM` maps the
  text configs to an export loader, so that `transformers.pipeline("text-generation", model=export)` loads one.
- optimum-neuron looks a model class up in a plain registry by `model_type`: this package's class is registered for
  the four Qwen3.5 model types (export/layout.py MODEL_TYPES; exports save the text config).
- `optimum-cli export neuron` exports in a child interpreter (`python3 -m optimum.exporters.neuron`), so a
  registration made in the calling process is lost. The installed `optimum_qwen35.pth` start-up hook
  (`optimum_qwen35/_startup.py`) makes every interpreter register when it imports `transformers` (configs only,
  transformers < 5) or `optimum.neuron` (it imports the model module, whose last line calls `register_model_class`),
  and imports nothing before that. This module never imports the model module: it finds the class in
  optimum-neuron's registry (`registered_class`).
- What optimum-neuron's own functions cannot be told through its registry is patched in `patches/`, each patch
  handed `registered_class` to know which model types are this package's.
- vLLM: `serving/vllm_plugin.py`.
"""

from __future__ import annotations

from optimum_qwen35 import patches
from optimum_qwen35.config import register_transformers_configs
from optimum_qwen35.export.layout import MODEL_TYPES, TASK, TEXT_MODEL_TYPES

def register_transformers() -> bool:
    """Teach transformers' AutoConfig the Qwen3.5 configs where it lacks them. True if it registered."""
    return register_transformers_configs()


class Qwen35ExportLoader:
    """transformers 4.57's `AutoModelForCausalLM` entry for Qwen3.5's text config, so that
    `transformers.pipeline("text-generation", model="out/")` loads an export (a folder or a Hub id) with
    `Qwen35NeuronModelForCausalLM` instead of failing on a list of ~150 config classes. It takes transformers' loading
    keywords (config=, _from_pipeline=, ...), which the class's strict `from_pretrained` refuses, and carries the
    class's name: the text-generation pipeline checks the loaded model's class name against the mapping's names."""

    @classmethod
    def from_pretrained(cls, model_id, *args, revision=None, token=None, **kwargs):
        import optimum.neuron  # noqa: F401  start-up time; its import registers the class (the start-up hook)

        return registered_class(cls.config_class.model_type).from_pretrained(model_id, revision=revision, token=token)


Qwen35ExportLoader.__name__ = "Qwen35NeuronModelForCausalLM"


class Qwen35MoeExportLoader(Qwen35ExportLoader):
    """`Qwen35ExportLoader` for the MoE text config (transformers wants one `config_class` per mapped class)."""


Qwen35MoeExportLoader.__name__ = "Qwen35NeuronModelForCausalLM"


def register_pipeline_loader() -> None:
    """When transformers 4.57's pipelines import: `Qwen35ExportLoader` for the text config, unless a class is mapped."""
    from transformers import AutoModelForCausalLM  # start-up time: runs when transformers is imported
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # (the same)

    register_transformers()
    for model_type in TEXT_MODEL_TYPES:
        text_config = CONFIG_MAPPING[model_type]
        if text_config.__module__.startswith("optimum_qwen35.") and text_config not in AutoModelForCausalLM._model_mapping:
            _map_export_loader(text_config)


def _map_export_loader(text_config) -> None:
    """The export loader for one of this package's text config classes, in AutoModelForCausalLM's mapping."""
    from transformers import AutoModelForCausalLM  # start-up time: runs when transformers is imported

    loader = Qwen35MoeExportLoader if text_config.model_type == "qwen3_5_moe_text" else Qwen35ExportLoader
    loader.config_class = text_config
    AutoModelForCausalLM.register(text_config, loader, exist_ok=True)


def register_model_class(cls) -> None:
    from optimum.neuron.models.auto_model import register_neuron_model  # imported by the model class already
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # (the same)

    for model_type in MODEL_TYPES:
        register_neuron_model(model_type, TASK, "inference")(cls)
    patches.dispatch_registered_first(registered_class)
    patches.cpu_target_through_the_abstract_class(registered_class)
    patches.missing_models_in_one_line(_check_model_id)
    # transformers' text-generation pipeline checks the model class against AutoModelForCausalLM's mapping;
    # with this package's own config class (transformers 4.57), map it to this class, as NxD models are not.
    register_transformers()
    for model_type in TEXT_MODEL_TYPES:
        text_config = CONFIG_MAPPING[model_type]
        if text_config.__module__.startswith("optimum_qwen35."):
            _map_export_loader(text_config)
    patches.image_text_to_text_pipeline([cls.__name__])
    patches.pipeline_device_line([cls.__name__])


def registered_class(model_type: str, task: str = TASK):
    """This package's class in optimum-neuron's registry for a Qwen3.5 model type, else None."""
    from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS  # imported by the model class already

    cls = _REGISTERED_NEURON_MODELS.get((model_type, task, "inference"))
    if model_type in MODEL_TYPES and cls is not None and cls.__module__.startswith("optimum_qwen35."):
        return cls
    return None


def _check_model_id(model_id: str, revision, token) -> None:
    """A name that is no local folder, checked the way this package downloads (one request, one-line errors)."""
    from optimum_qwen35.hub.download import download_checkpoint  # start-up: imports huggingface_hub on use

    download_checkpoint(model_id, revision, token, allow_patterns=["config.json"])
