"""Tiny random Qwen3.5 checkpoints, in exactly the on-disk format of the real Hub snapshots.

No real weights can be downloaded in the test environments, so every test builds (or reads) a small
random checkpoint with the same files, config fields, tensor names and layouts as `Qwen/Qwen3.5-*`:

- `config.json`: the nested vision-language config (`model_type: "qwen3_5"`, a `text_config` of type
  `qwen3_5_text` with every field the real file has, a small `vision_config`, the top-level vision token ids);
- `generation_config.json`;
- safetensors weights (metadata `{"format": "pt"}`): the text decoder under `model.language_model.*`, the
  vision tower under `model.visual.*`, the multi-token-prediction head under `mtp.*`, and `lm_head.weight`
  only when the embeddings are untied; sharded with a `model.safetensors.index.json` or a single file;
- a small byte-level BPE tokenizer (`tokenizer.json`, `tokenizer_config.json` with a ChatML template).

Everything is deterministic from `seed` (numpy's PCG64 `default_rng`, not torch's RNG), and this module does
not import torch or transformers, so it runs in every environment of the project.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "TINY_LAYOUTS",
    "TINY_MOE_LAYOUTS",
    "MOE_EXPERT_FORMS",
    "SPECIAL_TOKENS",
    "TOKENIZER_BASE_VOCAB",
    "special_token_id",
    "tiny_text_config",
    "tiny_vision_config",
    "tiny_full_config",
    "tiny_state_dict",
    "build_tiny_checkpoint",
    "build_tiny_tokenizer",
    "write_safetensors",
    "read_safetensors",
]

# ----------------------------------------------------------------------------------------------- tokenizer

# The Qwen3.5 special tokens, in the order the real tokenizer numbers them (after the byte-level BPE vocabulary).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Tokens that are "special" (skipped by decode(skip_special_tokens=True)); the tool and think markers are not,
# as in the real tokenizer.
_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

TINY_VOCAB_SIZE = 512
# The trained byte-level BPE has exactly this many entries (256 bytes + merges); special tokens follow.
TOKENIZER_BASE_VOCAB = TINY_VOCAB_SIZE - len(SPECIAL_TOKENS)


# The chat whose transformers reply the fixtures record (tests/fixtures/make_reference.py).
CHAT_MESSAGES = [{"role": "user", "content": "Give me a short introduction to large language models."}]


def special_token_id(token: str) -> int:
    """The id of a special token in the tiny tokenizer (fixed: the BPE vocabulary has a fixed size)."""
    return TOKENIZER_BASE_VOCAB + SPECIAL_TOKENS.index(token)


ENDOFTEXT_ID = special_token_id("<|endoftext|>")
IM_END_ID = special_token_id("<|im_end|>")

# The same pre-tokenization as the real Qwen3.5 tokenizer.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = """\
The little harbor town woke up slowly. Fishermen pulled their boats onto the sand, and the smell of salt and
fresh bread drifted along the narrow streets. Children ran to school with their bags bouncing on their backs,
while the baker counted the loaves that were still warm from the oven.

A language model reads a sequence of tokens and predicts the next one. It learns which words tend to follow
other words, how sentences are built, and how a question is usually answered. When the model is small, it
makes many mistakes, but it can still be useful for testing the machinery that runs a much larger model.

Linear attention keeps a fixed-size state for every sequence instead of a cache that grows with each token.
The state is updated with a delta rule: the model writes a new value for a key, after removing the value that
the state already holds for that key. A gate decays the old state, so the memory can forget what it no longer
needs. Every fourth layer still uses full attention over all the previous tokens.

In the morning the weather was cold and grey, but by noon the sun had come out and the sea was bright and calm.
People sat outside the cafe, reading newspapers, drinking coffee and talking about the news of the day. An old
man fed the birds with crumbs, and a dog slept in the shade under a table.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2024 and 3.14 are all tokens a model must handle. So are
punctuation marks like commas, periods, question marks? and exclamation marks! Code has its own shapes too:
def add(a, b): return a + b, and for i in range(10): print(i).

