"""Checkpoint tensors -> what each Neuron rank loads, in `checkpoint/shard.py`'s layout (no Neuron SDK needed).

optimum-neuron 0.4.5 loads weights as `get_state_dict` (every safetensors tensor, `_STATE_DICT_MODEL_PREFIX`
stripped) -> `convert_hf_to_neuron_state_dict(state_dict, config, neuron_config)` -> one whole state dict, which
neuronx-distributed then splits per rank (`trace.py` `shard_children`). That splitter only splits the parameters
of its own parallel layers (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding, SPMDRank...): a plain
`nn.Parameter` such as the DeltaNet `A_log`, `dt_bias` or `conv_weight` would reach every rank whole, although
each rank holds only its heads. So this backend keeps optimum-neuron's conversion hook but does the split itself:

- `convert_hf_to_neuron_state_dict` returns each decoder tensor in its *TP layout* (`shard.tp_layout`: DeltaNet
  q/k/v rows and conv channels regrouped per rank, KV heads repeated when t > KV heads, MLP and vocabulary
  zero-padded), where rank r's shard is block r of t equal blocks along `shard.shard_dim` -- the contract of
  neuronx-distributed's parallel layers, so the layout is also what its splitter would expect of them -- plus
  the rank tensor `embed_tokens.rank_util.rank` = arange(t) (the vocabulary-parallel embedding's rank, a tensor so
  that one graph serves every rank);
- `rank_state_dict` cuts rank r's tensors out of it, every tensor (A_log, dt_bias and conv_weight with their value
  heads, as the CPU runtime's `convert_and_shard` does) -- the same tensors `sharded_files.save_sharded` writes;
- MoE blocks: the routed experts are neuronx-distributed's `Experts` in the traced module (neuron/layers.py), which
  holds them transposed under `.weight`: `mlp.experts.gate_up_proj` [E_r, 2 I_r, H] -> `mlp.experts.gate_up_proj.weight`
  [E_r, H, 2 I_r] (each expert's gate columns, then its up columns: the order NxD's GLU chunks them in) and
  `mlp.experts.down_proj` [E_r, H, I_r] -> `mlp.experts.down_proj.weight` [E_r, I_r, H], done per rank after the
  split (`nxd_expert_tensors`); the router, the shared expert and its gate keep their names;
- tied embeddings: the traced module has its own lm_head weight (as optimum-neuron's tied models do), filled
  from the embedding by `tie_lm_head` (optimum-neuron's `update_state_dict_for_tied_weights`).
"""

from __future__ import annotations

import torch

from optimum_qwen35.checkpoint.convert import (
    check_checkpoint,
    convert_tensor,
    decoder_name,
    expected_shapes,
    stored_dtype,
)
from optimum_qwen35.checkpoint import fp8
from optimum_qwen35.checkpoint.experts import fuse, fuse_expert_names
from optimum_qwen35.checkpoint.reader import CheckpointReader, text_name
from optimum_qwen35.checkpoint.shard import convert_and_shard_mtp, shard_dim, tp_layout
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.export import layout
from optimum_qwen35.modeling.vision import VisionConfig, shard_vision_params
from optimum_qwen35.runtime.images import load_vision_encoder

# The rank tensor of the vocabulary-parallel embedding (neuronx-distributed's SPMDRank inside ParallelEmbedding).
RANK_KEY = "embed_tokens.rank_util.rank"
# The prefix optimum-neuron strips from checkpoint keys before the conversion (Qwen's vision-language checkpoints).
STATE_DICT_MODEL_PREFIX = "model.language_model."


def qwen_config(config) -> Qwen35Config:
    """A Qwen35Config from a transformers config (text or composite), a dict, or a Qwen35Config."""
    if isinstance(config, Qwen35Config):
        return config
    if isinstance(config, dict):
        return Qwen35Config.from_dict(config)
    return Qwen35Config.from_dict(config.to_dict())


