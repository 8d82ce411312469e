"""The cpu target's export: a source checkpoint in, a complete export folder out (export/layout.py's format).

    source checkpoint --save_sharded--> checkpoint/ (each rank's weights)     checkpoint/shard.py
                      --compile_graphs--> compiled/ (one program per graph)  export/compile.py, or the compile cache
                      + config.json (the text config), neuron_config.json, tokenizer and processor files

Everything is written into a fresh work folder that the caller owns (the model class removes it with the model);
`save_export` copies it to where the user asked, atomically.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from optimum_qwen35.checkpoint.quantize import needs_quantizing, quantize_checkpoint
from optimum_qwen35.checkpoint.sharded_files import read_manifest, save_mtp_weights, save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import ExportError, HubError, IncompatibleExportError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.export.compile import check_draft_vocab, compile_graphs, fp8_weight_shapes, save_vision_weights
from optimum_qwen35.export.writer import copy_side_files, write_failure
from optimum_qwen35.hub.cache import fetch_cached_graphs
from optimum_qwen35.modeling.vision import VisionConfig
from optimum_qwen35.neuron_model import neuron_config as nc
from optimum_qwen35.processing import copy_processor_files
from optimum_qwen35.runtime.buckets import default_buckets, default_key_buckets
from optimum_qwen35.runtime.draft_vocab import DRAFT_VOCAB_FILE, draft_ids, load_ranking, rank_by_merges
from optimum_qwen35.runtime.exported import read_graphs_manifest
from optimum_qwen35.runtime.images import DEFAULT_IMAGE_BUCKETS
from optimum_qwen35.runtime.prefix_cache import export_block_size

logger = logging.getLogger(__name__)

# Context buckets of a cpu export start here: each bucket is one more program to export and load.
SMALLEST_EXPORT_BUCKET = 128


def export_token_buckets(sequence_length: int, backend: str) -> list[int] | None:
    """The token-generation (decode cache) buckets an export lists; None: the context buckets.

    A TorchNeuron export lists the midpoints too (`default_key_buckets`: 128, 192, 256, 384, ...), so a decode step
    reads the K/V of at most 1.5x the positions it needs, not 2x; TorchNeuron compiles each graph on its first use,
    so a listed bucket no prompt reaches costs nothing. A cpu export keeps the context buckets: each is one more
    program exported (and loaded) up front."""
    if backend == layout.TORCHNEURON_BACKEND:
        return default_key_buckets(sequence_length, smallest=SMALLEST_EXPORT_BUCKET)
    return None


def export_config(config, model_id, dtype, vision=None, max_speculative_tokens: int = 0, fp8_weights=None,
                  fp8_lm_head: bool = False):
    """The text config as saved next to the export: it names its source and the compiled dtype; `vision`:
    (VisionConfig, image buckets) of a vision export on a Neuron target, which the NxD class reads from it;
    `max_speculative_tokens` > 0: an NxD export made with mtp=True (the NxD class builds the speculative graphs);
    `fp8_weights`: the decoder weights an NxD export with FP8 weights holds as float8 (backends/nxd/fp8.py);
    `fp8_lm_head`: an export whose lm_head is float8, its own weight even where the checkpoint ties it (untied)."""
    config = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    if fp8_lm_head:
        config.tie_word_embeddings = False
    # optimum-neuron 0.4.5 takes the checkpoint from `_name_or_path`, which is empty on a nested config's text part.
    config._name_or_path = os.fspath(model_id)
    config.dtype = dtype
    # What vLLM resolves first (it refuses a config.json naming no architecture): the text model's class name,
    # which this package registers with vLLM (serving/vllm_plugin.py).
    config.architectures = [layout.EXPORT_ARCHITECTURES[config.model_type]]
    if vision is not None:
        tower, image_buckets = vision
        setattr(config, layout.VISION_EXPORT_KEY, {"config": dataclasses.asdict(tower), "image_buckets": list(image_buckets)})
    if max_speculative_tokens:
        setattr(config, layout.MTP_EXPORT_KEY, {"max_speculative_tokens": max_speculative_tokens})
    if fp8_weights:
        setattr(config, layout.FP8_EXPORT_KEY, {"weights": list(fp8_weights)})
    return config


def check_image_buckets(image_buckets, vision: VisionConfig) -> list[int]:
    if isinstance(image_buckets, (str, bytes, int)) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 and b % vision.merge_unit == 0 for b in image_buckets
    ):
        raise UsageError(f"image_buckets must be a list of patch counts, multiples of {vision.merge_unit}, got {image_buckets!r}")
    return sorted(set(image_buckets))


def vision_export_config(qwen_config: Qwen35Config, tp_degree: int, source) -> VisionConfig:
    """The vision tower's config for `export(..., vision=True)` on the cpu target: a one-line error when the export
    cannot have one."""
    vision = VisionConfig.from_dict(qwen_config.raw)
    if vision is None:
        raise UsageError(f"vision=True, but {source} has no vision tower (a text-only config.json): export it without vision")
    if tp_degree != 1:
        raise UsageError(
            f"vision=True needs tensor_parallel_size=1 on the cpu target (got {tp_degree}): the vision graphs are not "
            "sharded yet"
        )
    return vision


def mtp_export_check(qwen_config: Qwen35Config, source) -> None:
    """`export(..., mtp=True)`: a one-line error when the checkpoint has no MTP head to export."""
    if qwen_config.mtp_num_hidden_layers < 1:
        raise UsageError(f"mtp=True, but {source} has no multi-token-prediction head (mtp_num_hidden_layers): export it without mtp")


WEIGHTS_DTYPES = ("fp8",)


def check_weights_dtype(weights_dtype, fp8_lm_head: bool = False) -> None:
    """`export(..., weights_dtype=...)`: None (the export dtype) or "fp8" (Qwen's block-FP8 weights kept as float8),
    every backend, `fp8_lm_head` with "fp8" only; one line otherwise."""
    if fp8_lm_head is not True and fp8_lm_head is not False:
        raise UsageError(f"fp8_lm_head must be True or False, got {fp8_lm_head!r}")
    if fp8_lm_head and weights_dtype != "fp8":
        raise UsageError("fp8_lm_head=True quantizes lm_head with the other FP8 weights: pass weights_dtype='fp8' with it")
    if weights_dtype is None:
        return
    if weights_dtype not in WEIGHTS_DTYPES:
        raise UsageError(f"weights_dtype {weights_dtype!r} is not supported: 'fp8' (FP8 weights, Qwen's 128x128 block format) or None (the export dtype)")


def export_cpu(source: Path, config, neuron_config, model_id, vision: bool = False, image_buckets=None,
               backend: str = layout.CPU_BACKEND, mtp: bool = False, weights_dtype: str | None = None,
               draft_vocab_size: int | None = None, fp8_lm_head: bool = False) -> Path:
    """Export the checkpoint folder `source` for the cpu target into a new work folder (returned; the caller owns
    it). `config` is the transformers text config, `neuron_config` optimum-neuron's NxDNeuronConfig (target "cpu").
    With `vision`, the vision tower's programs too, one per image bucket.

    `backend="torchneuron"` (a trn2 `neuron_config`): the same folder for TorchNeuron, which needs no SDK to make:
    the weights split per rank, the configs, and a graphs.json listing the graphs (buckets, key lengths) that
    TorchNeuron compiles on the first load on a device.

    `mtp`: also the multi-token-prediction head's weights (checkpoint/mtp.safetensors, one mtp_rank_<r> file per rank at
    tensor_parallel_size > 1) and
    the speculative-decoding graphs (export/compile.py `speculative_plan`; graphs.json "mtp").

    `weights_dtype="fp8"`: the text decoder's linear weights as float8 with their block scales (docs/fp8.md), those
    of an FP8 checkpoint as they are, a bf16 / fp32 checkpoint's quantized first to Qwen's block-FP8 format
    (checkpoint/quantize.py, in a scratch folder); the graphs dequantize each beside its matmul. The MTP head and the
    vision tower are stored dequantized in the export dtype. Without it an FP8 checkpoint is dequantized at export.
    `fp8_lm_head` (with it): lm_head too, untied from the embedding (`quantize_checkpoint(lm_head=True)`).

    `draft_vocab_size` (with `mtp`): the head drafts over that many token ids, the first of the checkpoint's ranking
    (`export_draft_ids`); verification keeps the whole vocabulary (docs/speculative_decoding.md, "Draft vocabulary")."""
    check_weights_dtype(weights_dtype, fp8_lm_head)
    qwen_config = Qwen35Config.from_pretrained(source)
    qwen_config.check_tp_degree(neuron_config.tp_degree)
    dtype = neuron_config.torch_dtype
    if mtp:
        mtp_export_check(qwen_config, source)
    draft = export_draft_ids(source, qwen_config, draft_vocab_size, mtp)
    if draft is not None:
        check_draft_vocab(neuron_config.tp_degree, backend, weights_dtype == "fp8")
    vision_config = vision_export_config(qwen_config, neuron_config.tp_degree, source) if vision else None
    if vision:
        image_buckets = check_image_buckets(image_buckets or DEFAULT_IMAGE_BUCKETS, vision_config)
    work = Path(tempfile.mkdtemp(prefix="qwen35-export-"))
    scratch = None
    try:
        weights_source, fp8_shapes = source, None
        if weights_dtype == "fp8" and needs_quantizing(json.loads((Path(source) / "config.json").read_text()), fp8_lm_head):
            scratch = Path(tempfile.mkdtemp(prefix="qwen35-fp8-"))
            weights_source = quantize_checkpoint(source, scratch / "fp8", lm_head=fp8_lm_head)
        if fp8_lm_head:  # its lm_head is its own weight now (quantize_checkpoint unties it)
            qwen_config = Qwen35Config.from_pretrained(weights_source)
        # TorchNeuron's target, trn2, computes FP8 E4M3 as float8_e4m3 (max 240): the weights fitted to it (docs/fp8.md).
        save_sharded(weights_source, qwen_config, neuron_config.tp_degree, work / layout.CHECKPOINT_DIR, dtype,
                     weights_dtype=weights_dtype, e4m3_range=backend == layout.TORCHNEURON_BACKEND)
        if weights_dtype == "fp8":
            fp8_shapes = fp8_weight_shapes(work / layout.CHECKPOINT_DIR / layout.rank_file(0))
        copy_side_files(source, work)
        if vision:
            save_vision_weights(source, vision_config, dtype, work / layout.CHECKPOINT_DIR)
            copy_processor_files(source, work)
        if mtp:
            save_mtp_weights(source, qwen_config, dtype, work / layout.CHECKPOINT_DIR, neuron_config.tp_degree)
        export_config(config, model_id, dtype, fp8_lm_head=fp8_lm_head).save_pretrained(work)
        nc.save(neuron_config, work, backend)
        if backend != layout.CPU_BACKEND or vision or mtp or weights_dtype or not graphs_from_cache(work):  # (cached: cpu text graphs only)
            buckets = default_buckets(neuron_config.sequence_length, smallest=SMALLEST_EXPORT_BUCKET)
            compile_graphs(
                qwen_config, neuron_config.tp_degree, neuron_config.batch_size, neuron_config.sequence_length,
                buckets, dtype, work / layout.COMPILED_DIR, vision=vision_config, image_buckets=image_buckets,
                prefix_block_size=export_block_size(neuron_config.sequence_length), backend=backend, mtp=mtp,
                fp8_shapes=fp8_shapes, token_buckets=export_token_buckets(neuron_config.sequence_length, backend),
                draft_ids=draft,
            )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return work


def export_draft_ids(source: Path, qwen_config: Qwen35Config, size: int | None, mtp: bool) -> list[int] | None:
    """The first `size` token ids of the checkpoint's draft-vocabulary ranking: its draft_vocab.json
    (runtime/draft_vocab.py `save_ranking`, from a corpus), else the order of its tokenizer's BPE merges
    (`rank_by_merges`). None: the whole vocabulary (no size, or a size of at least the vocabulary)."""
    if size is None:
        return None
    if not mtp:
        raise UsageError("draft_vocab_size is the MTP head's draft vocabulary: pass mtp=True (--mtp) with it")
    if isinstance(size, bool) or not isinstance(size, int):
        raise UsageError(f"draft_vocab_size must be a whole number of token ids, got {size!r}")
    ranked = Path(source) / DRAFT_VOCAB_FILE
    if ranked.is_file():
        ranking = load_ranking(source)
    elif (Path(source) / "tokenizer.json").is_file():
        ranking = rank_by_merges(Path(source) / "tokenizer.json", qwen_config.vocab_size)
    else:
        raise UsageError(f"{source} has neither {DRAFT_VOCAB_FILE} nor tokenizer.json to rank a draft vocabulary from: "
                         "write one (runtime/draft_vocab.py save_ranking) or export without draft_vocab_size")
    ids = draft_ids(ranking, size, qwen_config.vocab_size)
    return None if ids is None else ids.tolist()


def graphs_from_cache(folder: Path) -> bool:
    """The compiled graphs of this configuration from the compile-cache repo (as optimum-neuron takes NEFFs
    from its cache), for an export of a Hub model; False (compile) on a miss, offline, or any Hub error."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if nc.optimum_neuron_version() is None:  # the registry is optimum-neuron's (the NxD stack): compile here
        return False
    try:
        found = fetch_cached_graphs(folder)
    except (HubError, IncompatibleExportError, UsageError) as error:
        logger.warning("compile cache not used (%s): compiling", error)
        return False
    if found:
        logger.warning("compiled graphs of this configuration found in the compile cache: not compiling")
    return found


