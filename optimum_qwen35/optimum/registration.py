"""Registration of Qwen3.5 with transformers 4.57, optimum-neuron and vLLM, in every process that needs it.

- transformers 4.57 (optimum-neuron's pin) has no `qwen3_5`: its AutoConfig learns this package's config
  classes (`hf_configs`), so Qwen3.5 folders and exports load there.
- optimum-neuron looks a model class up in a plain registry by `model_type`: this package's class is
  registered for `qwen3_5`, `qwen3_5_text` and their MoE forms `qwen3_5_moe`, `qwen3_5_moe_text` (exports save the
  text config).
- `optimum-cli export neuron` exports in a child interpreter (`python3 -m optimum.exporters.neuron`), so a
  registration made in the calling process is lost. The installed `optimum_qwen35.pth` startup hook
  (`optimum_qwen35/_startup.py`) makes every interpreter register when it imports `transformers` (configs
  only, transformers < 5) or `optimum.neuron` (the model class), and imports nothing before that.
- vLLM runs `vllm.general_plugins` entry points in each of its processes: `vllm_plugin` below registers the
  architecture (`vllm_model.py`) and fits vLLM's settings to a Qwen3.5 export (`vllm_settings`).
- `NeuronModelForCausalLM.from_pretrained(folder)` (the abstract class) dispatches through
  `auto_model.get_neuron_model_class`, whose `has_neuron_model_class` first imports every built-in NxD model
  (`inference.auto_models`): that needs the Neuron SDK, although the registry already holds this package's class.
  `_dispatch_qwen35_first` wraps `has_neuron_model_class` so that the two Qwen3.5 model types, while registered
  to this package's class, are answered from the registry without that import; every other model type goes
  through optimum-neuron's own function, unchanged.
- `NeuronModelForCausalLM.get_neuron_config(model, instance_type="cpu", ...)`: optimum-neuron refuses "cpu" for every
  model (`normalize_instance_type`) before it looks at the model. `_cpu_target_through_the_abstract_class` hands that
  one call, for a Qwen3.5 config, to this package's `get_neuron_config` (which knows the cpu target); any other
  call, and "cpu" for any other model, goes to optimum-neuron's method unchanged. `NeuronModelForCausalLM.export`
  then dispatches through the registry like from_pretrained.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# The text config's model type, which an export's config.json carries: dense and MoE.
TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
TASK = "text-generation"
# What a Qwen3.5 config.json names as its architecture, which vLLM 0.11 does not know; an export's config.json
# (the text config) names the text model's class (EXPORT_ARCHITECTURES).
ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
)
EXPORT_ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
# The class vLLM inspects for them (torch only); optimum-neuron's platform loads the export itself.
VLLM_MODEL_CLASS = "optimum_qwen35.optimum.vllm_model:Qwen35ForOptimumNeuron"
# optimum-neuron's worker, with the export loaded by this package's class: for cpu-target exports only.
VLLM_CPU_WORKER = "optimum_qwen35.optimum.vllm_worker.Qwen35CpuExportWorker"


def register_transformers() -> bool:
    """Teach transformers' AutoConfig the Qwen3.5 configs where it lacks them. True if it registered."""
    from optimum_qwen35.config import register_transformers_configs

    return register_transformers_configs()


class Qwen35ExportLoader:
    """transformers 4.57's `AutoModelForCausalLM` entry for Qwen3.5's text config, so that
    `transformers.pipeline("text-generation", model="out/")` loads an export (a folder or a Hub id) with
    `Qwen35NeuronModelForCausalLM` instead of failing on a list of ~150 config classes. It takes transformers' loading
    keywords (config=, _from_pipeline=, ...), which the class's strict `from_pretrained` refuses, and carries the
    class's name: the text-generation pipeline checks the loaded model's class name against the mapping's names."""

    @classmethod
    def from_pretrained(cls, model_id, *args, revision=None, token=None, **kwargs):
        from optimum_qwen35.optimum.modeling import Qwen35NeuronModelForCausalLM  # noqa: PLC0415

        return Qwen35NeuronModelForCausalLM.from_pretrained(model_id, revision=revision, token=token)


Qwen35ExportLoader.__name__ = "Qwen35NeuronModelForCausalLM"


def register_pipeline_loader() -> None:
    """When transformers 4.57's pipelines import: `Qwen35ExportLoader` for the text config, unless a class is mapped."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415

    register_transformers()
    for model_type in TEXT_MODEL_TYPES:
        text_config = CONFIG_MAPPING[model_type]
        if text_config.__module__.startswith("optimum_qwen35.") and text_config not in AutoModelForCausalLM._model_mapping:
            _map_export_loader(text_config)


class Qwen35MoeExportLoader(Qwen35ExportLoader):
    """`Qwen35ExportLoader` for the MoE text config (transformers wants one `config_class` per mapped class)."""


Qwen35MoeExportLoader.__name__ = "Qwen35NeuronModelForCausalLM"


def _map_export_loader(text_config) -> None:
    """The export loader for one of this package's text config classes, in AutoModelForCausalLM's mapping."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    loader = Qwen35MoeExportLoader if text_config.model_type == "qwen3_5_moe_text" else Qwen35ExportLoader
    loader.config_class = text_config
    AutoModelForCausalLM.register(text_config, loader, exist_ok=True)


