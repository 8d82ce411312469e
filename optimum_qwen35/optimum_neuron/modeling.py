"""Qwen3.5 as an optimum-neuron model: `Qwen35NeuronModelForCausalLM`, a `NeuronModelForCausalLM`.

The optimum-neuron flow, unchanged:

    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        "path/or/hub-id", batch_size=4, sequence_length=4096, tensor_parallel_size=4, dtype="bfloat16", target="cpu"
    )
    model = Qwen35NeuronModelForCausalLM.export("path/or/hub-id", neuron_config, load_weights=True)
    model.save_pretrained("out/")
    model = Qwen35NeuronModelForCausalLM.from_pretrained("out/")      # in any process
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_k=50)

One class, one flow; the compilation target (`neuron_config.target`) and the backend only change how graphs are
built and run: "cpu" runs this project's `torch.export` graphs (runtime/exported.py); a Neuron target runs on one of
two backends (backends/selection.py picks it, `neuron_backend=` overrides): NxD, optimum-neuron's neuronx-distributed
backend (trn1, inf2, and trn2 on SDK <= 2.33; `optimum_qwen35/backends/nxd/`, needs the Neuron SDK; `export` and
`from_pretrained` return its `Qwen35NxDModelForCausalLM`, and the export folder is optimum-neuron's: model.pt,
checkpoint/weights/), or TorchNeuron (trn2 / trn3 on SDK 2.33+; backends/torchneuron/: the export needs no SDK, the
first load on a device compiles each graph with `torch.compile(backend="neuron")`).

An export folder:

    config.json              the text config (qwen3_5_text or qwen3_5_moe_text), `_name_or_path` = the source checkpoint
    neuron_config.json       a plain NxDNeuronConfig (see neuron_config.py)
    generation_config.json, tokenizer files
    compiled/, checkpoint/   cpu target: the programs and each rank's weights (runtime/exported.py); TorchNeuron:
                             the graphs to compile (graphs.json) and each rank's weights

`save_pretrained` writes it atomically: into a hidden sibling folder, renamed into place when complete,
so an interrupted save never leaves a folder that loads.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import weakref
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from optimum_qwen35.patches import optimum_neuron_import

with optimum_neuron_import():  # no device-probe error or trn1-override warning on a machine without Neuron
    from optimum.neuron.models.inference.modeling_utils import NeuronModelForCausalLM
    from optimum.neuron.utils.instance import get_default_compilation_target
    from optimum.neuron.utils.system import get_available_cores

from optimum_qwen35 import hub
from optimum_qwen35.backends.selection import choose_neuron_backend
from optimum_qwen35.backends.torchneuron.runner import load_runtime as load_torchneuron_runtime
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.export.compile import MTP_MAX_SPECULATIVE_TOKENS
from optimum_qwen35.export.cpu import check_cpu_export, check_image_buckets, export_config, export_cpu, save_export
from optimum_qwen35.modeling.vision import VisionConfig
from optimum_qwen35.optimum_neuron import neuron_config as nc
from optimum_qwen35.optimum_neuron import registration
from optimum_qwen35.optimum_neuron.generation import generate, token_lists
from optimum_qwen35.optimum_neuron.loading import (
    EXPORT_TRUE_REFUSED,
    is_export_repo,
    loading_options,
    local_or_download,
    run_options,
    snapshot_revision,
)
from optimum_qwen35.optimum_neuron.scoring import causal_lm_forward
from optimum_qwen35.runtime.host_loop import Qwen35Runtime
from optimum_qwen35.runtime.images import DEFAULT_IMAGE_BUCKETS
from optimum_qwen35.runtime.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

def _neuron_sdk_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch_neuronx", "neuronx_distributed"))


def _neuron_backend_unavailable(target: str) -> IncompatibleExportError:
    return IncompatibleExportError(
        f"target {target!r} needs the Neuron backend, but the Neuron SDK (torch-neuronx, neuronx-distributed) is not "
        "installed here: on a Neuron instance install it (`pip install \"optimum-qwen35[neuronx]\"` from AWS's Neuron "
        "package index); on this machine use target='cpu' (`--target cpu`)"
    )


def _neuron_model_class(target: str):
    """The class that builds and runs the Neuron targets' graphs (`neuron/model.py`; imports the Neuron SDK)."""
    if not _neuron_sdk_available():
        raise _neuron_backend_unavailable(target)
    from optimum_qwen35.backends.nxd.model import Qwen35NxDModelForCausalLM  # optional dependency: the Neuron SDK

    return Qwen35NxDModelForCausalLM


class Qwen35NeuronModelForCausalLM(NeuronModelForCausalLM):
    """Qwen3.5 (dense or MoE, text and vision) for optimum-neuron, on a Neuron target or on this project's cpu target."""

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
            target = "cpu" if not _neuron_sdk_available() else None
        if target is None:
            target = get_default_compilation_target()
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
            tensor_parallel_size = 1 if target == "cpu" else default_tensor_parallel_size(qwen_config, _available_neuron_cores(), target)
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
        return nc.nxd_neuron_config(
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
        at any tensor_parallel_size (the head sharded per rank as the main layers)."""
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
        if backend == layout.NXD_BACKEND:
            # optimum-neuron's NxD flow (trace, compile, load the weights split by this project's layout); a vision
            # export's graphs and tower weights come with it, named in the config it saves.
            neuron_vision = None
            if vision:
                # `config` is the text part (optimum-neuron's export hands that on): the tower is in the whole one.
                tower = VisionConfig.from_dict(AutoConfig.from_pretrained(model_id, revision=revision, token=token).to_dict())
                if tower is None:
                    raise UsageError(f"vision=True, but {model_id} has no vision tower (a text-only config): export it without vision")
                neuron_vision = (tower, check_image_buckets(image_buckets or DEFAULT_IMAGE_BUCKETS, tower))
            return _neuron_model_class(neuron_config.target)._export(
                model_id,
                export_config(config, model_id, neuron_config.torch_dtype, neuron_vision,
                              MTP_MAX_SPECULATIVE_TOKENS if mtp else 0),
                neuron_config,
                token=token,
                revision=revision,
                cache_dir=cache_dir,
                force_download=force_download,
                local_files_only=local_files_only,
                trust_remote_code=trust_remote_code,
                load_weights=load_weights,
            )
        source = local_or_download(model_id, revision, token, allow_patterns=layout.CHECKPOINT_PATTERNS)
        work = export_cpu(source, config, neuron_config, model_id, vision, image_buckets, backend, mtp)
        model = cls(export_config(config, model_id, neuron_config.torch_dtype), neuron_config, work, owns_folder=True)
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
        if not layout.is_export(folder):
            if export and folder.is_dir():
                raise UsageError(EXPORT_TRUE_REFUSED.format(model_id=model_id))
            raise IncompatibleExportError(
                f"{model_id} is not an exported model (no {layout.NEURON_CONFIG_FILE}); export it first: "
                f"`optimum-qwen35 export --model {model_id} --target cpu OUT`"
            )
        neuron_config = nc.load(folder)
        nc.check_expected(neuron_config, folder, given_as, **expected)
        if config is None or subfolder:
            config = AutoConfig.from_pretrained(folder)
        backend = layout.export_backend(layout.read_neuron_config(folder))
        if run and backend != layout.TORCHNEURON_BACKEND:
            logger.warning("from_pretrained(): ignoring %s (they apply to a TorchNeuron export; %s is a %s export)",
                           ", ".join(sorted(run)), folder, backend)
            run = None
        if backend == layout.NXD_BACKEND:
            return _neuron_model_class(neuron_config.target)._from_pretrained(folder, config)
        check_cpu_export(folder, neuron_config)
        model = cls(config, neuron_config, folder, run_options=run)
        model.runtime  # noqa: B018 (load now: a folder whose weights do not match fails here, not at generate)
        return model

    @classmethod
    def _from_compile_cache(cls, model_id: str, revision, token, **expected):
        """A Hub model (not an export) whose configuration is registered in the compile cache: exported now
        with the cached graphs (optimum-neuron's vLLM loader does the same with cached NEFFs)."""
        target = nc.normalize_target(expected.get("target") or "cpu")
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

    # ------------------------------------------------------------------ running
    @property
    def runtime(self) -> Qwen35Runtime:
        """The host loop over the export's compiled programs (`runtime.host_loop.Qwen35Runtime.from_export`), started
        on first use; a TorchNeuron export's graphs are compiled by their first call (`compile_backend` and `device`
        of from_pretrained: "neuron" by default)."""
        if self._runtime is None:
            if self.backend == layout.TORCHNEURON_BACKEND:
                self._runtime = load_torchneuron_runtime(self.folder, **self._run_options)
            else:
                self._runtime = Qwen35Runtime.from_export(self.folder)
            self._apply_prefix_cache()
        return self._runtime

    def set_prefix_cache(self, cache: PrefixCache | str | None = "auto") -> None:
        """Prefix caching for `generate` and the continuous-batching `prefill` / `decode` (runtime/prefix_cache.py,
        docs/prefix_caching.md): a prompt starting with the tokens of an earlier one resumes context encoding from
        its cached block states, with the same logits as without a hit.

        "auto" (the default): on, with a `PrefixCache` of the export's block size (4 GiB budget), where the export
        holds context programs that continue a sequence (cpu exports made by this version); off, with one log line,
        for older exports, whose context programs start fresh sequences only.
        A `PrefixCache`: on with that cache (its block size must be the export's), refused (IncompatibleExportError)
        where the graphs cannot resume. None: off."""
        if not (cache is None or cache == "auto" or isinstance(cache, PrefixCache)):
            raise UsageError(f'prefix_cache must be "auto", a PrefixCache or None, got {cache!r}')
        self._prefix_cache = cache
        if self._runtime is not None:
            self._apply_prefix_cache()

    def _apply_prefix_cache(self) -> None:
        cache = self._prefix_cache
        if cache == "auto":
            graphs = self._runtime.graphs
            if getattr(graphs, "prefix_cache_owner", None) is None:
                logger.info("prefix caching off: %s's context programs start fresh sequences only (an export made "
                            "before continuing programs existed); export it again to turn it on", self.folder)
                self._runtime.set_prefix_cache(None)
                return
            cache = PrefixCache(block_size=graphs.prefix_block_size)
        self._runtime.set_prefix_cache(cache)

    def can_generate(self) -> bool:
        return True

    def generate(self, input_ids, attention_mask=None, generation_config=None, stopping_criteria=None, streamer=None,
                 **kwargs):
        """transformers-style generation (optimum-neuron's `generate` signature): greedy or sampled (do_sample,
        temperature, top_k, top_p), EOS stopping, transformers `stopping_criteria` (called after every step with
        the ids and the step's logits; rows it flags finish), a streamer; returns [batch, prompt + new tokens].
        Batches larger than the compiled batch size run in waves. `token_type_ids` is accepted and ignored. A vision
        export also takes the processor's `pixel_values` and `image_grid_thw` (`mm_token_type_ids` is accepted:
        the image tokens are read from input_ids).

        `num_speculative_tokens=k` (0, the default: off) decodes speculatively with the checkpoint's own
        multi-token-prediction head, k drafts per round, on an export made with mtp=True: greedy, the same tokens as
        plain greedy decoding; sampled, the same distribution (the standard rejection rule). It takes no streamer,
        stopping_criteria, min_new_tokens or images (docs/speculative_decoding.md)."""
        return generate(self.runtime, self.generation_config, input_ids, attention_mask, generation_config, streamer,
                        stopping_criteria=stopping_criteria, **kwargs)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seq_ids) -> torch.Tensor:
        """Continuous batching: start each row's prompt in slot `seq_ids[row]`; next-token logits [n, vocab]."""
        return self.runtime.prefill(token_lists(input_ids, attention_mask), [int(s) for s in seq_ids])

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_ids) -> torch.Tensor:
        """Continuous batching: one token per slot in `seq_ids`, at `position_ids`; logits [n, vocab]."""
        tokens, positions = input_ids.reshape(-1).tolist(), position_ids.reshape(-1).tolist()
        return self.runtime.decode(tokens, positions, [int(s) for s in seq_ids])

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Two callers. optimum-neuron's runners (its vLLM worker) pass `seq_ids` (and `position_ids`,
        `sampling_params`): `serving_step` answers them as its NxD models do. Otherwise:

        Teacher-forced logits at every position, as transformers' `model(input_ids, attention_mask).logits`.

        Returns a transformers `CausalLMOutput`: `logits` [batch, length, vocab] fp32 (zeros where
        `attention_mask` is 0; left or right padding), and with `labels` the mean next-token cross-entropy `loss`
        (labels shifted inside, -100 ignored, as transformers does). Runs the per-position logits graphs of the
        export, in waves of the compiled batch size, each row fresh from position 0 (no cache is read); the
        slots it borrows get their state back, so sequences running through prefill()/decode() are not disturbed.
        Inputs longer than the compiled sequence length are refused."""
        if kwargs.get("seq_ids") is not None:
            if attention_mask is not None or labels is not None:
                raise UsageError("a call with seq_ids (optimum-neuron's runner call) takes no attention_mask or labels")
            return self.serving_step(input_ids, **kwargs)
        return causal_lm_forward(
            self.runtime.logits, self.config.vocab_size, input_ids, attention_mask, labels, return_dict, **kwargs
        )

    def serving_step(self, input_ids, position_ids=None, seq_ids=None, sampling_params=None) -> torch.Tensor:
        """optimum-neuron's runner call `model(input_ids, position_ids=, seq_ids=, sampling_params=)`, answered as
        its NxD models answer it (`NxDModelForCausalLM.forward`): a prefill when the call has more than one column
        and a row starts at position 0 (rows right-padded, each row's length its largest position + 1), otherwise
        one decode step per row at its position (a row at position 0 starts a fresh one-token sequence). Row i
        uses slot `seq_ids[i]`. Returns fp32 logits [rows, 1, vocab] (the export samples on the host:
        `on_device_sampling` is off, so `sampling_params` is not read)."""
        if input_ids is None or position_ids is None or input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise UsageError("the runner call needs input_ids and position_ids, both [rows, tokens]")
        if seq_ids.dim() != 1 or seq_ids.shape[0] != input_ids.shape[0]:
            raise UsageError(f"seq_ids must name one slot per row: {tuple(seq_ids.shape)} for {input_ids.shape[0]} rows")
        slots = [int(s) for s in seq_ids]
        if input_ids.shape[-1] > 1 and int(position_ids.min()) == 0:
            lengths = (position_ids.max(dim=1).values + 1).tolist()
            prompts = [row[:n].tolist() for row, n in zip(input_ids, lengths)]
            logits = self.runtime.prefill(prompts, slots)
        else:
            tokens, positions = input_ids[:, -1].tolist(), position_ids[:, -1].tolist()
            logits = torch.empty(len(slots), self.config.vocab_size)
            fresh = [i for i, p in enumerate(positions) if p == 0]
            going = [i for i, p in enumerate(positions) if p != 0]
            if fresh:
                logits[fresh] = self.runtime.prefill([[tokens[i]] for i in fresh], [slots[i] for i in fresh]).float()
            if going:
                logits[going] = self.runtime.decode(
                    [tokens[i] for i in going], [positions[i] for i in going], [slots[i] for i in going]
                ).float()
        return logits.float()[:, None, :]

    def reset(self) -> None:
        """Nothing to clear: a prefill replaces its slots' state whole."""

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (if any)."""
        if self._runtime is not None and hasattr(self._runtime, "close"):
            self._runtime.close()
        self._runtime = None

    # ------------------------------------------------------------------ Hub
    def push_to_hub(self, *args, **kwargs):
        """Upload the export: `push_to_hub(repo_id, revision=..., private=..., token=...)`, or optimum-neuron's
        `push_to_hub(save_directory, repository_id, ...)`."""
        if len(args) == 2:
            folder, repo_id = args
        elif len(args) == 1:
            folder, repo_id = self.folder, args[0]
        else:
            folder, repo_id = kwargs.pop("save_directory", self.folder), kwargs.pop("repository_id", kwargs.pop("repo_id", None))
        return hub.push_to_hub(folder, repo_id, **kwargs)


def default_tensor_parallel_size(qwen_config: Qwen35Config, cores: int, target: str) -> int:
    """The degree a Neuron-target export takes when none is given: the largest the model splits into
    (`Qwen35Config.check_tp_degree`) within the machine's `cores` Neuron cores. optimum-neuron takes all the cores,
    which is no valid degree for any Qwen3.5 size on trn2.48xlarge (64), trn1.32xlarge (32) or inf2.48xlarge (24)."""
    if cores < 1:  # optimum-neuron counts this machine's cores: none without a device
        sdk = "" if _neuron_sdk_available() else " (nor the Neuron SDK)"
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


def _available_neuron_cores() -> int:
    return get_available_cores()


registration.register_model_class(Qwen35NeuronModelForCausalLM)