def check_cpu_export(folder: Path, neuron_config) -> None:
    """The compiled graphs and the weights must be the ones neuron_config.json describes (a cpu or TorchNeuron
    export: the same two folders)."""
    graphs = read_graphs_manifest(folder)
    for key, value in (("tp_degree", neuron_config.tp_degree), ("batch_size", neuron_config.batch_size), ("max_length", neuron_config.sequence_length)):
        if graphs[key] != value:
            raise IncompatibleExportError(
                f"{folder}: compiled/ was built for {key}={graphs[key]} but neuron_config.json says {value}: "
                "the folder mixes two exports; export the model again"
            )
    if graphs["dtype"] != str(neuron_config.torch_dtype).removeprefix("torch."):
        raise IncompatibleExportError(f"{folder}: compiled/ is {graphs['dtype']} but neuron_config.json says {neuron_config.torch_dtype}; export again")
    # A cpu export's programs load only with the torch that exported them; TorchNeuron compiles from the model code.
    if graphs.get("backend", layout.CPU_BACKEND) == layout.CPU_BACKEND and graphs["torch_version"] != torch.__version__.split("+")[0]:
        raise IncompatibleExportError(
            f"{folder} was compiled with torch {graphs['torch_version']}, but {torch.__version__} is installed: "
            f"install torch=={graphs['torch_version']} or export the model again"
        )
    shards = read_manifest(folder / layout.CHECKPOINT_DIR)
    if shards["tp_degree"] != neuron_config.tp_degree:
        raise IncompatibleExportError(
            f"{folder}: checkpoint/ holds weights for tensor_parallel_size={shards['tp_degree']}, the graphs for "
            f"{neuron_config.tp_degree}: export the model again"
        )


