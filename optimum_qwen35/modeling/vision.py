"""The Qwen3.5 vision tower: patch embedding, ViT blocks with 2-D rotary attention, and the patch merger.

One image runs in one *image bucket*: a static number of patch rows N (a multiple of spatial_merge_size^2). The
graph never looks at an image's grid: everything that depends on it is computed on the host
(`image_bucket_inputs`) and fed as tensors of the bucket's shape:

- `patches` [N, C * T * P * P]: the processor's flattened patches (pixel_values rows), zero rows after the image;
- `pos_index`, `pos_weight` [N, 4]: the four bilinear taps (align_corners) into the square learned position table
  that resample it to the image's grid, and their weights (zero for padding rows);
- `rotary_pos` [N, 2]: each patch's (row, column) in the patch grid, for the 2-D rotary embedding;
- `segment` [N]: 0 for the image's patches, -1 for padding. A patch attends to the patches of its own segment,
  so padding changes nothing in the image's rows (and padding rows, which see each other, stay finite).

Returns the merged tokens [N / merge^2, out_hidden_size] (the decoder's hidden size); the host keeps the first
h * w / merge^2 of them. Patches come in the processor's order (merge blocks of merge x merge neighbours
contiguous), so the merger takes consecutive rows.

Precision follows the decoder's policy (precision.py): the residual stream, the LayerNorms and the rotary
rotation in fp32, matmul operands in the model dtype, the attention core in the backend's form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from .layers import apply_rotary, upcast
from .precision import TorchPrecision
from .torch_layers import TorchLayers


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyper-parameters and the token ids that place its output in a prompt."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    image_token_id: int
    vision_start_token_id: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch (a pixel_values row)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "VisionConfig | None":
        """The vision part of a nested Qwen3.5 config.json; None for a text-only config."""
        vision = config.get("vision_config")
        # The MoE checkpoints (`qwen3_5_moe`) carry the same tower.
        if config.get("model_type") not in ("qwen3_5", "qwen3_5_moe") or not isinstance(vision, dict):
            return None
        if vision.get("deepstack_visual_indexes"):
            raise UnsupportedModelError("vision_config.deepstack_visual_indexes is not supported (Qwen3.5 has none)")
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"vision_config.hidden_act {act!r} is not supported (only 'gelu_pytorch_tanh')")
        rope = vision.get("rope_parameters") or {}
        try:
            return cls(
                depth=int(vision["depth"]),
                hidden_size=int(vision["hidden_size"]),
                intermediate_size=int(vision["intermediate_size"]),
                num_heads=int(vision["num_heads"]),
                out_hidden_size=int(vision["out_hidden_size"]),
                # transformers' default (the published 35B-A3B config.json omits it).
                num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
                image_token_id=int(config["image_token_id"]),
                vision_start_token_id=int(config["vision_start_token_id"]),
                in_channels=int(vision.get("in_channels", 3)),
                patch_size=int(vision.get("patch_size", 16)),
                temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                hidden_act=act,
                rope_theta=float(rope.get("rope_theta", 10_000.0)),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json has no {e.args[0]!r} for its vision tower") from None


def expected_vision_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor of a checkpoint, by its name under `model.visual.`, with its shape."""
    e, merged = v.hidden_size, v.hidden_size * v.merge_unit
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (e, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "patch_embed.proj.bias": (e,),
        "pos_embed.weight": (v.num_position_embeddings, e),
        "merger.norm.weight": (e,),
        "merger.norm.bias": (e,),
        "merger.linear_fc1.weight": (merged, merged),
        "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (v.out_hidden_size, merged),
        "merger.linear_fc2.bias": (v.out_hidden_size,),
    }
    for i in range(v.depth):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[b + norm + ".weight"] = shapes[b + norm + ".bias"] = (e,)
        shapes[b + "attn.qkv.weight"], shapes[b + "attn.qkv.bias"] = (3 * e, e), (3 * e,)
        shapes[b + "attn.proj.weight"], shapes[b + "attn.proj.bias"] = (e, e), (e,)
        shapes[b + "mlp.linear_fc1.weight"] = (v.intermediate_size, e)
        shapes[b + "mlp.linear_fc1.bias"] = (v.intermediate_size,)
        shapes[b + "mlp.linear_fc2.weight"] = (e, v.intermediate_size)
        shapes[b + "mlp.linear_fc2.bias"] = (e,)
    return shapes