User: What is the capital of France? Assistant: The capital of France is Paris. User: Thank you for the help.
Assistant: You are welcome. Is there anything else you would like to know about the world, the weather or the
history of the old harbor town?
"""

# A Qwen-style ChatML template: `<|im_start|>role\ncontent<|im_end|>\n` per turn. `add_generation_prompt`
# opens the assistant turn; `enable_thinking=false` pre-fills an empty thinking block, as Qwen3.5 does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set content.text = content.text + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}{%- set content.text = content.text + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- elif part['type'] == 'video' -%}{%- set content.text = content.text + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set content = content.text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def build_tiny_tokenizer(path: str | os.PathLike) -> Path:
    """Train a small byte-level BPE on an embedded corpus and save it, Qwen-style, into folder `path`.

    Writes `tokenizer.json` and `tokenizer_config.json` (ChatML `chat_template`, eos `<|im_end|>`, pad
    `<|endoftext|>`). The vocabulary has exactly `TOKENIZER_BASE_VOCAB` byte-level entries followed by the
    `SPECIAL_TOKENS` (512 in all). Deterministic. Loads with `transformers.AutoTokenizer` (4.57 and 5.x).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_BASE_VOCAB,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_BASE_VOCAB:
        raise RuntimeError(
            f"the tiny BPE has {tok.get_vocab_size()} entries, expected {TOKENIZER_BASE_VOCAB}: the corpus is too short"
        )
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=t not in _NON_SPECIAL, normalized=False, lstrip=False, rstrip=False) for t in SPECIAL_TOKENS]
    )
    for t in SPECIAL_TOKENS:
        got = tok.token_to_id(t)
        if got != special_token_id(t):
            raise RuntimeError(f"special token {t} got id {got}, expected {special_token_id(t)}")
    tok.save(str(path / "tokenizer.json"), pretty=True)

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(special_token_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t not in _NON_SPECIAL,
            }
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", tokenizer_config)
    return path


# ----------------------------------------------------------------------------------------------- configs


def _layer_types(pattern_repeats: int) -> list[str]:
    return (["linear_attention"] * 3 + ["full_attention"]) * pattern_repeats


def _text_config(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    mrope_section: list[int],
) -> dict[str, Any]:
    # Field for field the text_config of the real Qwen3.5 config.json (same keys, same order).
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "float32",
        "eos_token_id": IM_END_ID,
        "full_attention_interval": 4,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": _layer_types(num_hidden_layers // 4),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "vocab_size": TINY_VOCAB_SIZE,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": list(mrope_section),
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }


TINY_LAYOUTS: dict[str, dict[str, Any]] = {
    # 2B-shaped: as many DeltaNet value heads as key heads, tied embeddings; saved sharded.
    "tiny-2b": _text_config(
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,  # rotary dim 8 = 2 * sum(mrope_section)
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        intermediate_size=256,
        tie_word_embeddings=True,
        mrope_section=[2, 1, 1],
    ),
    # 4B/9B-shaped: two value heads per key head, tied.
    "tiny-nv2x": _text_config(
        hidden_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=192,
        tie_word_embeddings=True,
        mrope_section=[2, 1, 1],
    ),
    # 27B-shaped: three value heads per key head, untied (lm_head.weight on disk); dk != dv on purpose.
    "tiny-nv3x": _text_config(
        hidden_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=12,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        intermediate_size=192,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
    ),
}

def _moe_text_config(*, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                     shared_expert_intermediate_size: int, **dense: Any) -> dict[str, Any]:
    # The text_config of the real Qwen3.5 MoE config.json (`qwen3_5_moe_text`): the dense keys without
    # `intermediate_size`, the expert sizes after `model_type`, as the published 35B-A3B file orders them.
    out: dict[str, Any] = {}
    for key, value in _text_config(intermediate_size=0, **dense).items():
        if key == "intermediate_size":
            continue
        if key == "model_type":
            out[key] = "qwen3_5_moe_text"
            out["moe_intermediate_size"] = moe_intermediate_size
            out["shared_expert_intermediate_size"] = shared_expert_intermediate_size
            out["num_experts"] = num_experts
            out["num_experts_per_tok"] = num_experts_per_tok
            continue
        out[key] = value
    return out


TINY_MOE_LAYOUTS: dict[str, dict[str, Any]] = {
    # 35B-A3B-shaped: two DeltaNet value heads per key head, untied, top-2 of 6 experts (6 does not divide by
    # TP 4), expert and shared-expert widths differing; saved with per-expert keys (what save_pretrained writes).
    "tiny-moe": _moe_text_config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # Top-1 routing over 4 experts, as many value heads as key heads; saved with the fused 3-D expert tensors.
    "tiny-moe-top1": _moe_text_config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    ),
}
# How each MoE layout stores its experts on disk: "per_expert" (`mlp.experts.N.{gate,up,down}_proj.weight`) or
# "fused" (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).
# transformers 5 reads both (conversion_mapping.py, the qwen2_moe rules).
MOE_EXPERT_FORMS = {"tiny-moe": "per_expert", "tiny-moe-top1": "fused"}

