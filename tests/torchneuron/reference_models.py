"""Upstream transformers' own decoders through the same check backend: the reference the op census is taken against.

Tiny Llama, Qwen3 and Qwen3-MoE configs (2 layers, GQA 4/2; MoE: 6 experts, top 2; the same sizes as the HLO
check's reference models, `tests/kit/hlo_contract.py`), in transformers' StaticCache form (the KV cache
written in place, as a static-shape graph on a device has it): a prefill of `prompt` tokens and one decode step, each
compiled with `fullgraph=True, dynamic=False`."""

from __future__ import annotations

import torch

from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend, LoweredGraph

REFERENCE_MODELS = ("llama", "qwen3", "qwen3_moe")


def tiny_config(kind: str, dtype: torch.dtype):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, dtype=dtype)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=True, **common)
    return Qwen3Config(head_dim=16, **common) if kind == "qwen3" else LlamaConfig(**common)


def reference_graphs(kind: str, dtype: torch.dtype = torch.float32, batch: int = 2, prompt: int = 16,
                     max_length: int = 32) -> list[LoweredGraph]:
    """The prefill and decode graphs of one reference model, lowered by the check backend."""
    from transformers import AutoModelForCausalLM, StaticCache

    torch.manual_seed(0)
    config = tiny_config(kind, dtype)
    extra = {"experts_implementation": "batched_mm"} if kind == "qwen3_moe" else {}  # see the docstring
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra).eval()
    cache = StaticCache(config=config, max_cache_len=max_length)
    backend = CheckBackend(name=kind)

    def step(input_ids, position_ids, cache_position):
        return model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                     past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    ids = torch.randint(0, config.vocab_size, (batch, prompt))
    with torch.no_grad():
        positions = torch.arange(prompt)
        compiled(ids, positions.expand(batch, prompt), positions)
        position = torch.tensor([prompt])
        compiled(ids[:, :1], position.expand(batch, 1), position)
    return backend.graphs