def convert_vision_tensor(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A checkpoint vision tensor -> the encoder's parameters. The Conv3d patch embedding (kernel = stride = one
    patch) is a linear over the flattened patch; the fused qkv projection is split into q, k and v, so that a
    column-parallel split of each is a split by heads."""
    if name == "patch_embed.proj.weight":
        return {name: tensor.reshape(tensor.shape[0], -1)}
    if ".attn.qkv." in name:
        q, k, v = tensor.chunk(3, dim=0)
        return {name.replace("qkv", proj): t.contiguous() for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))}
    return {name: tensor}


# The encoder's column-parallel linears (split by output rows: q/k/v by heads) and row-parallel ones (split by input
# columns, their bias added once after the sum); everything else is replicated.
VISION_COLUMN_PARALLEL = ("attn.q_proj.", "attn.k_proj.", "attn.v_proj.", "mlp.linear_fc1.", "merger.linear_fc1.")
VISION_ROW_PARALLEL = ("attn.proj.weight", "mlp.linear_fc2.weight", "merger.linear_fc2.weight")


def shard_vision_params(params: dict[str, torch.Tensor], tp_degree: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of the encoder's (converted) parameters: contiguous blocks, the layer factory's split
    contract (modeling/parallel.py)."""
    out = {}
    for name, tensor in params.items():
        if any(k in name for k in VISION_COLUMN_PARALLEL):
            tensor = tensor.chunk(tp_degree, dim=0)[rank]
        elif name.endswith(VISION_ROW_PARALLEL):
            tensor = tensor.chunk(tp_degree, dim=1)[rank]
        out[name] = tensor.contiguous()
    return out


class LayerNorm(nn.LayerNorm):
    """LayerNorm (eps 1e-6) computed in fp32 whatever the weights' dtype; returns fp32 (the policy's norms)."""

    def __init__(self, dim: int, precision=None):
        super().__init__(dim, eps=1e-6)
        self.precision = precision or TorchPrecision()  # the backend's form of the norm (modeling/precision.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.precision.layer_norm(upcast(x), upcast(self.weight), upcast(self.bias), self.eps)


class VisionRotaryEmbedding(nn.Module):
    """2-D rotary embedding: the first half of the rotated dims turn with the patch row, the second with the column
    (same frequencies for both), over the whole head."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        quarter = head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter
        self.theta = theta
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def _apply(self, fn, recurse=True):
        # As the decoder's rotary: a cast of the whole model must not round the frequencies.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self.inv_freq.float()
        return self

    def forward(self, rotary_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary_pos [N, 2] -> cos, sin [1, 1, N, head_dim] in fp32."""
        freqs = rotary_pos.to(torch.float32)[..., None] * self.inv_freq  # [N, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # row frequencies, then column frequencies
        emb = torch.cat([freqs, freqs], dim=-1)[None, None]
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, v: VisionConfig, layers, tp_degree: int):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads // tp_degree, v.head_dim
        width = self.num_heads * self.head_dim
        self.q_proj = layers.column_linear(v.hidden_size, width, bias=True)
        self.k_proj = layers.column_linear(v.hidden_size, width, bias=True)
        self.v_proj = layers.column_linear(v.hidden_size, width, bias=True)
        self.proj = layers.row_linear(width, v.hidden_size, bias=True)
        self.precision = layers.precision
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, mask):
        """x [N, hidden] (model dtype), cos/sin [1, 1, N, head_dim], mask [1, 1, N, N] (True = visible)."""
        N = x.shape[0]

        def heads(t):
            return t.view(1, N, self.num_heads, self.head_dim).transpose(1, 2)  # [1, H, N, hd]

        q = apply_rotary(heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(heads(self.k_proj(x)), cos, sin)
        out = self.precision.attention(q, k, heads(self.v_proj(x)), mask, self.scale)
        return self.proj(out.transpose(1, 2).reshape(N, self.num_heads * self.head_dim))


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig, layers, tp_degree: int):
        super().__init__()
        self.norm1 = LayerNorm(v.hidden_size, layers.precision)
        self.norm2 = LayerNorm(v.hidden_size, layers.precision)
        self.attn = VisionAttention(v, layers, tp_degree)
        inter = v.intermediate_size // tp_degree
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = layers.column_linear(v.hidden_size, inter, bias=True)
        self.mlp.linear_fc2 = layers.row_linear(inter, v.hidden_size, bias=True)

    def forward(self, h, cos, sin, mask):
        """h [N, hidden]: the fp32 residual stream."""
        dtype = self.mlp.linear_fc1.weight.dtype
        h = h + self.attn(self.norm1(h).to(dtype), cos, sin, mask)
        x = self.mlp.linear_fc1(self.norm2(h).to(dtype))
        return h + self.mlp.linear_fc2(F.gelu(x, approximate="tanh"))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then merge_unit consecutive patches concatenated -> MLP (exact GELU) -> decoder width."""

    def __init__(self, v: VisionConfig, layers, tp_degree: int):
        super().__init__()
        self.merged = v.hidden_size * v.merge_unit
        self.norm = LayerNorm(v.hidden_size, layers.precision)
        self.linear_fc1 = layers.column_linear(self.merged, self.merged // tp_degree, bias=True)
        self.linear_fc2 = layers.row_linear(self.merged // tp_degree, v.out_hidden_size, bias=True)

    def forward(self, h):
        x = self.norm(h).to(self.linear_fc1.weight.dtype).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """One rank's share of the vision tower (the whole tower at tp_degree 1)."""

    def __init__(self, config: VisionConfig, tp_degree: int = 1, layers=None):
        super().__init__()
        for what, size in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
            if size % tp_degree:
                raise UnsupportedModelError(f"vision {what} {size} does not divide by tensor_parallel_size {tp_degree}")
        self.config = config
        layers = layers if layers is not None else TorchLayers(tp_degree)
        self.patch_embed = nn.Module()
        # Replicated (small): a linear over the flattened patch, the checkpoint's Conv3d weight reshaped.
        self.patch_embed.proj = nn.Linear(config.patch_dim, config.hidden_size)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config, layers, tp_degree) for _ in range(config.depth))
        self.merger = PatchMerger(config, layers, tp_degree)

    def forward(self, patches, pos_index, pos_weight, rotary_pos, segment):
        """See the module docstring. Returns [N / merge_unit, out_hidden_size] in the model dtype."""
        dtype = self.patch_embed.proj.weight.dtype
        h = upcast(self.patch_embed.proj(patches.to(dtype)))
        # The learned position table, resampled to the image's grid: a weighted sum of four rows, in fp32.
        taps = upcast(self.pos_embed(pos_index)) * upcast(pos_weight)[..., None]  # [N, 4, hidden]
        h = h + taps.sum(1)
        cos, sin = self.rotary(rotary_pos)
        mask = (segment[:, None] == segment[None, :])[None, None]  # [1, 1, N, N]
        for block in self.blocks:
            h = block(h, cos, sin, mask)
        return self.merger(h)