# Layouts saved as several safetensors shards (+ index json); the others are a single model.safetensors.
_SHARDS = {"tiny-2b": 2, "tiny-nv2x": 1, "tiny-nv3x": 1, "tiny-moe": 2, "tiny-moe-top1": 1}


def _layout(layout: str) -> dict[str, Any]:
    if layout in TINY_LAYOUTS:
        return TINY_LAYOUTS[layout]
    if layout in TINY_MOE_LAYOUTS:
        return TINY_MOE_LAYOUTS[layout]
    raise ValueError(f"unknown tiny layout {layout!r}; choose one of {sorted(TINY_LAYOUTS) + sorted(TINY_MOE_LAYOUTS)}")


def _is_moe(t: dict[str, Any]) -> bool:
    return t["model_type"] == "qwen3_5_moe_text"


def tiny_text_config(layout: str = "tiny-2b", dtype: str = "float32") -> dict[str, Any]:
    """A copy of the text config of `layout` (the `text_config` of its config.json)."""
    text = json.loads(json.dumps(_layout(layout)))
    text["dtype"] = dtype
    return text


def tiny_vision_config(layout: str = "tiny-2b") -> dict[str, Any]:
    """A small vision tower config, with the real file's fields (and its `model_type: "qwen3_5"`)."""
    return {
        "deepstack_visual_indexes": [],
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        # The MoE checkpoints' file says "qwen3_5_moe" here (transformers reads it as qwen3_5_moe_vision).
        "model_type": "qwen3_5_moe" if _is_moe(_layout(layout)) else "qwen3_5",
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": _layout(layout)["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def tiny_full_config(layout: str = "tiny-2b", dtype: str = "float32") -> dict[str, Any]:
    """The nested `config.json` of a tiny checkpoint, shaped like the real Qwen3.5 one."""
    text = tiny_text_config(layout, dtype)
    moe = _is_moe(text)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": special_token_id("<|image_pad|>"),
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.0.dev0",
        "video_token_id": special_token_id("<|video_pad|>"),
        "vision_config": tiny_vision_config(layout),
        "vision_end_token_id": special_token_id("<|vision_end|>"),
        "vision_start_token_id": special_token_id("<|vision_start|>"),
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "do_sample": True,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.57.0.dev0",
    }


# ----------------------------------------------------------------------------------------------- weights

# Target standard deviation of the final logits across the vocabulary. 1.0 keeps the logits far from
# flat (greedy margins ~0.1-1) while fp32 rounding, which random deep models amplify layer after layer,
# stays well inside the 1e-4 parity tolerance (at std 3, fp32 transformers is itself ~1e-3 from float64).
_LOGIT_STD = 1.0


