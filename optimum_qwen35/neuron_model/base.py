"""The Qwen3.5 export model, stack-neutral: what `NeuronModelForCausalLM` does on both stacks, with no optimum-neuron.

    neuron_model/base.py     Qwen35ExportedModel: get_neuron_config, export, save_pretrained, from_pretrained,
                             push_to_hub (this file) + running.py's ExportRunning (runtime, generate, forward, ...)
    neuron_model/modeling.py Qwen35ModelForCausalLM: the class of the TorchNeuron stack (no optimum-neuron)
    optimum_neuron/modeling.py Qwen35NeuronModelForCausalLM: the same base under optimum-neuron's NeuronModelForCausalLM
                             (the NxD stack), which adds the NxD backend and optimum-neuron's config object

The hooks a stack overrides: `_default_target`, `_available_neuron_cores`, `_get_neuron_config` (the config object),
`_read_neuron_config`, `_export_nxd` and `_nxd_model_class` (the NxD backend, optimum-neuron's; refused in one line
here, naming the stack it needs).

An export folder:

    config.json              the text config (qwen3_5_text or qwen3_5_moe_text), `_name_or_path` = the source checkpoint
    neuron_config.json       a plain NxDNeuronConfig (neuron_model/neuron_config.py)
    generation_config.json, tokenizer files
    compiled/, checkpoint/   cpu target: the programs and each rank's weights (runtime/exported.py); TorchNeuron:
                             the graphs to compile (graphs.json) and each rank's weights

`save_pretrained` writes it atomically: into a hidden sibling folder, renamed into place when complete,
so an interrupted save never leaves a folder that loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from optimum_qwen35 import hub
from optimum_qwen35.backends.selection import choose_neuron_backend, nxd_installed
from optimum_qwen35.backends.torchneuron.device import torchneuron_installed
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.export.cpu import check_cpu_export, check_weights_dtype, export_config, export_cpu, save_export
from optimum_qwen35.export.compile import check_draft_vocab
from optimum_qwen35.neuron_model import neuron_config as nc
from optimum_qwen35.neuron_model.compile_cache import compile_cache_files, install_compile_cache
from optimum_qwen35.neuron_model.running import ExportRunning
from optimum_qwen35.optimum_neuron.loading import (
    EXPORT_TRUE_REFUSED,
    is_export_repo,
    loading_options,
    local_or_download,
    run_options,
    snapshot_revision,
)

logger = logging.getLogger(__name__)

NXD_STACK = (
    "the NxD backend (neuron_backend='nxd', trn1, inf2) runs on the NxD stack only: Python 3.10-3.11 with "
    "optimum-neuron 0.4.5 and the Neuron SDK (`pip install \"optimum-qwen35[optimum]\"` and `[neuronx]`); on this stack "
    "export for trn2 (TorchNeuron) or cpu"
)


class Qwen35ExportedModel(ExportRunning):
    """Qwen3.5 (dense or MoE, text and vision) as an export: built, saved, loaded and run (see the module docstring)."""

    main_input_name = "input_ids"
    # optimum-neuron main's chunked-prefill switch: this model's state must not be prefilled in chunks there.
    _supports_chunked_prefill = False

    def __init__(self, config, neuron_config, folder: str | os.PathLike, owns_folder: bool = False,
                 run_options: dict | None = None):
        self.config = config
        self.backend = layout.export_backend(layout.read_neuron_config(folder))
        self._run_options = run_options or {}  # a TorchNeuron export's compile_backend and device
        self.neuron_config = neuron_config
        self.folder = Path(folder)
        generation_file = self.folder / "generation_config.json"
        if generation_file.is_file():
            self.generation_config = GenerationConfig.from_pretrained(self.folder)
        else:
            self.generation_config = GenerationConfig.from_model_config(config)
        self._runtime = None
        self._prefix_cache = "auto"  # set_prefix_cache
        # An export's work folder goes away with the model; a loaded folder is the user's.
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True) if owns_folder else None

    # ------------------------------------------------------------------ the stack's hooks
    @classmethod
    def _default_target(cls) -> str:
        """The target of `get_neuron_config` when none is given: trn2 where TorchNeuron is installed, else cpu."""
        return "trn2" if torchneuron_installed() else nc.CPU_TARGET

    @classmethod
    def _available_neuron_cores(cls) -> int:
        """This machine's Neuron cores, to size an export given no tensor_parallel_size: unknown without
        optimum-neuron (0: the caller is asked for tensor_parallel_size)."""
        return 0

    # The config object of an export (neuron_model/neuron_config.py's own; optimum-neuron's NxDNeuronConfig there).
    _make_neuron_config = staticmethod(nc.export_neuron_config)
    _read_neuron_config = staticmethod(nc.load)

    @classmethod
    def _export_nxd(cls, model_id, config, neuron_config, **kwargs):
        raise IncompatibleExportError(NXD_STACK)

    @classmethod
    def _nxd_model_class(cls, folder, neuron_config):
        raise IncompatibleExportError(nc.NEEDS_NXD_STACK.format(folder=folder, compiler="?"))

    # ------------------------------------------------------------------ configuration
    @classmethod
    def get_neuron_config(
        cls,
        model_name_or_path,
        config=None,
        token=None,
        revision=None,
        instance_type: str | None = None,
        batch_size: int | None = None,
        sequence_length: int | None = None,
        tensor_parallel_size: int | None = None,
        dtype=None,
        target: str | None = None,
    ):
        """optimum-neuron's `get_neuron_config`, plus `dtype` and a `target` that may be "cpu".

        `target` (or `instance_type`) defaults to "cpu" where the Neuron SDK is not installed. A text config
        without `dtype` gets bfloat16 (optimum-neuron 0.4.5 fails there).
        """
        if target is not None and instance_type is not None and target != instance_type:
            raise UsageError(f"target={target!r} and instance_type={instance_type!r} disagree: give one of them")
        target = target or instance_type
        if target is None:
            target = cls._default_target()
        target = nc.normalize_target(target)
        folder = Path(model_name_or_path)
        checkpoint_id = checkpoint_revision = None
        if not folder.is_dir():
            checkpoint_id = os.fspath(model_name_or_path)
            folder = local_or_download(checkpoint_id, revision, token, allow_patterns=["config.json"])
            checkpoint_revision = snapshot_revision(folder) or revision
        if config is None:
            config = AutoConfig.from_pretrained(folder).get_text_config()
        qwen_config = Qwen35Config.from_pretrained(folder)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        if tensor_parallel_size is None:
            tensor_parallel_size = 1 if target == "cpu" else default_tensor_parallel_size(qwen_config, cls._available_neuron_cores(), target)
        if batch_size is None:
            batch_size = 1
        if sequence_length is None:
            sequence_length = min(qwen_config.max_position_embeddings, 4096)
        nc.check_shape(batch_size, sequence_length, tensor_parallel_size)
        try:
            qwen_config.check_tp_degree(tensor_parallel_size)
        except ValueError as error:
            raise UsageError(str(error)) from error
        return cls._get_neuron_config(
            checkpoint_id=checkpoint_id,
            checkpoint_revision=checkpoint_revision,
            instance_type=target,
            batch_size=batch_size,
            sequence_length=sequence_length,
            tensor_parallel_size=tensor_parallel_size,
            dtype=nc.normalize_dtype(dtype),
        )

    @classmethod
    def _get_neuron_config(
        cls,
        checkpoint_id,
        checkpoint_revision,
        instance_type,
        batch_size,
        sequence_length,
        tensor_parallel_size,
        dtype,
        **kwargs,  # optimum-neuron main adds prefill_chunk_size
    ):
        return cls._make_neuron_config(
            checkpoint_id, checkpoint_revision, instance_type, batch_size, sequence_length, tensor_parallel_size, dtype
        )

    # ------------------------------------------------------------------ export
    @classmethod
    def _export(
        cls,
        model_id,
        config,
        neuron_config,
        token=None,
        revision=None,
        cache_dir=None,
        force_download=False,
        local_files_only=False,
        trust_remote_code=False,
        load_weights=False,
        vision: bool = False,
        image_buckets=None,
        neuron_backend: str | None = None,
        mtp: bool = False,
        weights_dtype: str | None = None,
        draft_vocab_size: int | None = None,
        fp8_lm_head: bool = False,
        **kwargs,
    ):
        """`vision=True` adds the vision tower's graphs, one per image bucket of `image_buckets` patch rows (default
        runtime/images.py DEFAULT_IMAGE_BUCKETS), and the image context / token graphs; on the cpu target also the
        processor files. Without it the export is text-only, as before.

        `neuron_backend` ("nxd" or "torchneuron"; a Neuron target): the backend, else chosen by the target and what
        is installed (backends/selection.py). A TorchNeuron export is made without the SDK: the weights split per
        rank, the configs and the list of graphs, which TorchNeuron compiles on the first load on a device.

        `mtp=True`: also the checkpoint's multi-token-prediction head and the graphs of speculative decoding with it,
        which `generate(..., num_speculative_tokens=k)` runs (k <= 4; docs/speculative_decoding.md); every backend,
        at any tensor_parallel_size (the head sharded per rank as the main layers).

        `weights_dtype="fp8"` (every backend): the linear weights as float8 with Qwen's 128x128 block scales,
        dequantized beside each matmul in the graphs; an FP8 checkpoint's as they are, a bf16 one's quantized at
        export (docs/fp8.md). Without it an FP8 checkpoint is dequantized to `dtype`. `fp8_lm_head=True` (with it,
        past Qwen's format, which keeps lm_head in bf16): lm_head too, untied from the embedding where the checkpoint
        ties them (docs/fp8.md, "lm_head in FP8").

        `draft_vocab_size` (with `mtp=True`; cpu target, tensor_parallel_size 1): the head drafts over that many token
        ids, the first of the checkpoint's draft_vocab.json ranking, else of its tokenizer's merge order; speculation
        stays exact (docs/speculative_decoding.md, "Draft vocabulary")."""
        if vision is not True and vision is not False:
            raise UsageError(f"vision must be True or False, got {vision!r}")
        if mtp is not True and mtp is not False:
            raise UsageError(f"mtp must be True or False, got {mtp!r}")
        if image_buckets is not None and not vision:
            raise UsageError("image_buckets is an option of a vision export: pass vision=True with it")
        backend = layout.CPU_BACKEND
        if neuron_config.target != nc.CPU_TARGET:
            backend = choose_neuron_backend(neuron_config.target, neuron_backend)
        elif neuron_backend is not None:
            raise UsageError(f"neuron_backend={neuron_backend!r} applies to a Neuron target (trn1, inf2, trn2), not to target 'cpu'")
        check_weights_dtype(weights_dtype, fp8_lm_head)
        if draft_vocab_size is not None:
            check_draft_vocab(neuron_config.tp_degree, backend, weights_dtype == "fp8")
        if backend == layout.NXD_BACKEND:
            return cls._export_nxd(model_id, config, neuron_config, token=token, revision=revision, cache_dir=cache_dir,
                                   force_download=force_download, local_files_only=local_files_only,
                                   trust_remote_code=trust_remote_code, load_weights=load_weights, vision=vision,
                                   image_buckets=image_buckets, mtp=mtp, weights_dtype=weights_dtype,
                                   fp8_lm_head=fp8_lm_head)
        source = local_or_download(model_id, revision, token, allow_patterns=layout.CHECKPOINT_PATTERNS)
        work = export_cpu(source, config, neuron_config, model_id, vision, image_buckets, backend, mtp, weights_dtype,
                          draft_vocab_size, fp8_lm_head)
        model = cls(export_config(config, model_id, neuron_config.torch_dtype, fp8_lm_head=fp8_lm_head), neuron_config,
                    work, owns_folder=True)
        if load_weights:
            model.runtime  # noqa: B018 (loads the graphs' weights now)
        return model

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, save_directory, overwrite: bool = False, **kwargs) -> None:
        """Write the export to `save_directory` atomically (staged in a hidden sibling, then renamed).

        An existing non-empty folder is refused unless `overwrite=True`, and then replaced whole.
        """
        target = save_export(self.folder, save_directory, overwrite)
        logger.info("exported model saved in %s", target)

    def _save_pretrained(self, save_directory, **kwargs):
        self.save_pretrained(save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, model_id, revision=None, token=None, **kwargs):
        """Load an exported folder or Hub repo.

        Takes optimum-neuron's and transformers' loading keywords (`loading_options`): `cache_dir`,
        `force_download`, `local_files_only`, `subfolder` locate the export; `target`, `batch_size`,
        `sequence_length`, `tensor_parallel_size` and `dtype` (or `torch_dtype`), when given, must match what the
        export was compiled for; `export=True` on an export loads it; keywords with no meaning for an export
        (`trust_remote_code`, `low_cpu_mem_usage`, `device_map`, ...) are ignored with one warning. A TorchNeuron
        export also takes `compile_backend` and `device` ("neuron" and "neuron" by default; "eager" and "cpu" run its
        graphs on this machine's CPU)."""
        run = run_options(kwargs)
        source, expected, given_as = loading_options(kwargs)
        return cls._load(model_id, revision, token, source, expected, given_as, run=run)

    @classmethod
    def _load(cls, model_id, revision, token, source: dict, expected: dict, given_as: dict, config=None,
              run: dict | None = None):
        export = expected.pop("export", False)
        subfolder = source.pop("subfolder", None)
        local = Path(model_id, subfolder or "")
        if not Path(model_id).is_dir() and not is_export_repo(model_id, revision, token, subfolder):
            if export:
                raise UsageError(EXPORT_TRUE_REFUSED.format(model_id=model_id))
            return cls._from_compile_cache(os.fspath(model_id), revision, token, **expected)
        folder = local if Path(model_id).is_dir() else hub.resolve_export(model_id, revision, token, subfolder=subfolder, **source)
        if not Path(model_id).is_dir():
            install_compile_cache(folder)  # a TorchNeuron export pushed with its NEFFs: before the first compile
        if not layout.is_export(folder):
            if export and folder.is_dir():
                raise UsageError(EXPORT_TRUE_REFUSED.format(model_id=model_id))
            raise IncompatibleExportError(
                f"{model_id} is not an exported model (no {layout.NEURON_CONFIG_FILE}); export it first: "
                f"`optimum-qwen35 export --model {model_id} --target cpu OUT`"
            )
        neuron_config = cls._read_neuron_config(folder)
        nc.check_expected(neuron_config, folder, given_as, **expected)
        if config is None or subfolder:
            config = AutoConfig.from_pretrained(folder)
        backend = layout.export_backend(layout.read_neuron_config(folder))
        if run and backend != layout.TORCHNEURON_BACKEND:
            logger.warning("from_pretrained(): ignoring %s (they apply to a TorchNeuron export; %s is a %s export)",
                           ", ".join(sorted(run)), folder, backend)
            run = None
        if backend == layout.NXD_BACKEND:
            return cls._nxd_model_class(folder, neuron_config)._from_pretrained(folder, config)
        check_cpu_export(folder, neuron_config)
        model = cls(config, neuron_config, folder, run_options=run)
        model.runtime  # noqa: B018 (load now: a folder whose weights do not match fails here, not at generate)
        return model

    @classmethod
    def _from_compile_cache(cls, model_id: str, revision, token, **expected):
        """A Hub model (not an export) whose configuration is registered in the compile cache: exported now
        with the cached graphs (optimum-neuron's vLLM loader does the same with cached NEFFs)."""
        target = nc.normalize_target(expected.get("target") or "cpu")
        if nc.optimum_neuron_version() is None:
            raise IncompatibleExportError(
                f"{model_id} is not an exported model (no {layout.NEURON_CONFIG_FILE}): export it first "
                f"(`optimum-qwen35 export --model {model_id} --target {target} OUT`); exporting from the compile-cache "
                "registry needs optimum-neuron (the NxD stack)"
            )
        dtype = expected.get("dtype")
        entries = hub.lookup_registry(
            model_id,
            target=target,
            batch_size=expected.get("batch_size"),
            sequence_length=expected.get("sequence_length"),
            tp_degree=expected.get("tensor_parallel_size"),
            torch_dtype=None if dtype is None else str(nc.normalize_dtype(dtype)).removeprefix("torch."),
        )
        if not entries:
            raise IncompatibleExportError(
                f"{model_id} is not an exported model and the compile cache has no configuration of it matching "
                f"{ {k: v for k, v in expected.items() if v is not None} or 'these options'}: export it "
                f"(`optimum-qwen35 export --model {model_id} --target {target} OUT`) or list the cached ones "
                f"(`optimum-cli neuron cache lookup {model_id}`)"
            )
        chosen = entries[0]
        neuron_config = cls.get_neuron_config(
            model_id,
            revision=revision,
            token=token,
            batch_size=chosen["batch_size"],
            sequence_length=chosen["sequence_length"],
            tensor_parallel_size=chosen["tp_degree"],
            dtype=chosen["torch_dtype"],
            target=chosen["target"],
        )
        return cls.export(model_id, neuron_config, token=token, revision=revision, load_weights=True)

    @classmethod
    def _from_pretrained(cls, model_id, config, revision=None, token=None, **kwargs):
        """optimum-neuron's hook, what `NeuronModelForCausalLM.from_pretrained` (the abstract class) calls after its
        registry lookup with the caller's keywords: the same keywords as `from_pretrained`."""
        run = run_options(kwargs)
        source, expected, given_as = loading_options(kwargs)
        folder = Path(model_id)
        return cls._load(model_id, revision, token, source, expected, given_as, config if folder.is_dir() else None, run)

    # ------------------------------------------------------------------ Hub
    def push_to_hub(self, *args, **kwargs):
        """Upload the export: `push_to_hub(repo_id, revision=..., private=..., token=...)`, or optimum-neuron's
        `push_to_hub(save_directory, repository_id, ...)`. A TorchNeuron export also pushes the local NEFF compile cache
        (`compile_cache=False`: not; neuron_model/compile_cache.py says what is pushed)."""
        if len(args) == 2:
            folder, repo_id = args
        elif len(args) == 1:
            folder, repo_id = self.folder, args[0]
        else:
            folder, repo_id = kwargs.pop("save_directory", self.folder), kwargs.pop("repository_id", kwargs.pop("repo_id", None))
        if kwargs.pop("compile_cache", True) and self.backend == layout.TORCHNEURON_BACKEND:
            kwargs["extra_files"] = compile_cache_files()
        return hub.push_to_hub(folder, repo_id, **kwargs)



def default_tensor_parallel_size(qwen_config: Qwen35Config, cores: int, target: str) -> int:
    """The degree a Neuron-target export takes when none is given: the largest the model splits into
    (`Qwen35Config.check_tp_degree`) within the machine's `cores` Neuron cores. optimum-neuron takes all the cores,
    which is no valid degree for any Qwen3.5 size on trn2.48xlarge (64), trn1.32xlarge (32) or inf2.48xlarge (24)."""
    if cores < 1:  # optimum-neuron counts this machine's cores: none without a device
        sdk = "" if nxd_installed() else " (nor the Neuron SDK)"
        raise UsageError(
            f"this machine has no Neuron cores{sdk} to size a {target} export by: pass tensor_parallel_size "
            f"(--tensor_parallel_size; {qwen_config.valid_tp_degrees()} split this model), or export for this "
            "machine with target='cpu' (--target cpu)"
        )
    for degree in sorted((t for t in qwen_config.valid_tp_degrees() if t <= cores), reverse=True):
        try:
            qwen_config.check_tp_degree(degree)
        except UsageError:
            continue  # a MoE degree that leaves ranks without an expert
        logger.warning(
            "tensor_parallel_size not given: using %d, the largest degree <= this machine's %d Neuron cores that "
            "splits the model by whole heads (valid degrees: %s); pass tensor_parallel_size to choose another",
            degree, cores, qwen_config.valid_tp_degrees(),
        )
        return degree
    raise AssertionError("degree 1 always splits a model")  # valid_tp_degrees() holds 1