# ----------------------------------------------------------------------------------------------- host side


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners=True) on one axis: for target positions `index` of an axis of `size`, the two
    source rows of a `side`-long table and their weights, in fp32 (as transformers computes them)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def image_patch_grid(config: VisionConfig, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of a grid_h x grid_w image, in the processor's patch order (merge blocks of
    merge x merge neighbours contiguous, blocks in raster order)."""
    m = config.spatial_merge_size
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)

    def block_order(t):
        return t.reshape(grid_h // m, m, grid_w // m, m).transpose(1, 2).flatten()

    return block_order(rows), block_order(cols)


def image_bucket_inputs(config: VisionConfig, pixel_rows: torch.Tensor, grid_thw, bucket: int) -> tuple[torch.Tensor, ...]:
    """The vision graph's inputs for one image (pixel_rows [t * h * w, patch_dim], grid (t, h, w) with t = 1) in a
    bucket of `bucket` patch rows: (patches, pos_index, pos_weight, rotary_pos, segment)."""
    t, grid_h, grid_w = (int(x) for x in grid_thw)
    n = t * grid_h * grid_w
    rows, cols = image_patch_grid(config, grid_h, grid_w)
    side = config.grid_side
    h_taps, h_weights = _axis_taps(rows, grid_h, side)
    w_taps, w_weights = _axis_taps(cols, grid_w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(n, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(n, 4)
    patches = torch.zeros(bucket, config.patch_dim, dtype=pixel_rows.dtype)
    patches[:n] = pixel_rows
    pos_index = torch.zeros(bucket, 4, dtype=torch.int32)
    pos_index[:n] = index
    pos_weight = torch.zeros(bucket, 4, dtype=torch.float32)
    pos_weight[:n] = weight
    rotary_pos = torch.zeros(bucket, 2, dtype=torch.int32)
    rotary_pos[:n] = torch.stack([rows, cols], dim=-1)
    segment = torch.full((bucket,), -1, dtype=torch.int32)
    segment[:n] = 0
    return patches, pos_index, pos_weight, rotary_pos, segment


def rope_index(config: VisionConfig, input_ids, image_grid_thw) -> tuple[torch.Tensor, int]:
    """The 3-D rotary positions [3, L] (time, row, column) of one prompt's tokens, and the offset (rope delta) of
    the tokens that follow it: position p of a generated token rotates as p + delta.

    As transformers' `get_rope_index`: a text run counts on from the current position on all three axes; an
    image's tokens sit at (start, start + row, start + column) on the merged grid, and the text after it starts
    at start + max(merged rows, merged columns)."""
    ids = torch.as_tensor(input_ids).reshape(-1)
    is_image = (ids == config.image_token_id).tolist()
    grids = iter(image_grid_thw)
    pieces, current, i = [], 0, 0
    while i < len(is_image):
        j = i
        while j < len(is_image) and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            pieces.append(torch.arange(current, current + j - i).expand(3, -1))
            current += j - i
        else:
            t, gh, gw = (int(x) for x in next(grids))
            m = config.spatial_merge_size
            gh, gw = gh // m, gw // m
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            pieces.append(torch.stack([tt + current, hh + current, ww + current]).reshape(3, -1))
            current += max(gh, gw)
        i = j
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(is_image) if len(is_image) else 0
    return positions, delta