class _Init:
    """Deterministic per-tensor random draws: each tensor has its own PCG64 stream keyed by (seed, name)."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode("utf-8"))])

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        x = self.rng(name).standard_normal(shape, dtype=np.float64) * std + mean
        return x.astype(np.float32)

    def linear(self, name: str, out_features: int, in_features: int) -> np.ndarray:
        return self.normal(name, (out_features, in_features), 1.0 / np.sqrt(in_features))

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
        return self.rng(name).uniform(low, high, size=shape).astype(np.float32)


def _norm_weight(init: _Init, name: str, dim: int) -> np.ndarray:
    # Qwen3.5 RMSNorm scales by (1 + w): small random values around 0.
    return init.normal(name, (dim,), 0.1)


def _mlp(init: _Init, p: str, hidden: int, inter: int, sd: dict[str, np.ndarray]) -> None:
    sd[p + "mlp.gate_proj.weight"] = init.linear(p + "mlp.gate_proj.weight", inter, hidden)
    sd[p + "mlp.up_proj.weight"] = init.linear(p + "mlp.up_proj.weight", inter, hidden)
    sd[p + "mlp.down_proj.weight"] = init.linear(p + "mlp.down_proj.weight", hidden, inter)


def _attention(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    h, hd = t["hidden_size"], t["head_dim"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    a = p + "self_attn."
    # q_proj rows: per head [query (head_dim) | output gate (head_dim)], head after head.
    sd[a + "q_proj.weight"] = init.linear(a + "q_proj.weight", 2 * nq * hd, h)
    sd[a + "k_proj.weight"] = init.linear(a + "k_proj.weight", nkv * hd, h)
    sd[a + "v_proj.weight"] = init.linear(a + "v_proj.weight", nkv * hd, h)
    sd[a + "o_proj.weight"] = init.linear(a + "o_proj.weight", h, nq * hd)
    sd[a + "q_norm.weight"] = _norm_weight(init, a + "q_norm.weight", hd)
    sd[a + "k_norm.weight"] = _norm_weight(init, a + "k_norm.weight", hd)


def _deltanet(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    h = t["hidden_size"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    a = p + "linear_attn."
    # in_proj_qkv rows: [q (nk*dk) | k (nk*dk) | v (nv*dv)].
    qkv = init.linear(a + "in_proj_qkv.weight", conv_dim, h)
    conv = init.normal(a + "conv1d.weight", (conv_dim, 1, t["linear_conv_kernel_dim"]), 0.5)
    # Queries correlated with keys (as trained models' are), so that q.k, and with it the DeltaNet output,
    # stays away from zero: the gated RMSNorm scales a near-zero output by up to 1/sqrt(eps) = 1000, which
    # turns fp32 rounding into logit errors that no implementation can hold to 1e-4.
    kd = nk * dk
    qkv[:kd] = 0.8 * qkv[kd : 2 * kd] + 0.6 * qkv[:kd]
    conv[:kd] = 0.8 * conv[kd : 2 * kd] + 0.6 * conv[:kd]
    sd[a + "in_proj_qkv.weight"] = qkv
    sd[a + "in_proj_z.weight"] = init.linear(a + "in_proj_z.weight", nv * dv, h)
    sd[a + "in_proj_b.weight"] = init.linear(a + "in_proj_b.weight", nv, h)
    sd[a + "in_proj_a.weight"] = init.linear(a + "in_proj_a.weight", nv, h)
    sd[a + "conv1d.weight"] = conv
    # Decay rates A log-uniform in [0.01, 2]: per-token decays exp(-A softplus(.)) from ~0.99 down to ~0.07, so
    # that some heads remember across many chunks (a recurrence bug at a chunk boundary cannot hide) and random
    # near-orthogonal q.k products do not make the model chaotic (fast-decaying heads amplify fp32 rounding).
    sd[a + "A_log"] = init.uniform(a + "A_log", (nv,), np.log(0.01), np.log(2.0))
    sd[a + "dt_bias"] = init.normal(a + "dt_bias", (nv,), 0.1, mean=1.0)
    # The gated RMSNorm multiplies by w itself (not 1 + w): around 1.
    sd[a + "norm.weight"] = init.normal(a + "norm.weight", (dv,), 0.1, mean=1.0)
    sd[a + "out_proj.weight"] = init.linear(a + "out_proj.weight", h, nv * dv)


def _sparse_moe(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray], form: str) -> None:
    h, e, inter = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    m = p + "mlp."
    # Router rows ~ 1/sqrt(h): logits of std ~1, so the routing is neither flat nor one-hot.
    sd[m + "gate.weight"] = init.linear(m + "gate.weight", e, h)
    # Both on-disk forms come from the same draws: a layout gives the same model in either form.
    gate_up = init.normal(m + "experts.gate_up_proj", (e, 2 * inter, h), 1.0 / np.sqrt(h))
    down = init.normal(m + "experts.down_proj", (e, h, inter), 1.0 / np.sqrt(inter))
    if form == "fused":
        sd[m + "experts.gate_up_proj"] = gate_up
        sd[m + "experts.down_proj"] = down
    else:
        for i in range(e):
            sd[f"{m}experts.{i}.gate_proj.weight"] = np.ascontiguousarray(gate_up[i, :inter])
            sd[f"{m}experts.{i}.up_proj.weight"] = np.ascontiguousarray(gate_up[i, inter:])
            sd[f"{m}experts.{i}.down_proj.weight"] = np.ascontiguousarray(down[i])
    shared = t["shared_expert_intermediate_size"]
    sd[m + "shared_expert.gate_proj.weight"] = init.linear(m + "shared_expert.gate_proj.weight", shared, h)
    sd[m + "shared_expert.up_proj.weight"] = init.linear(m + "shared_expert.up_proj.weight", shared, h)
    sd[m + "shared_expert.down_proj.weight"] = init.linear(m + "shared_expert.down_proj.weight", h, shared)
    sd[m + "shared_expert_gate.weight"] = init.linear(m + "shared_expert_gate.weight", 1, h)


def _decoder_layer(init: _Init, p: str, t: dict[str, Any], layer_type: str, sd: dict[str, np.ndarray],
                   expert_form: str = "fused") -> None:
    h = t["hidden_size"]
    if layer_type == "linear_attention":
        _deltanet(init, p, t, sd)
    else:
        _attention(init, p, t, sd)
    if _is_moe(t):
        _sparse_moe(init, p, t, sd, expert_form)
    else:
        _mlp(init, p, h, t["intermediate_size"], sd)
    sd[p + "input_layernorm.weight"] = _norm_weight(init, p + "input_layernorm.weight", h)
    sd[p + "post_attention_layernorm.weight"] = _norm_weight(init, p + "post_attention_layernorm.weight", h)


def _vision(init: _Init, v: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    p = "model.visual."
    e, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    ps, tps, cin = v["patch_size"], v["temporal_patch_size"], v["in_channels"]
    merged = e * v["spatial_merge_size"] ** 2
    fan_in = cin * tps * ps * ps

    def lin(name: str, o: int, i: int) -> None:
        sd[name + ".weight"] = init.linear(name + ".weight", o, i)
        sd[name + ".bias"] = init.normal(name + ".bias", (o,), 0.02)

    def layer_norm(name: str, dim: int) -> None:
        sd[name + ".weight"] = init.normal(name + ".weight", (dim,), 0.1, mean=1.0)
        sd[name + ".bias"] = init.normal(name + ".bias", (dim,), 0.02)

    sd[p + "patch_embed.proj.weight"] = init.normal(p + "patch_embed.proj.weight", (e, cin, tps, ps, ps), 1 / np.sqrt(fan_in))
    sd[p + "patch_embed.proj.bias"] = init.normal(p + "patch_embed.proj.bias", (e,), 0.02)
    sd[p + "pos_embed.weight"] = init.normal(p + "pos_embed.weight", (v["num_position_embeddings"], e), 0.02)
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        layer_norm(b + "norm1", e)
        layer_norm(b + "norm2", e)
        lin(b + "attn.qkv", 3 * e, e)
        lin(b + "attn.proj", e, e)
        lin(b + "mlp.linear_fc1", inter, e)
        lin(b + "mlp.linear_fc2", e, inter)
    layer_norm(p + "merger.norm", e)
    lin(p + "merger.linear_fc1", merged, merged)
    lin(p + "merger.linear_fc2", out, merged)


def _mtp(init: _Init, t: dict[str, Any], sd: dict[str, np.ndarray], expert_form: str = "fused") -> None:
    # Multi-token-prediction head as the real checkpoints ship it (transformers ignores `mtp.*`): the
    # normalized embedding and hidden state are concatenated, projected by `fc`, then one full-attention
    # decoder layer and a final norm.
    h = t["hidden_size"]
    sd["mtp.fc.weight"] = init.linear("mtp.fc.weight", h, 2 * h)
    sd["mtp.pre_fc_norm_embedding.weight"] = _norm_weight(init, "mtp.pre_fc_norm_embedding.weight", h)
    sd["mtp.pre_fc_norm_hidden.weight"] = _norm_weight(init, "mtp.pre_fc_norm_hidden.weight", h)
    for i in range(t["mtp_num_hidden_layers"]):
        _decoder_layer(init, f"mtp.layers.{i}.", t, "full_attention", sd, expert_form)
    sd["mtp.norm.weight"] = _norm_weight(init, "mtp.norm.weight", h)


def tiny_state_dict(layout: str = "tiny-2b", seed: int = 0, expert_form: str | None = None) -> dict[str, np.ndarray]:
    """All tensors of a tiny checkpoint (float32 numpy arrays), keyed by their real on-disk names.

    `expert_form` (MoE layouts): "fused" or "per_expert" (default: the layout's, MOE_EXPERT_FORMS)."""
    t = _layout(layout)
    expert_form = expert_form or MOE_EXPERT_FORMS.get(layout, "fused")
    if expert_form not in ("fused", "per_expert"):
        raise ValueError(f"expert_form {expert_form!r}: choose 'fused' or 'per_expert'")
    init = _Init(seed)
    h, vocab = t["hidden_size"], t["vocab_size"]
    sd: dict[str, np.ndarray] = {}
    # With a (1 + w) ~ 1 final norm the normalized hidden state has rms ~1, so logits have std ~ sqrt(h) * std(W).
    out_std = _LOGIT_STD / np.sqrt(h)
    lm = "model.language_model."
    sd[lm + "embed_tokens.weight"] = init.normal(lm + "embed_tokens.weight", (vocab, h), out_std)
    for i, layer_type in enumerate(t["layer_types"]):
        _decoder_layer(init, f"{lm}layers.{i}.", t, layer_type, sd, expert_form)
    sd[lm + "norm.weight"] = _norm_weight(init, lm + "norm.weight", h)
    if not t["tie_word_embeddings"]:
        sd["lm_head.weight"] = init.normal("lm_head.weight", (vocab, h), out_std)
    _vision(init, tiny_vision_config(layout), sd)
    _mtp(init, t, sd, expert_form)
    return sd


# ----------------------------------------------------------------------------------------------- safetensors

_DTYPES = ("float32", "float16", "bfloat16")
_ST_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_safetensors(file: str | os.PathLike, tensors: dict[str, np.ndarray], dtype: str = "float32") -> int:
    """Write `tensors` cast to `dtype` with the safetensors library, metadata {"format": "pt"} as transformers
    writes it. The library lays tensors out deterministically, so equal inputs give equal files.
    Returns the number of data bytes."""
    import torch
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(_DTYPES)}")
    cast = {n: torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)).to(getattr(torch, dtype)) for n, t in tensors.items()}
    save_file(cast, os.fspath(file), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in cast.values())


