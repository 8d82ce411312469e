"""Checkpoint names and shapes -> the decoder's parameters.

The decoder keeps transformers' parameter names, with one exception: the depthwise conv filter
`linear_attn.conv1d.weight` [C, 1, K] becomes `linear_attn.conv_weight` [C, K].
"""

from __future__ import annotations

import torch

from ..config import FULL_ATTENTION, Qwen35Config
from ..errors import CheckpointError
from ..modeling.precision import FP32_PARAMETERS, accumulation_dtype
from .reader import CheckpointReader


def expected_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every text tensor a Qwen3.5 checkpoint must hold, by decoder-relative name, with its shape."""
    c = config
    hidden = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, hidden), "norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for i, layer_type in enumerate(c.layer_types):
        shapes.update(layer_shapes(c, f"layers.{i}.", layer_type))
    return shapes


def layer_shapes(config: Qwen35Config, p: str, layer_type: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors under prefix `p` (a main layer, or the MTP head's `mtp.layers.N.`)."""
    c = config
    hidden, hd = c.hidden_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "input_layernorm.weight"] = (hidden,)
    shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    if c.is_moe:
        shapes.update(moe_shapes(c, p + "mlp."))
    else:
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, hidden)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, c.intermediate_size)
    if layer_type == FULL_ATTENTION:
        a = p + "self_attn."
        shapes[a + "q_proj.weight"] = (2 * c.num_attention_heads * hd, hidden)
        shapes[a + "k_proj.weight"] = (c.num_key_value_heads * hd, hidden)
        shapes[a + "v_proj.weight"] = (c.num_key_value_heads * hd, hidden)
        shapes[a + "o_proj.weight"] = (hidden, c.num_attention_heads * hd)
        shapes[a + "q_norm.weight"] = (hd,)
        shapes[a + "k_norm.weight"] = (hd,)
    else:
        d = p + "linear_attn."
        nv = c.linear_num_value_heads
        shapes[d + "in_proj_qkv.weight"] = (c.linear_conv_dim, hidden)
        shapes[d + "in_proj_z.weight"] = (c.linear_value_dim, hidden)
        shapes[d + "in_proj_b.weight"] = (nv, hidden)
        shapes[d + "in_proj_a.weight"] = (nv, hidden)
        shapes[d + "conv1d.weight"] = (c.linear_conv_dim, 1, c.linear_conv_kernel_dim)
        shapes[d + "A_log"] = (nv,)
        shapes[d + "dt_bias"] = (nv,)
        shapes[d + "norm.weight"] = (c.linear_value_head_dim,)
        shapes[d + "out_proj.weight"] = (hidden, c.linear_value_dim)
    return shapes


def mtp_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction head's tensors, by name under `mtp.`: `fc` [H, 2H] over the concatenation
    [pre_fc_norm_embedding(embedding) | pre_fc_norm_hidden(hidden)], `mtp_num_hidden_layers` full-attention layers
    (sparse MoE blocks in MoE checkpoints), the final `norm` (modeling/mtp.py)."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, 2 * h),
        "pre_fc_norm_embedding.weight": (h,),
        "pre_fc_norm_hidden.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.mtp_num_hidden_layers):
        shapes.update(layer_shapes(config, f"layers.{i}.", FULL_ATTENTION))
    return shapes


def convert_mtp(reader: CheckpointReader, config: Qwen35Config, dtype: torch.dtype | None = None):
    """Yield (decoder name `mtp.*`, tensor) of the multi-token-prediction head of a reader opened with mtp=True,
    after checking that the checkpoint holds exactly the head's tensors with their shapes."""
    expected = mtp_shapes(config)
    present = set(reader.mtp_names())
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    wrong = sorted(f"mtp.{n}: {reader.mtp_shape(n)}, {expected[n]} expected" for n in set(expected) & present
                   if reader.mtp_shape(n) != expected[n])
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"checkpoint {reader.folder}: its multi-token-prediction head (mtp.*) does not match config.json: "
            f"missing {['mtp.' + n for n in missing]}, unexpected {['mtp.' + n for n in unexpected]}, wrong shape {wrong}"
        )
    for name in expected:
        tensor = convert_tensor(name, reader.get_mtp(name))
        yield "mtp." + decoder_name(name), tensor if dtype is None else tensor.to(stored_dtype(name, dtype))