def register_optimum_neuron() -> None:
    """Register the model class in optimum-neuron's registry for both Qwen3.5 model types."""
    import sys

    modeling = sys.modules.get(f"{__package__}.modeling")
    if modeling is not None and not hasattr(modeling, "Qwen35NeuronModelForCausalLM"):
        return  # the model module is importing optimum.neuron right now: it registers its class when done
    from optimum_qwen35.optimum.modeling import Qwen35NeuronModelForCausalLM

    register_model_class(Qwen35NeuronModelForCausalLM)


def register_model_class(cls) -> None:
    from optimum.neuron.models.auto_model import register_neuron_model
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in MODEL_TYPES:
        register_neuron_model(model_type, TASK, "inference")(cls)
    _dispatch_qwen35_first()
    _cpu_target_through_the_abstract_class()
    _missing_models_in_one_line()
    # transformers' text-generation pipeline checks the model class against AutoModelForCausalLM's mapping;
    # with this package's own config class (transformers 4.57), map it to this class, as NxD models are not.
    register_transformers()
    for model_type in TEXT_MODEL_TYPES:
        text_config = CONFIG_MAPPING[model_type]
        if text_config.__module__.startswith("optimum_qwen35."):
            _map_export_loader(text_config)
    # The image-text-to-text pipeline checks against a fixed list of class names, which nothing can extend.
    from optimum_qwen35.quiet import image_text_to_text_pipeline, pipeline_device_line  # noqa: PLC0415

    image_text_to_text_pipeline([cls.__name__])
    pipeline_device_line([cls.__name__])


def _dispatch_qwen35_first() -> None:
    """Let optimum-neuron's abstract classes find the Qwen3.5 class without importing the Neuron SDK (see the
    module docstring). Idempotent; other model types keep optimum-neuron's own lookup."""
    from optimum.neuron.models import auto_model  # noqa: PLC0415

    original = auto_model.has_neuron_model_class
    if getattr(original, "_optimum_qwen35", False):
        return

    def has_neuron_model_class(model_type, task, mode):
        if task == TASK and mode == "inference" and _registered_qwen35_class(model_type) is not None:
            return True
        return original(model_type, task, mode)

    has_neuron_model_class._optimum_qwen35 = True
    has_neuron_model_class.__wrapped__ = original
    has_neuron_model_class.__doc__ = original.__doc__
    auto_model.has_neuron_model_class = has_neuron_model_class


def _registered_qwen35_class(model_type: str):
    from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS  # noqa: PLC0415

    cls = _REGISTERED_NEURON_MODELS.get((model_type, TASK, "inference"))
    if model_type in MODEL_TYPES and cls is not None and cls.__module__.startswith("optimum_qwen35."):
        return cls
    return None


def _cpu_target_through_the_abstract_class() -> None:
    """`NeuronModelForCausalLM.get_neuron_config(..., instance_type="cpu")` for Qwen3.5 (see the module docstring).
    Idempotent."""
    import inspect  # noqa: PLC0415

    from optimum.neuron.models.inference.modeling_utils import NeuronModelForCausalLM  # noqa: PLC0415

    original = NeuronModelForCausalLM.get_neuron_config.__func__
    if getattr(original, "_optimum_qwen35", False):
        return

    def get_neuron_config(cls, model_name_or_path, config=None, token=None, revision=None, instance_type=None, **kwargs):
        if instance_type == "cpu" and inspect.isabstract(cls):
            from transformers import AutoConfig  # noqa: PLC0415

            text_config = config or AutoConfig.from_pretrained(
                model_name_or_path, revision=revision, token=token
            ).get_text_config()
            qwen35_class = _registered_qwen35_class(text_config.model_type)
            if qwen35_class is not None:
                return qwen35_class.get_neuron_config(
                    model_name_or_path, config=config, token=token, revision=revision, instance_type="cpu", **kwargs
                )
        return original(cls, model_name_or_path, config, token, revision, instance_type, **kwargs)

    get_neuron_config._optimum_qwen35 = True
    get_neuron_config.__wrapped__ = original
    get_neuron_config.__doc__ = original.__doc__
    NeuronModelForCausalLM.get_neuron_config = classmethod(get_neuron_config)


