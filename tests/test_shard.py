"""Tensor-parallel sharding math, without processes: real Qwen3.5 head counts, reduced other dims.

For every valid degree: shards have the per-rank shapes the decoder builds, shards reassembled equal the
converted whole, and each rank's shard holds exactly the heads it must (checked against an independent,
head-by-head construction, not against the permutation the implementation uses).
"""

from __future__ import annotations

import pytest
import torch

from optimum_qwen35.checkpoint.convert import decoder_name, expected_shapes
from optimum_qwen35.checkpoint.shard import (
    kv_heads_of_rank,
    shard_dim,
    shard_kind,
    shard_tensor,
    sharded_shapes,
    tp_layout,
    unshard_tensor,
)
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.torch_layers import TorchLayers

# (attention heads, kv heads, DeltaNet key heads, value heads, tied) of the real models.
REAL_HEADS = {
    "0.8B": (8, 2, 16, 16, True),
    "2B": (8, 2, 16, 16, True),
    "4B": (16, 4, 16, 32, True),
    "9B": (16, 4, 16, 32, False),
    "27B": (24, 4, 16, 48, False),
}
EXPECTED_DEGREES = {"0.8B": [1, 2, 4, 8], "2B": [1, 2, 4, 8], "4B": [1, 2, 4, 8, 16], "9B": [1, 2, 4, 8, 16], "27B": [1, 2, 4, 8]}


def reduced_config(size: str, vocab: int = 1001, intermediate: int = 100) -> Qwen35Config:
    """Real head counts; small head dims, hidden size, vocab (odd: padded) and intermediate (padded)."""
    heads, kv, nk, nv, tied = REAL_HEADS[size]
    return Qwen35Config(
        vocab_size=vocab,
        hidden_size=24,
        intermediate_size=intermediate,
        num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=8,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=4,
        linear_value_head_dim=6,  # dk != dv on purpose
        partial_rotary_factor=0.25,
        tie_word_embeddings=tied,
    )