def moe_shapes(config: Qwen35Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse MoE block's tensors (transformers' names; experts in the fused form, checkpoint/experts.py)."""
    e, h, i, s = config.num_experts, config.hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size
    return {
        prefix + "gate.weight": (e, h),
        prefix + "experts.gate_up_proj": (e, 2 * i, h),
        prefix + "experts.down_proj": (e, h, i),
        prefix + "shared_expert.gate_proj.weight": (s, h),
        prefix + "shared_expert.up_proj.weight": (s, h),
        prefix + "shared_expert.down_proj.weight": (h, s),
        prefix + "shared_expert_gate.weight": (1, h),
    }


def check_checkpoint(reader: CheckpointReader, config: Qwen35Config) -> None:
    """Raise one error listing every missing, unexpected and wrongly shaped text tensor."""
    expected = expected_shapes(config)
    present = set(reader.names())
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exports write the tied copy; it is the embedding anyway
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    wrong = sorted(
        f"{n}: {reader.shape(n)} in the checkpoint, {expected[n]} expected"
        for n in set(expected) & present
        if reader.shape(n) != expected[n]
    )
    # A layer storing its experts one by one with some missing: name those (the fused names are missing too).
    missing_experts = getattr(reader, "missing_expert_tensors", [])
    if missing or unexpected or wrong:
        lines = [f"checkpoint {reader.folder} does not match its config.json:"]
        if missing_experts:
            lines.append(f"  per-expert tensors missing ({len(missing_experts)}): " + ", ".join(missing_experts[:20]))
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        raise CheckpointError("\n".join(lines))


def check_finite(tensors, where: str) -> None:
    """Refuse weights holding NaN or Inf, naming each such tensor.

    One cheap pass per tensor: a sum is finite only if every element is (NaN and Inf propagate), so the
    exact, slower count runs only on a tensor whose sum is not (a bf16 sum accumulates in fp32 and has
    fp32's range; fp16 is summed in fp32 so that a large tensor does not overflow).
    """
    bad = []
    # One thread: the sums stream at memory speed on one core, while a parallel region per tensor costs
    # more than the sum itself (its threads must wake, and wait for a core on a busy machine): measured on
    # the 0.8B-shaped checkpoint, 0.07 s on one thread, 0.13 to 1.7 s on two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, tensor in tensors.items():
            if not tensor.is_floating_point():
                continue
            if tensor.dtype == torch.float8_e4m3fn:  # no CPU sum of float8: in fp32, 16M elements at a time
                total = sum(part.to(torch.float32).sum() for part in tensor.reshape(-1).split(1 << 24))
            else:
                total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
            if torch.isfinite(total):
                continue
            wide = tensor.to(torch.float32) if tensor.dtype == torch.float8_e4m3fn else tensor
            nan, inf = int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum())
            if nan or inf:
                bad.append(f"{name} ({nan} NaN, {inf} Inf of {tensor.numel()})")
    finally:
        torch.set_num_threads(threads)
    if bad:
        shown = bad[:10] + ([f"... and {len(bad) - 10} more"] if len(bad) > 10 else [])
        raise CheckpointError(
            f"{where}: weights hold NaN or Inf values: {', '.join(shown)}. The file is corrupt or was saved from a "
            "diverged model: download or export it again"
        )


def decoder_name(name: str) -> str:
    return name.replace("linear_attn.conv1d.weight", "linear_attn.conv_weight")


def convert_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith("linear_attn.conv1d.weight"):
        return tensor[:, 0, :]
    return tensor


def stored_dtype(name: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a converted tensor is held in for a model of `dtype` (None: as in the checkpoint): the DeltaNet
    gate parameters stay fp32 whatever the model dtype (the precision policy, modeling/precision.py). Real
    checkpoints store them in fp32; a bf16 one is upcast (exactly)."""
    if dtype is not None and name.endswith(FP32_PARAMETERS):
        return accumulation_dtype(dtype)
    return dtype


def convert_checkpoint(reader: CheckpointReader, config: Qwen35Config, dtype: torch.dtype | None = None):
    """Yield (decoder name, tensor) for the whole (unsharded) model, one tensor at a time."""
    check_checkpoint(reader, config)
    for name in expected_shapes(config):
        tensor = convert_tensor(name, reader.get(name))
        yield decoder_name(name), tensor if dtype is None else tensor.to(stored_dtype(name, dtype))