def _missing_models_in_one_line() -> None:
    """`NeuronModelForCausalLM.from_pretrained(name)` (the abstract class) where `name` is no local folder: a name the
    Hub refuses (`outt/`) raises `ModelNotFoundError`, and a Hub id is checked first the way this package downloads
    (one request, no retries: huggingface_hub retries transformers' HEAD five times over 23 s before its OSError),
    raising this package's Hub errors in one line. Its config.json lands in the Hugging Face cache, where
    optimum-neuron then reads it; any model type then goes on through optimum-neuron's method unchanged. Idempotent."""
    import inspect  # noqa: PLC0415
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from optimum.neuron.models.inference.modeling_utils import NeuronModelForCausalLM  # noqa: PLC0415

    original = NeuronModelForCausalLM.from_pretrained.__func__
    if getattr(original, "_optimum_qwen35", False):
        return

    def from_pretrained(cls, model_id, *args, **kwargs):
        if inspect.isabstract(cls) and isinstance(model_id, (str, os.PathLike)) and not Path(model_id).is_dir():
            from optimum_qwen35.hub import download_checkpoint  # noqa: PLC0415

            if Path(model_id).exists():
                from optimum_qwen35.errors import ModelNotFoundError  # noqa: PLC0415

                raise ModelNotFoundError(f"{model_id} is a file, not an export folder")
            download_checkpoint(os.fspath(model_id), kwargs.get("revision"), kwargs.get("token"), allow_patterns=["config.json"])
        return original(cls, model_id, *args, **kwargs)

    from_pretrained._optimum_qwen35 = True
    from_pretrained.__wrapped__ = original
    from_pretrained.__doc__ = original.__doc__
    NeuronModelForCausalLM.from_pretrained = classmethod(from_pretrained)


def register() -> None:
    """Everything that can be registered in this process."""
    register_transformers()
    register_optimum_neuron()


def vllm_plugin() -> list[str]:
    """vLLM's `general_plugins` entry point: registers what it can and returns what it registered.

    vLLM itself is optional: without it, the configs and the optimum-neuron class are still registered.
    """
    done = []
    if register_transformers():
        done.append("transformers configs")
    try:
        register_optimum_neuron()
        done.append("optimum-neuron model class")
    except ImportError as error:  # optimum-neuron not installed
        logger.info("optimum-neuron is not installed, its registry is skipped: %s", error)
    try:
        from vllm import ModelRegistry
    except ImportError:
        return done
    # optimum-neuron's vLLM platform loads the model itself; vLLM only needs to accept the architecture.
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, VLLM_MODEL_CLASS)
    done.append("vLLM architectures")
    try:
        from optimum.neuron.vllm.platform import OptimumNeuronPlatform  # noqa: PLC0415  (imports vLLM only)
    except ImportError:
        return done
    _serve_exports_within_their_shape(OptimumNeuronPlatform)
    done.append("vLLM settings of Qwen3.5 exports")
    return done


def qwen35_export(model) -> tuple[dict, dict] | None:
    """(config.json, neuron_config.json) of a local folder holding a Qwen3.5 export, else None."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    folder = Path(str(model))
    try:
        config = json.loads((folder / "config.json").read_text())
        neuron_config = json.loads((folder / "neuron_config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("model_type") not in MODEL_TYPES or not isinstance(neuron_config, dict):
        return None
    return config, neuron_config


def vllm_settings(vllm_config) -> None:
    """vLLM's settings for a Qwen3.5 export, before optimum-neuron's platform reads them; other models unchanged.

    - the longest sequence is the export's `sequence_length` (vLLM derives 262144 from the config), so that vLLM
      itself refuses longer requests; at most `batch_size` sequences at once (the export's slots);
    - every prompt is prefilled whole: optimum-neuron's runner runs each new request's whole prompt in one call,
      so chunked prefill is off and the step's token budget holds a full-length prompt beside a decode step of
      every slot (vLLM's default budget, 2048 to 8192 tokens, would never schedule a longer prompt);
    - a cpu-target export runs in optimum-neuron's worker with this package's loader (`vllm_worker.py`), which
      needs no Neuron core or compiler; Neuron exports keep optimum-neuron's worker.
    """
    model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    export = None if model_config is None else qwen35_export(model_config.model)
    if export is None:
        return
    _, neuron_config = export
    length, slots = int(neuron_config["sequence_length"]), int(neuron_config["batch_size"])
    if model_config.max_model_len > length:
        logger.info("max_model_len %d -> %d: the export's sequence_length", model_config.max_model_len, length)
        model_config.max_model_len = length
    if scheduler is not None:
        scheduler.max_model_len = model_config.max_model_len
        scheduler.max_num_seqs = min(scheduler.max_num_seqs, slots)
        scheduler.enable_chunked_prefill = scheduler.chunked_prefill_enabled = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model_config.max_model_len + slots)
        scheduler.max_num_partial_prefills = 1
    parallel = vllm_config.parallel_config
    if neuron_config.get("target") == "cpu" and parallel is not None and parallel.worker_cls == "auto":
        parallel.worker_cls = VLLM_CPU_WORKER


def _serve_exports_within_their_shape(platform) -> None:
    """`vllm_settings` applied first by optimum-neuron's platform (`check_and_update_config`). Idempotent."""
    original = platform.check_and_update_config.__func__
    if getattr(original, "_optimum_qwen35", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        vllm_settings(vllm_config)
        return original(cls, vllm_config)

    check_and_update_config._optimum_qwen35 = True
    check_and_update_config.__wrapped__ = original
    platform.check_and_update_config = classmethod(check_and_update_config)