def read_safetensors(file: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """({name: {"dtype", "shape"}}, raw bytes per tensor) of a safetensors file; used to compare checkpoints bitwise."""
    import torch
    from safetensors import safe_open

    codes = {getattr(torch, d): c for d, c in _ST_CODES.items()}
    header, raw = {}, {}
    with safe_open(os.fspath(file), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).contiguous()
            header[name] = {"dtype": codes.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}
            raw[name] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return header, raw


# ----------------------------------------------------------------------------------------------- builder


def _write_json(file: Path, obj: Any) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# The image processor config a Qwen3.5 checkpoint ships (`preprocessor_config.json`: 16-pixel patches, 2 x 2 merge,
# 2 frames per temporal patch, mean and std 0.5), with smaller pixel bounds so that the tiny tests' images fit
# small image buckets: 16 to 128 patches (64 x 64 to about 181 x 181 pixels of a square image).
PREPROCESSOR_CONFIG = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 32768, "shortest_edge": 4096},
    "temporal_patch_size": 2,
}


def build_tiny_checkpoint(
    path: str | os.PathLike, layout: str = "tiny-2b", seed: int = 0, dtype: str = "float32",
    expert_form: str | None = None,
) -> Path:
    """Write a tiny random Qwen3.5 checkpoint into folder `path`, in the exact format of a real Hub snapshot.

    Files: config.json, generation_config.json, the weights (`model-0000i-of-0000n.safetensors` +
    `model.safetensors.index.json` for sharded layouts, else `model.safetensors`), tokenizer.json,
    tokenizer_config.json, preprocessor_config.json. `dtype` is the on-disk dtype: "float32", "bfloat16" or "float16".
    `expert_form` (MoE layouts): "fused" or "per_expert" expert tensors (default: the layout's, MOE_EXPERT_FORMS).
    Deterministic: the same arguments give byte-identical files on every machine.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(_DTYPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    _write_json(path / "config.json", tiny_full_config(layout, dtype))
    _write_json(path / "generation_config.json", _generation_config())

    sd = tiny_state_dict(layout, seed, expert_form)
    n_shards = _SHARDS[layout]
    if n_shards == 1:
        write_safetensors(path / "model.safetensors", sd, dtype)
    else:
        # Split the sorted names into n contiguous groups of about equal byte size.
        names = sorted(sd)
        itemsize = 4 if dtype == "float32" else 2
        sizes = [sd[n].size * itemsize for n in names]
        total = sum(sizes)
        groups: list[list[str]] = [[] for _ in range(n_shards)]
        acc = 0
        for name, size in zip(names, sizes):
            shard = min(int(acc * n_shards / total), n_shards - 1)
            groups[shard].append(name)
            acc += size
        weight_map = {}
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            write_safetensors(path / file, {n: sd[n] for n in group}, dtype)
            weight_map.update({n: file for n in group})
        index = {
            "metadata": {"total_parameters": int(sum(sd[n].size for n in names)), "total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(path / "model.safetensors.index.json", index)
    build_tiny_tokenizer(path)
    _write_json(path / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    return path