class _Tensors:
    """A dict of tensors seen as a checkpoint, for `convert.check_checkpoint`'s one-line-per-problem error."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        self.tensors, self.folder = tensors, where

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)


def text_tensors(state_dict: dict[str, torch.Tensor], config: Qwen35Config) -> dict[str, torch.Tensor]:
    """The text decoder's tensors by checkpoint-relative name (`layers.0.linear_attn.conv1d.weight`), from keys
    with or without optimum-neuron's prefix strip; the vision tower and the MTP head are left out; MoE experts in
    either on-disk form, given fused (checkpoint/experts.py)."""
    expected = expected_shapes(config)
    # MoE experts stored per expert (the published checkpoints' form) are stacked into the fused tensors first.
    fused = fuse_expert_names(list(state_dict))
    if fused:
        state_dict = dict(state_dict)
        for name, parts in fused.items():
            state_dict[name] = fuse(name, [state_dict.pop(part) for part in parts])
    out = {}
    for key, tensor in state_dict.items():
        name = key if key in expected else text_name(key)
        if name is None and key.startswith("language_model."):  # optimum-neuron's default "model." strip
            name = key[len("language_model.") :]
        if name is not None:
            out[name] = tensor
    return out


def convert_hf_to_neuron_state_dict(state_dict: dict[str, torch.Tensor], config, neuron_config) -> dict[str, torch.Tensor]:
    """optimum-neuron's conversion hook: checkpoint tensors -> decoder names, each in its TP layout, plus the rank
    tensor. Raises `CheckpointError` listing every missing, unexpected or wrongly shaped text tensor."""
    cfg = qwen_config(config)
    t = neuron_config.tp_degree
    cfg.check_tp_degree(t)
    text = text_tensors(dequantized(state_dict), cfg)
    if cfg.tie_word_embeddings:
        text.pop("lm_head.weight", None)  # some exports write the tied copy; it is the embedding
    check_checkpoint(_Tensors(text, "(the state dict given to convert_hf_to_neuron_state_dict)"), cfg)
    out = {}
    for name in expected_shapes(cfg):
        layout, _ = tp_layout(decoder_name(name), convert_tensor(name, text[name]), cfg, t)
        out[decoder_name(name)] = layout
    out[RANK_KEY] = torch.arange(t, dtype=torch.int32)
    return out


def dequantized(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors as optimum-neuron reads them (every tensor as stored) with each float8 weight
    multiplied by its `weight_scale_inv` (float32; cast to the model dtype with the rest), the scales dropped: way
    (a) of docs/fp8.md. An export with FP8 weights kept reads the checkpoint itself (backends/nxd/fp8.py)."""
    scales = {k for k in state_dict if k.endswith(fp8.SCALE_SUFFIX) and k[: -len(fp8.SCALE_SUFFIX)] in state_dict}
    if not scales:
        return state_dict
    out = {k: v for k, v in state_dict.items() if k not in scales}
    for scale in scales:
        name = scale[: -len(fp8.SCALE_SUFFIX)]
        out[name] = fp8.dequantize(state_dict[name], state_dict[scale])
    return out


def tie_lm_head(state_dict: dict[str, torch.Tensor]) -> None:
    """optimum-neuron's `update_state_dict_for_tied_weights`: the lm_head reads the embedding's rows (both are
    split by vocabulary, in the same layout)."""
    state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"]


