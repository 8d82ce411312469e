"""Qwen's block-wise FP8 checkpoints: the `quantization_config` they declare, and block (de)quantization.

The format (Qwen's `*-FP8` checkpoints, transformers' `FineGrainedFP8Config`): `quantization_config` =
{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128], modules_to_not_convert:
[...]}. Each quantized linear weight `X.weight` [rows, cols] is stored as float8_e4m3fn with a float32
`X.weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)]: the weight is `fp8 * scale_inv` block by block. A fused
expert tensor `X` [E, rows, cols] (transformers' in-memory form) has `X_scale_inv` [E, ceil(rows/128), ceil(cols/128)].

Partial blocks: when a dimension is not a multiple of 128, the last block is short and the grid is the ceiling
(transformers' `FP8Linear` allocates `(out + 127) // 128` scale rows; DeepSeek's and vLLM's `weight_dequant` use
the same grid). transformers 5.25's dequantize-at-load path instead derives the block from `rows // scale_rows`
and refuses a dimension its grid does not divide, so it only agrees with this grid where every dimension is a
multiple of 128 or fits in one block (docs/fp8.md).

Everything a user can get wrong is refused in one line (`CheckpointError`), before anything is read or written.
"""

from __future__ import annotations

import math

import torch

from ..errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
E4M3_MAX = 240.0  # float8_e4m3 (IEEE-like, bias 7): trn1 / inf2 / trn2's FP8 E4M3 (`fit_e4m3_range`)
# neuronx-cc's flag that reads F8E4M3FN operands as F8E4M3 on trn1 / inf2 / trn2, which refuse F8E4M3FN otherwise
# (NCC_EVRF051); exact for weights within E4M3_MAX (`fit_e4m3_range`).
E4M3FN_AS_E4M3_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`, a fused `X` -> `X_scale_inv`

# quant_method values other quantizers write, named in the refusal.
_OTHER_METHODS = {
    "gptq": "GPTQ (int4/int8 groups)",
    "awq": "AWQ (int4 groups)",
    "bitsandbytes": "bitsandbytes (int8 / nf4)",
    "compressed-tensors": "compressed-tensors (llm-compressor's channel-wise FP8 or int formats)",
    "fbgemm_fp8": "fbgemm FP8 (per-row)",
    "modelopt": "NVIDIA ModelOpt (FP8 / NVFP4)",
    "torchao": "torchao",
    "hqq": "HQQ",
    "quanto": "quanto",
    "mxfp4": "MXFP4",
}


def scale_name(name: str) -> str:
    """The scale's tensor name of a quantized weight's (either naming)."""
    return name + SCALE_SUFFIX


def fp8_format(config: dict) -> tuple[int, int] | None:
    """The block size of a config.json's block-FP8 `quantization_config` (top level or in `text_config`), None when
    the checkpoint is not quantized; refuses, in one line, every other quantization and every FP8 variant this
    package does not read."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        what = _OTHER_METHODS.get(method, f"quant_method {method!r}")
        raise CheckpointError(
            f"this checkpoint is quantized with {what}, which is not supported: only Qwen's block-wise FP8 "
            "(quant_method fp8, weight_block_size [128, 128]) and unquantized bf16/fp32 checkpoints load; use the "
            "original bf16 checkpoint (or its -FP8 release)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"FP8 checkpoint with fmt {fmt!r} is not supported: only e4m3 (float8_e4m3fn) weights load")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"FP8 checkpoint with activation_scheme {q.get('activation_scheme')!r} is not supported: only 'dynamic' "
            "(no stored activation scales) loads"
        )
    if q.get("scale_fmt", "float") not in (None, "float"):
        raise CheckpointError(f"FP8 checkpoint with scale_fmt {q.get('scale_fmt')!r} is not supported: only float32 scales load")
    block = q.get("weight_block_size")
    if block is None or list(block) != list(BLOCK):
        raise CheckpointError(
            f"FP8 checkpoint with weight_block_size {block!r} is not supported: only [128, 128] blocks (Qwen's format) "
            "load; use the bf16 checkpoint"
        )
    return BLOCK


def scale_grid(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape` (leading dims kept, the last two on the ceiling grid)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def expand_scale(scale_inv: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The block scales repeated to one per weight element [*shape] (the last blocks cut to the weight's edge)."""
    rows, cols = shape[-2:]
    return scale_inv.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def expand_along(scale_inv: torch.Tensor, shape: tuple[int, ...], along: str, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The block scales repeated along the weight's rows ("rows": [..., rows, ceil(cols / 128)]) or columns ("cols":
    [..., ceil(rows / 128), cols]): a form that any split, permutation or padding of that dimension (tensor-parallel
    sharding, checkpoint/shard.py) keeps exact, where a 128-row block may straddle two ranks."""
    if along == "rows":
        return scale_inv.repeat_interleave(block[0], dim=-2)[..., : shape[-2], :]
    if along == "cols":
        return scale_inv.repeat_interleave(block[1], dim=-1)[..., : shape[-1]]
    raise ValueError(f"along must be 'rows' or 'cols', got {along!r}")


def dequantize_expanded(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                        block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """A float8 weight (shard) [..., rows, cols] times its `expand_along` scale, in float32 (float64 for float64),
    cast to `dtype`: what an FP8-weight layer computes next to its matmul."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(wide) * _per_element(scale, tuple(weight.shape), block).to(wide)).to(dtype)


def _along_cols(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> bool:
    """Whether an expanded scale is the "rows" form [.., rows, ceil(cols / 128)] (one scale per 128 columns of a
    row) rather than the "cols" form [.., ceil(rows / 128), cols] of a weight of `shape`."""
    rows, cols = shape[-2:]
    if scale.shape[-2] == rows and scale.shape[-1] == math.ceil(cols / block[1]):
        return True
    if scale.shape[-1] == cols and scale.shape[-2] == math.ceil(rows / block[0]):
        return False
    raise ValueError(f"scale {tuple(scale.shape)} fits neither form of a weight {tuple(shape)}")


def _per_element(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """An expanded scale repeated to one per weight element [*shape]."""
    rows, cols = shape[-2:]
    if _along_cols(scale, shape, block):
        return scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]


def fit_e4m3_range(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, expanded scale) with every 128-value run that shares one scale halved, and its scale doubled,
    wherever the run's largest |value| is above 240: the largest finite float8_e4m3 (bias 7, the top exponent for
    inf / NaN), the FP8 E4M3 format of NeuronCore-v2 / v3 (trn1, inf2, trn2). float8_e4m3fn and float8_e4m3 share
    every bit pattern up to 240, so after this neuronx-cc's `--experimental-unsafe-fp8e4m3fn-as-fp8e4m3` (how those
    targets take an F8E4M3FN operand: NCC_EVRF051) reads each weight as the value it holds (docs/fp8.md). The
    product is unchanged except where a halved value falls below float8's normal range (2^-6) and loses its last
    mantissa bit: at most 2^-10 of the new scale."""
    shape = tuple(weight.shape)
    segments_along_cols = _along_cols(scale, shape, block)
    w = weight.to(torch.float32)
    runs = w if segments_along_cols else w.transpose(-1, -2)
    size = block[1] if segments_along_cols else block[0]
    n = runs.shape[-1]
    padded = torch.nn.functional.pad(runs.abs(), (0, -n % size))
    peak = padded.reshape(*runs.shape[:-1], -1, size).amax(dim=-1)
    factor = torch.where(peak > E4M3_MAX, 2.0, 1.0)
    if not segments_along_cols:
        factor = factor.transpose(-1, -2)
    return (w / _per_element(factor, shape, block)).to(FP8_DTYPE), scale * factor


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """fp8 weight x its block scale, multiplied in float32 (as transformers does; in float64 for a float64 model,
    where the product is exact) and cast to `dtype`."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    product = weight.to(wide) * expand_scale(scale_inv.to(wide), tuple(weight.shape), block)
    return product.to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv on the ceiling grid) of a [..., rows, cols] weight: each block's
    scale_inv is its max |w| / 448 (1 for an all-zero block), as transformers' `Fp8Quantize` computes it."""
    w = weight.to(torch.float32)
    *lead, rows, cols = w.shape
    grid = scale_grid(tuple(w.shape), block)
    padded = torch.zeros(*lead, grid[-2] * block[0], grid[-1] * block[1], dtype=torch.float32)
    padded[..., :rows, :cols] = w
    tiles = padded.reshape(*lead, grid[-2], block[0], grid[-1], block[1])
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    scale_inv = (1.0 / scale).to(torch.float32)
    q = (w * expand_scale(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv
