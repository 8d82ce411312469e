"""FP8 weights kept as float8: each rank's shard of a block-FP8 checkpoint's float8 weights, with their scales.

A tensor-parallel split does not follow the 128 x 128 blocks (a 192-row weight at TP 2 cuts a block in two; the
DeltaNet qkv rows are permuted, the MLP's padded), so each scale is first repeated along the dimension the weight is
split on (`fp8.expand_along`: [rows, ceil(cols / 128)] for a row split, [ceil(rows / 128), cols] for a column split)
and then split, permuted and padded exactly as its weight (checkpoint/shard.py). Every element keeps its own block's
scale; the scales cost 4 bytes per 128 weights (3% of the float8 bytes). The float8 bytes are moved as uint8
(CPU float8 tensors lack some of the index ops sharding uses); padding is 0x00, +0.0 in e4m3.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..config import Qwen35Config
from .convert import check_checkpoint, convert_tensor, decoder_name, expected_shapes, stored_dtype
from .fp8 import FP8_DTYPE, fit_e4m3_range
from .reader import CheckpointReader
from .shard import shard_dim, shard_tensor

SCALE_SUFFIX = "_scale"  # decoder parameter `X.weight` (float8) -> `X.weight_scale` (float32, expanded form)


def convert_and_shard_fp8(
    reader: CheckpointReader, config: Qwen35Config, tp_degree: int, rank: int, dtype: torch.dtype | None = None,
    e4m3_range: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (decoder name, this rank's shard), as `shard.convert_and_shard`, but the float8 weights as float8 with
    (name + "_scale", their expanded scale shard) beside them; every other tensor as there, in `dtype`.
    `e4m3_range`: each float8 shard within float8_e4m3's range (`fp8.fit_e4m3_range`: the Neuron targets)."""
    config.check_tp_degree(tp_degree)
    check_checkpoint(reader, config)
    for source in expected_shapes(config):
        name = decoder_name(source)
        if reader.is_fp8(source):
            q = reader.get(source, raw=True)
            along = "cols" if shard_dim(name, config, tp_degree) == q.ndim - 1 else "rows"
            scale = reader.get_scale(source, along)
            bits = shard_tensor(name, q.view(torch.uint8), config, tp_degree, rank)
            weight = bits.contiguous().clone().view(FP8_DTYPE)
            scale = shard_tensor(name, scale, config, tp_degree, rank).contiguous().clone()
            if e4m3_range:  # (each 128-value run lies along the dimension not split: whole on every rank)
                weight, scale = fit_e4m3_range(weight, scale)
            yield name, weight
            yield name + SCALE_SUFFIX, scale
        else:
            tensor = convert_tensor(source, reader.get(source))
            shard = shard_tensor(name, tensor, config, tp_degree, rank)
            yield name, shard.to(dtype=stored_dtype(name, dtype) or shard.dtype, memory_format=torch.contiguous_format, copy=True)


def fp8_rank_tensors(reader: CheckpointReader, config: Qwen35Config, tp_degree: int, rank: int,
                     dtype: torch.dtype | None, e4m3_range: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of an export with FP8 weights (`save_sharded(..., weights_dtype="fp8")`): the float8
    shards, their expanded scales, and every other tensor in `dtype` (what `load_decoder(weights_dtype="fp8")` holds)."""
    return dict(convert_and_shard_fp8(reader, config, tp_degree, rank, dtype, e4m3_range))


def check_fp8_shard_shapes(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The scales of a rank file with FP8 weights that do not fit their weight (names), each scale in one of the two
    expanded forms of its float8 weight's shard shape ([.., rows, ceil(cols / 128)] or [.., ceil(rows / 128), cols])."""
    wrong = []
    for name, scale in tensors.items():
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = tensors.get(name[: -len(SCALE_SUFFIX)])
        if weight is None or weight.dtype != FP8_DTYPE or scale.dtype != torch.float32:
            wrong.append(name)
            continue
        *lead, rows, cols = weight.shape
        forms = {(*lead, rows, -(-cols // 128)), (*lead, -(-rows // 128), cols)}
        if tuple(scale.shape) not in forms:
            wrong.append(name)
    return wrong
