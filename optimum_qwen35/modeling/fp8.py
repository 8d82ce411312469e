"""FP8 weights held as float8 in the model, dequantized next to their matmul (issue 49, way (b); docs/fp8.md).

A quantized layer keeps its float8_e4m3fn weight (this rank's shard) and its float32 block scale in the expanded
form `checkpoint/fp8_shard.py` writes; its `weight` is a parametrization (torch.nn.utils.parametrize) that
multiplies the two in float32 and casts to the model dtype each time the layer reads it. So the layer classes do not
change (Linear, RowParallelLinear, the MoE experts' fused tensors), the graph holds float8 parameters and does the
dequantization beside the matmul, activations stay in the model dtype and the DeltaNet state in fp32. For a bf16
model the weight the matmul sees is bit for bit the one dequantized at load (the same float32 product, the same
rounding), so the two ways differ only by the matmul kernel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..checkpoint.fp8 import FP8_DTYPE, dequantize_expanded
from ..checkpoint.fp8_shard import SCALE_SUFFIX


class Fp8Dequantize(nn.Module):
    """The parametrization: float8 weight -> model-dtype weight, with this layer's scale (a buffer)."""

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("scale", scale)
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return dequantize_expanded(weight, self.scale, self.dtype)


def split_fp8(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Take the float8 weights and their scales out of `params` (returned), leaving the rest to load_state_dict."""
    names = [n[: -len(SCALE_SUFFIX)] for n in params if n.endswith(SCALE_SUFFIX)]
    return {k: params.pop(k) for n in names for k in (n, n + SCALE_SUFFIX)}


def hold_fp8_weights(module: nn.Module, fp8_params: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Give each float8 weight of `fp8_params` to its layer of `module`, dequantized next to the matmul; returns how
    many. The layer's parameter becomes `<name>.parametrizations.<attr>.original` (float8)."""
    count = 0
    for name, weight in fp8_params.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: {weight.dtype}, float8_e4m3fn expected")
        path, attr = name.rsplit(".", 1)
        layer = module.get_submodule(path)
        setattr(layer, attr, nn.Parameter(weight, requires_grad=False))
        parametrize.register_parametrization(layer, attr, Fp8Dequantize(fp8_params[name + SCALE_SUFFIX], dtype), unsafe=True)
        count += 1
    return count


def select_experts(module: nn.Module, name: str, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (dim 0: experts) of `module`'s weight `name`; a float8 one gathered as float8 with its scale rows
    first (a gather of f8E4M3FN in the graph, no bitcast), then dequantized."""
    if not parametrize.is_parametrized(module, name):
        return getattr(module, name).index_select(0, index)
    chain = getattr(module.parametrizations, name)
    dequantize = chain[0]
    weight = chain.original.index_select(0, index)
    return dequantize_expanded(weight, dequantize.scale.index_select(0, index), dequantize.dtype)


def is_fp8(module: nn.Module) -> bool:
    """Whether `module` holds a float8 weight (such a layer is not prepacked: `torch_layers.pack_linears`)."""
    return parametrize.is_parametrized(module)


def stored_weight_name(name: str) -> str:
    """The name a weight input of a compiled graph has in the export's rank files: a float8 layer's
    `X.parametrizations.A.original` is `X.A`, its scale `X.parametrizations.A.0.scale` is `X.A_scale`; any other
    name is unchanged."""
    if ".parametrizations." not in name:
        return name
    path, rest = name.split(".parametrizations.", 1)
    attr, tail = rest.split(".", 1)
    if tail == "original":
        return f"{path}.{attr}"
    if tail == "0.scale":
        return f"{path}.{attr}{SCALE_SUFFIX}"
    raise ValueError(f"{name}: not a weight of an FP8 layer")


def hold_meta_fp8_weights(module: nn.Module, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                          dtype: torch.dtype) -> int:
    """`hold_fp8_weights` on a meta-device decoder (what the cpu target exports its graphs from): each weight of
    `shapes` ({name: (float8 shard shape, scale shape)}, from an export's rank file) becomes a float8 one."""
    params = {}
    for name, (shape, scale_shape) in shapes.items():
        params[name] = torch.empty(shape, dtype=FP8_DTYPE, device="meta")
        params[name + SCALE_SUFFIX] = torch.empty(scale_shape, dtype=torch.float32, device="meta")
    return hold_fp8_weights(module, params, dtype)
