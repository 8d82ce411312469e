"""The normalized Qwen3.5 text configuration.

A Qwen3.5 `config.json` is either the nested vision-language form (`model_type: "qwen3_5"` with a
`text_config`) or a bare text config (`model_type: "qwen3_5_text"`). `Qwen35Config` reads both into one
validated object that every other module uses, and knows which tensor-parallel degrees the head
counts allow.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelNotFoundError, UnsupportedModelError, UsageError

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


@dataclass(frozen=True)
class Qwen35Config:
    """Qwen3.5 dense text decoder hyper-parameters (the vision tower and MTP head are not used)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # Gated attention layers.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Gated DeltaNet layers.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    # Rotary embedding. Always taken from the file: the transformers default theta (1e4) is wrong for Qwen3.5.
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    # The original file, kept so that it can be saved unchanged next to compiled artifacts.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv1d: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ------------------------------------------------------------------ tensor parallelism
    def valid_tp_degrees(self) -> list[int]:
        """Degrees t that split every layer by whole heads.

        Attention query heads, DeltaNet key heads (and so value heads, which follow their key head) must
        divide by t. KV heads must divide by t or be replicated (t a multiple of the KV head count).
        The vocabulary is padded when it does not divide, so it never restricts t.
        """
        degrees = []
        for t in range(1, max(self.num_attention_heads, self.linear_num_key_heads) + 1):
            if self.num_attention_heads % t or self.linear_num_key_heads % t:
                continue
            kv = self.num_key_value_heads
            if kv % t and t % kv:
                continue
            degrees.append(t)
        return degrees

    def check_tp_degree(self, tp_degree: int) -> None:
        from .validation import positive_int  # noqa: PLC0415

        positive_int(tp_degree, "tensor_parallel_size")
        valid = self.valid_tp_degrees()
        if tp_degree not in valid:
            raise UsageError(
                f"tensor_parallel_size={tp_degree} does not split this model by whole heads "
                f"({self.num_attention_heads} attention heads, {self.num_key_value_heads} KV heads, "
                f"{self.linear_num_key_heads} DeltaNet key heads). Valid degrees: {valid}."
            )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "Qwen35Config":
        """Parse a Qwen3.5 config dict: nested (`qwen3_5` with `text_config`) or bare (`qwen3_5_text`)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " Mixture-of-experts Qwen3.5 models are not supported yet." if "moe" in str(model_type) else ""
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not a dense Qwen3.5 model; expected one of {SUPPORTED_MODEL_TYPES}.{hint}"
            )
        text = config.get("text_config") if model_type == "qwen3_5" else config
        if model_type == "qwen3_5" and not isinstance(text, dict):
            raise UnsupportedModelError("a `qwen3_5` config.json must hold a `text_config` object")
        if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
            raise UnsupportedModelError(
                f"text_config.model_type {text.get('model_type')!r} is not supported (expected 'qwen3_5_text')"
            )

        def get(name, default=dataclasses.MISSING):
            if name in text:
                return text[name]
            if name in config and model_type == "qwen3_5":
                return config[name]
            if default is dataclasses.MISSING:
                raise UnsupportedModelError(f"config.json has no `{name}` in its text config")
            return default

        num_layers = int(get("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"unknown layer types {unknown}; this model supports {list(LAYER_TYPES)}")
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
            )

        rope = dict(text.get("rope_parameters") or {})
        # Older files keep the rope fields at the top of the text config.
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in rope and key in text:
                rope[key] = text[key]
        if "rope_theta" not in rope:
            raise UnsupportedModelError("config.json has no rope_theta (in rope_parameters or the text config)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (only 'default')")

        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        eos = get("eos_token_id", None)
        cfg = cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim", 256)),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            # transformers' Qwen3.5 default: a quarter of each head is rotated.
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(get("max_position_embeddings", 262144)),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            bos_token_id=get("bos_token_id", None),
            pad_token_id=get("pad_token_id", None),
            hidden_act=str(get("hidden_act", "silu")),
            raw=config,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Qwen35Config":
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            from .validation import looks_like_hub_id, missing_folder_error  # noqa: PLC0415

            if not os.path.exists(path) and looks_like_hub_id(path):
                raise missing_folder_error(path, "this call")
            where = "no such folder" if not os.path.exists(path) else "a folder without it"
            raise ModelNotFoundError(f"no config.json at {path!r} ({where}): pass a Qwen3.5 checkpoint folder")
        with open(file, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except ValueError as e:
                raise UnsupportedModelError(f"{file} is not valid JSON ({e}); re-download or fix it") from None
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"{file} does not hold a JSON object; it is not a model config")
        return cls.from_dict(raw)

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedModelError(
                f"partial_rotary_factor {self.partial_rotary_factor} x head_dim {self.head_dim} must give an even "
                "rotary dimension"
            )

    def to_text_dict(self) -> dict[str, Any]:
        """The bare text config (`qwen3_5_text`), as transformers writes it."""
        return {
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": self.hidden_act,
        }


def register_transformers_configs() -> bool:
    """Make `transformers.AutoConfig` read Qwen3.5 folders where the installed transformers (4.57) lacks
    `qwen3_5`. Does nothing on transformers >= 5. Returns True when it registered classes."""
    from . import hf_configs  # noqa: PLC0415 (imports transformers only when asked)

    return hf_configs.register()
