"""FP8 weights in the NxD export's graphs (issue 49, way (b); docs/fp8.md): which weights, their shapes, each rank's
tensors. No Neuron SDK needed.

An export made with `weights_dtype="fp8"` names its float8 weights in its config (`layout.FP8_EXPORT_KEY`): an FP8
checkpoint's (those stored with a scale), or a bf16 one's by Qwen's rule (`checkpoint.quantize`), which the loads
quantize as they split it (`QuantizingReader`: the same bytes as `quantize_checkpoint`, and nothing written). The
traced module holds each as a float8 parameter with its expanded float32 scale and dequantizes beside the matmul
(`modeling.fp8.hold_fp8_weights`, a parametrization: `X.parametrizations.weight.original` and `.0.scale` in the
module's state dict), so optimum-neuron's load-time cast, which skips float8, leaves the weights alone
(`restore_fp8_scales` gives the scales back their float32).

The Neuron targets of this backend (trn1, inf2, trn2) compute FP8 E4M3 as float8_e4m3 (max 240, the top exponent
for inf / NaN), not Qwen's float8_e4m3fn (max 448): neuronx-cc refuses an F8E4M3FN operand there unless told to read
it as F8E4M3 (NCC_EVRF051, `--experimental-unsafe-fp8e4m3fn-as-fp8e4m3`). Both formats give the same value to every
bit pattern up to 240, so each rank's float8 weights are first brought within 240 (`fp8.fit_e4m3_range`: a run of
128 values sharing a scale halved, the scale doubled) and the flag is then exact (`adapter.FP8_COMPILER_FLAG`, which
an FP8 export's graphs compile with).
"""

from __future__ import annotations

import math
import os

import torch

from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.checkpoint.convert import decoder_name, expected_shapes
from optimum_qwen35.checkpoint.fp8 import BLOCK
from optimum_qwen35.checkpoint.fp8_shard import SCALE_SUFFIX, fp8_rank_tensors
from optimum_qwen35.checkpoint.quantize import LM_HEAD, QuantizingReader, is_quantized, untied
from optimum_qwen35.checkpoint.reader import CheckpointReader
from optimum_qwen35.checkpoint.shard import shard_dim
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import CheckpointError
from optimum_qwen35.export import layout
from optimum_qwen35.modeling.fp8 import hold_fp8_weights

nxd_name, is_nxd_expert = weights.nxd_name, weights.is_nxd_expert  # (the traced module's names: state_dict.py)


def checkpoint_reader(checkpoint_path: str | os.PathLike, lm_head: bool = False) -> CheckpointReader:
    """The reader of an FP8 export's weights: an FP8 checkpoint as stored, a bf16 / fp32 one quantized as read;
    `lm_head` (`fp8_lm_head`): lm_head quantized as read too."""
    reader = CheckpointReader(checkpoint_path)
    if reader.fp8_block is not None and (not lm_head or (LM_HEAD in reader and reader.is_fp8(LM_HEAD))):
        return reader
    return QuantizingReader(checkpoint_path, lm_head=lm_head)


def fp8_weight_names(checkpoint_path: str | os.PathLike, config: Qwen35Config, lm_head: bool = False) -> list[str]:
    """The decoder weights an export with FP8 weights holds as float8 (decoder names, sorted); with `lm_head`,
    `config` read untied (`export_fp8_weight_names`)."""
    reader = checkpoint_reader(checkpoint_path, lm_head)
    return sorted(decoder_name(n) for n in expected_shapes(config) if reader.is_fp8(n))


def export_fp8_weight_names(checkpoint_path: str | os.PathLike, lm_head: bool = False) -> list[str]:
    """What an export of this checkpoint with FP8 weights names in its config (`fp8_lm_head` = `lm_head`: lm_head
    too, as its own weight: the checkpoint's config read untied)."""
    config = Qwen35Config.from_pretrained(checkpoint_path)
    if lm_head:
        config = Qwen35Config.from_dict(untied(config.raw))
    return fp8_weight_names(checkpoint_path, config, lm_head)


def rule_weight_names(config: Qwen35Config, lm_head: bool = False) -> list[str]:
    """The decoder weights Qwen's FP8 releases store as float8 (`quantize.is_quantized`; `lm_head`: and lm_head, of
    an untied `config`), from the config alone: what `fp8_weight_names` gives for a bf16 checkpoint (the benchmarks'
    shape-only graphs have no weights to read)."""
    def key(name: str) -> str:  # the checkpoint's key (lm_head is outside the language model's prefix)
        return name if name == LM_HEAD else weights.STATE_DICT_MODEL_PREFIX + name

    return sorted(decoder_name(n) for n, s in expected_shapes(config).items() if is_quantized(key(n), len(s), lm_head))