def random_whole(config: Qwen35Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random converted (unsharded) state dict: decoder names, conv weight [C, K]."""
    g = torch.Generator().manual_seed(seed)
    whole = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("conv1d.weight"):
            shape = (shape[0], shape[2])
        whole[decoder_name(name)] = torch.randn(shape, generator=g)
    return whole


class ShapeOnlyLayers(TorchLayers):
    """TorchLayers without the torch.distributed check: used only to read per-rank parameter shapes."""

    def __init__(self, tp_degree: int, rank: int):
        super().__init__(tp_degree, rank, group="unused: shapes only")


def decoder_shapes(config: Qwen35Config, tp_degree: int) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, tp_degree, ShapeOnlyLayers(tp_degree, 0))
    return {n: tuple(p.shape) for n, p in decoder.named_parameters()}


def test_valid_degrees_of_the_real_models():
    for size, degrees in EXPECTED_DEGREES.items():
        assert reduced_config(size).valid_tp_degrees() == degrees, size


@pytest.mark.parametrize("size", list(REAL_HEADS))
def test_shards_reassemble_to_the_converted_whole(size):
    config = reduced_config(size)
    whole = random_whole(config)
    for t in config.valid_tp_degrees():
        expected_shapes_per_rank = sharded_shapes(config, t)
        assert expected_shapes_per_rank == decoder_shapes(config, t), (size, t)
        for name, tensor in whole.items():
            shards = [shard_tensor(name, tensor, config, t, r) for r in range(t)]
            for s in shards:
                assert tuple(s.shape) == expected_shapes_per_rank[name], (size, t, name)
            assert torch.equal(unshard_tensor(name, shards, config), tensor), (size, t, name)


def _rows(tensor: torch.Tensor, heads, size: int, offset: int = 0) -> torch.Tensor:
    return torch.cat([tensor[offset + h * size : offset + (h + 1) * size] for h in heads])


@pytest.mark.parametrize("size", list(REAL_HEADS))
def test_each_rank_holds_its_heads(size):
    """Independent, head-by-head expectation of every head-split tensor of every rank."""
    c = reduced_config(size)
    whole = random_whole(c, seed=1)
    H, kv, nk, nv = c.num_attention_heads, c.num_key_value_heads, c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, hd, ratio = c.linear_key_head_dim, c.linear_value_head_dim, c.head_dim, nv // nk
    for t in c.valid_tp_degrees():
        for r in range(t):
            # DeltaNet: the rank's key heads, and every value head h with h // ratio among them.
            key_heads = [h for h in range(nk) if h * t // nk == r]
            value_heads = [h for h in range(nv) if h // ratio in key_heads]
            assert len(value_heads) == nv // t
            qkv = whole["layers.0.linear_attn.in_proj_qkv.weight"]
            expected = torch.cat([_rows(qkv, key_heads, dk), _rows(qkv, key_heads, dk, nk * dk), _rows(qkv, value_heads, dv, 2 * nk * dk)])
            assert torch.equal(shard_tensor("layers.0.linear_attn.in_proj_qkv.weight", qkv, c, t, r), expected)
            conv = whole["layers.0.linear_attn.conv_weight"]
            expected = torch.cat([_rows(conv, key_heads, dk), _rows(conv, key_heads, dk, nk * dk), _rows(conv, value_heads, dv, 2 * nk * dk)])
            assert torch.equal(shard_tensor("layers.0.linear_attn.conv_weight", conv, c, t, r), expected)
            for name, per_head in (("in_proj_z.weight", dv), ("in_proj_a.weight", 1), ("in_proj_b.weight", 1), ("A_log", 1), ("dt_bias", 1)):
                full = whole[f"layers.1.linear_attn.{name}"]
                assert torch.equal(shard_tensor(f"layers.1.linear_attn.{name}", full, c, t, r), _rows(full, value_heads, per_head)), name
            out = whole["layers.2.linear_attn.out_proj.weight"]
            expected = _rows(out.T, value_heads, dv).T
            assert torch.equal(shard_tensor("layers.2.linear_attn.out_proj.weight", out, c, t, r), expected)
            # Attention: the rank's query heads, and the KV head(s) they read (query head j -> j // (H / kv)).
            q_heads = [j for j in range(H) if j * t // H == r]
            needed_kv = sorted({j // (H // kv) for j in q_heads})
            held_kv = list(kv_heads_of_rank(c, t, r))
            assert set(needed_kv) <= set(held_kv), (t, r, needed_kv, held_kv)
            assert len(held_kv) == max(1, kv // t)
            # Locally the decoder maps query head i to local KV head i // (local H / local kv): check it.
            local_groups = len(q_heads) // len(held_kv)
            for i, j in enumerate(q_heads):
                assert held_kv[i // local_groups] == j // (H // kv)
            q = whole["layers.3.self_attn.q_proj.weight"]
            assert torch.equal(shard_tensor("layers.3.self_attn.q_proj.weight", q, c, t, r), _rows(q, q_heads, 2 * hd))
            for name in ("k_proj", "v_proj"):
                w = whole[f"layers.3.self_attn.{name}.weight"]
                assert torch.equal(shard_tensor(f"layers.3.self_attn.{name}.weight", w, c, t, r), _rows(w, held_kv, hd))
            o = whole["layers.3.self_attn.o_proj.weight"]
            assert torch.equal(shard_tensor("layers.3.self_attn.o_proj.weight", o, c, t, r), _rows(o.T, q_heads, hd).T)
            # Replicated tensors.
            for name in ("norm.weight", "layers.0.linear_attn.norm.weight", "layers.3.self_attn.q_norm.weight", "layers.3.input_layernorm.weight"):
                assert torch.equal(shard_tensor(name, whole[name], c, t, r), whole[name])


def test_kv_replication_when_degree_exceeds_kv_heads():
    c = reduced_config("2B")  # kv = 2
    k = random_whole(c)["layers.3.self_attn.k_proj.weight"]
    hd = c.head_dim
    shards = [shard_tensor("layers.3.self_attn.k_proj.weight", k, c, 8, r) for r in range(8)]
    for r, s in enumerate(shards):
        assert torch.equal(s, k[(r // 4) * hd : (r // 4 + 1) * hd])
    # Replicas must agree: a corrupted copy is detected on reassembly.
    shards[5] = shards[5] + 1
    with pytest.raises(ValueError, match="replicated KV heads differ"):
        unshard_tensor("layers.3.self_attn.k_proj.weight", shards, c)
    norm = torch.randn(c.hidden_size)
    with pytest.raises(ValueError, match="replicated copy on rank 1"):
        unshard_tensor("norm.weight", [norm, norm + 1], c)


def test_padding_of_vocab_and_intermediate():
    c = reduced_config("27B", vocab=1001, intermediate=100)  # 1001 % 8 = 1, 100 % 8 = 4
    whole = random_whole(c)
    emb, gate, down = whole["embed_tokens.weight"], whole["layers.0.mlp.gate_proj.weight"], whole["layers.0.mlp.down_proj.weight"]
    t = 8
    emb_shards = [shard_tensor("embed_tokens.weight", emb, c, t, r) for r in range(t)]
    assert all(s.shape == (126, c.hidden_size) for s in emb_shards)  # ceil(1001 / 8)
    assert torch.equal(emb_shards[0], emb[:126])
    assert torch.equal(emb_shards[7][: 1001 - 7 * 126], emb[7 * 126 :])
    assert torch.count_nonzero(emb_shards[7][1001 - 7 * 126 :]) == 0
    gate_layout, dim = tp_layout("layers.0.mlp.gate_proj.weight", gate, c, t)
    assert dim == 0 and gate_layout.shape[0] == 104 and torch.count_nonzero(gate_layout[100:]) == 0
    down_shards = [shard_tensor("layers.0.mlp.down_proj.weight", down, c, t, r) for r in range(t)]
    assert all(s.shape == (c.hidden_size, 13) for s in down_shards)
    assert torch.count_nonzero(down_shards[7][:, 9:]) == 0 and torch.equal(down_shards[7][:, :9], down[:, 91:])
    lm = whole["lm_head.weight"]  # untied in the 27B layout
    assert torch.equal(unshard_tensor("lm_head.weight", [shard_tensor("lm_head.weight", lm, c, t, r) for r in range(t)], c), lm)


def test_every_checkpoint_tensor_has_a_rule():
    for size in REAL_HEADS:
        c = reduced_config(size)
        for name in random_whole(c):
            shard_kind(name)  # raises for a tensor without a rule
    assert shard_kind("layers.0.linear_attn.in_proj_qkv.weight") == "deltanet_qkv"
    assert shard_dim("layers.0.linear_attn.out_proj.weight") == 1
    assert shard_dim("layers.0.mlp.down_proj.weight") == 1
    assert shard_dim("lm_head.weight") == 0
    assert shard_dim("layers.3.self_attn.k_norm.weight") is None


def test_invalid_degree_names_the_valid_ones():
    c = reduced_config("27B")
    whole = random_whole(c)
    for bad in (3, 5, 6, 16):
        with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4, 8\]"):
            shard_tensor("embed_tokens.weight", whole["embed_tokens.weight"], c, bad, 0)
        with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4, 8\]"):
            sharded_shapes(c, bad)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        shard_tensor("embed_tokens.weight", whole["embed_tokens.weight"], c, 4, 4)


def test_unknown_tensor_has_no_rule():
    c = reduced_config("2B")
    with pytest.raises(KeyError, match="no tensor-parallel sharding rule"):
        shard_tensor("layers.0.mlp.experts.weight", torch.zeros(4, 4), c, 2, 0)