def check_save_directory(save_directory, overwrite: bool = False, source=None) -> None:
    """Whether an export may be saved to `save_directory` (what `save_export` checks, and the command line before
    anything is compiled): not a file, not the source checkpoint, empty unless `overwrite`, and never a folder
    holding a model checkpoint."""
    target = Path(save_directory).absolute()
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} is a file: choose a folder to save the model to")
    if source is not None and Path(source).is_dir() and Path(source).absolute() == target:
        raise ExportError(f"{target} is the source checkpoint: choose another folder for the export")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            what = "an exported model" if layout.is_export(target) else "other files"
            raise ExportError(f"{target} already holds {what}: choose an empty folder, or pass overwrite=True (--overwrite) to replace it")
        if (target / "model.safetensors.index.json").exists() or any(target.glob("model*.safetensors")):
            raise ExportError(f"{target} holds a model checkpoint: it is never overwritten by an export; choose another folder")


def _copy_tree(source: Path, target: Path) -> None:
    """Hard links where the file system allows (a cpu export is mostly weights), copies elsewhere."""

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link_or_copy)


def save_export(folder: Path, save_directory, overwrite: bool = False) -> Path:
    """Write the export `folder` to `save_directory` atomically (staged in a hidden sibling, then renamed). An existing
    non-empty folder is refused unless `overwrite=True`, and then replaced whole."""
    target = Path(save_directory).absolute()
    if target == Path(folder).absolute():
        return target
    check_save_directory(target, overwrite)
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_tree(Path(folder), staging)
        if target.exists():
            trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, trash)
            os.replace(staging, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, target)
    except OSError as error:  # a full or read-only disk, no permission: nothing of the export is left there
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(write_failure(target, error)) from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