def rank_state_dict(
    neuron_state_dict: dict[str, torch.Tensor], tp_degree: int, rank: int, dtype: torch.dtype | None = None,
    config=None,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors (owned, contiguous) from `convert_hf_to_neuron_state_dict`'s output; floating tensors
    cast to `dtype` (the model dtype; the DeltaNet gate parameters fp32, the precision policy), the rank tensor
    kept int32. `config` (a MoE model's: how its experts split depends on it) as `convert_hf_to_neuron_state_dict`
    takes it."""
    if not 0 <= rank < tp_degree:
        raise ValueError(f"rank {rank} is outside 0..{tp_degree - 1}")
    cfg = qwen_config(config) if config is not None else None
    out = {}
    for name, tensor in neuron_state_dict.items():
        if name == RANK_KEY:
            out[name] = tensor[rank : rank + 1].clone()
            continue
        dim = shard_dim(name, cfg, tp_degree)
        shard = tensor if dim is None else tensor.chunk(tp_degree, dim)[rank]
        cast = stored_dtype(name, dtype) if dtype is not None and shard.is_floating_point() else shard.dtype
        # A copy, so that a rank's tensors do not keep the whole layout alive.
        out[name] = shard.to(dtype=cast, memory_format=torch.contiguous_format, copy=True)
    return nxd_expert_tensors(out)


# The fused expert tensors of the MoE block: this project's name -> neuronx-distributed `Experts`' (transposed 1, 2).
NXD_EXPERT_NAMES = {"mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj.weight",
                    "mlp.experts.down_proj": "mlp.experts.down_proj.weight"}


def is_nxd_expert(name: str) -> bool:
    return name.endswith(tuple(NXD_EXPERT_NAMES))


def nxd_name(name: str) -> str:
    """A decoder tensor's name in the NxD traced module (the MoE experts are neuronx-distributed's `Experts`)."""
    suffix = next((s for s in NXD_EXPERT_NAMES if name.endswith(s)), None)
    return name if suffix is None else name[: -len(suffix)] + NXD_EXPERT_NAMES[suffix]


def nxd_expert_tensors(rank_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's tensors with the MoE experts as neuronx-distributed's `Experts` holds them (module docstring);
    a dense model's are returned as they are."""
    return {nxd_name(name): tensor.transpose(1, 2).contiguous() if is_nxd_expert(name) else tensor
            for name, tensor in rank_tensors.items()}


# ------------------------------------------------------------------------------------- vision exports
# Where a vision export's config (the text config the NxD class is built with) carries the vision tower's config and
# image buckets: `{"config": VisionConfig fields, "image_buckets": [...]}`, saved in the export's config.json.
VISION_EXPORT_KEY = layout.VISION_EXPORT_KEY
VISION_PREFIX = "visual."


def vision_export(config):
    """(VisionConfig, image buckets) of a vision export's config, None for a text-only one."""
    entry = getattr(config, VISION_EXPORT_KEY, None)
    if not entry:
        return None
    return VisionConfig(**entry["config"]), list(entry["image_buckets"])


def vision_rank_state_dict(checkpoint_path, vision, tp_degree: int, rank: int, dtype) -> dict[str, torch.Tensor]:
    """Rank `rank`'s vision tower tensors (`Qwen35NxDVisionModel`'s names: `visual.` + the tower's), read from the
    checkpoint and split by heads (`modeling.vision.shard_vision_params`)."""
    tower = load_vision_encoder(checkpoint_path, vision, dtype).state_dict()
    return {VISION_PREFIX + k: v.contiguous() for k, v in shard_vision_params(tower, tp_degree, rank).items()}


# ------------------------------------------------------------------------------------- exports made with mtp=True
def mtp_export(config) -> int:
    """The most drafts per round of an export made with mtp=True (its speculative graphs verify that many + 1
    positions), 0 for one without the MTP head."""
    entry = getattr(config, layout.MTP_EXPORT_KEY, None)
    return int(entry["max_speculative_tokens"]) if entry else 0


def mtp_rank_state_dict(checkpoint_path, config, tp_degree: int, rank: int, dtype) -> dict[str, torch.Tensor]:
    """Rank `rank`'s multi-token-prediction head tensors (decoder names `mtp.*`), read from the checkpoint and
    sharded as the CPU runtime shards them (`convert_and_shard_mtp`), MoE experts in neuronx-distributed's form."""
    cfg = qwen_config(config)
    reader = CheckpointReader(checkpoint_path, mtp=True)
    return nxd_expert_tensors(dict(convert_and_shard_mtp(reader, cfg, tp_degree, rank, dtype)))