def fp8_export(config) -> list[str]:
    """The float8 weights an export's config names (decoder names), [] for an export without FP8 weights."""
    entry = getattr(config, layout.FP8_EXPORT_KEY, None)
    return list(entry["weights"]) if entry else []


def scale_shape(name: str, shard_shape: tuple[int, ...], config: Qwen35Config, tp_degree: int) -> tuple[int, ...]:
    """The expanded scale's shape of float8 weight `name` (a decoder name) whose shard in the NxD module is
    `shard_shape`: one scale per 128 columns of a row where the weight is split by rows or not at all, per 128 rows of
    a column where it is split by columns (`fp8_shard.convert_and_shard_fp8`); the experts' transposed as their
    weights are."""
    shape = list(shard_shape)
    if is_nxd_expert(name):
        shape[-1], shape[-2] = shape[-2], shape[-1]
    rows, cols = shape[-2:]
    if shard_dim(name, config, tp_degree) == len(shape) - 1:
        scale = [*shape[:-2], math.ceil(rows / BLOCK[0]), cols]
    else:
        scale = [*shape[:-2], rows, math.ceil(cols / BLOCK[1])]
    if is_nxd_expert(name):
        scale[-1], scale[-2] = scale[-2], scale[-1]
    return tuple(scale)


def parametrized_name(name: str) -> str:
    """A float8 weight's (or its `_scale`'s) name in the traced module's state dict, where `modeling.fp8` holds it:
    `P.weight` -> `P.parametrizations.weight.original`, `P.weight_scale` -> `P.parametrizations.weight.0.scale`."""
    if name.endswith(SCALE_SUFFIX):
        path, attr = name[: -len(SCALE_SUFFIX)].rsplit(".", 1)
        return f"{path}.parametrizations.{attr}.0.scale"
    path, attr = name.rsplit(".", 1)
    return f"{path}.parametrizations.{attr}.original"


def fp8_rank_state_dict(checkpoint_path, config, tp_degree: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank `rank`'s decoder tensors of an export with FP8 weights, by the traced module's names: the float8 shards and
    their expanded scales within float8_e4m3's range, every other tensor as `state_dict.rank_state_dict` gives it."""
    cfg = weights.qwen_config(config)
    names = set(fp8_export(config))
    reader = checkpoint_reader(checkpoint_path, lm_head=LM_HEAD in names)
    tensors = fp8_rank_tensors(reader, cfg, tp_degree, rank, dtype, e4m3_range=True)
    held = sorted(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    if set(held) != names:
        raise CheckpointError(
            f"{checkpoint_path}: its FP8 weights are not the ones this export was compiled with ({len(held)} against "
            f"{len(names)}; first differing: {sorted(set(held) ^ names)[:3]}): export it again from this checkpoint"
        )
    if cfg.tie_word_embeddings:
        weights.tie_lm_head(tensors)
    tensors[weights.RANK_KEY] = torch.tensor([rank], dtype=torch.int32)
    out = {}
    for name, tensor in tensors.items():
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if is_nxd_expert(base):
            tensor = tensor.transpose(1, 2).contiguous()
        if base in names:
            out[parametrized_name(nxd_name(base) + name[len(base):])] = tensor
        else:
            out[nxd_name(name)] = tensor
    return out


def hold_weights(module: torch.nn.Module, names: list[str], config: Qwen35Config, tp_degree: int,
                 dtype: torch.dtype) -> None:
    """Make each weight of `names` (decoder names) of the traced module a float8 parameter with its float32 scale,
    dequantized beside its matmul (placeholders: the runtime loads each rank's tensors). The parallel layers'
    attributes on the weight (`tensor_model_parallel`, `partition_dim`, ...: what neuronx-distributed's sharding
    reads) move to the float8 parameter."""
    params, attributes = {}, {}
    for name in names:
        nxd = nxd_name(name)
        old = module.get_parameter(nxd)
        params[nxd] = torch.zeros(old.shape, dtype=torch.float8_e4m3fn)
        params[nxd + SCALE_SUFFIX] = torch.ones(scale_shape(name, tuple(old.shape), config, tp_degree))
        attributes[nxd] = dict(vars(old))
    hold_fp8_weights(module, params, dtype)
    for nxd, attrs in attributes.items():
        original = module.get_parameter(parametrized_name(nxd))
        for key, value in attrs.items():
            setattr(original, key, value)


def restore_fp8_scales(module: torch.nn.Module) -> None:
    """The float8 weights' scales back to float32 after optimum-neuron's load-time cast to the model dtype (which
    skips float8 tensors but not their float32 scales), in place."""
    for name, buffer in module.named_buffers():
        if name.endswith(".0.scale") and ".parametrizations." in name and buffer.dtype != torch.float32:
            buffer.data = buffer.data.float()
