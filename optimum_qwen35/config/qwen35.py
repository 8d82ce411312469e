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

from optimum_qwen35.errors import ModelNotFoundError, UnsupportedModelError, UsageError

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# The nested (vision-language) model types and the text config type each one holds.
NESTED_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# Model types of the same family's names that are other architectures: refused with what they are.
OTHER_ARCHITECTURES = {
    "qwen4_exp": "Qwen3.8-Flash-Next (`qwen4_exp`) is a different architecture, not Qwen3.5's hybrid decoder",
}
# The dtype the DeltaNet recurrent state is kept in (`mamba_ssm_dtype` of the text config): every published Qwen3.5,
# Qwen3.6 and Qwen3.8 config says float32, which is what every target keeps, whatever the model dtype.
STATE_DTYPES = ("float32", "torch.float32")
# expert_parallel_mode's rule: the fewest intermediate rows of an expert a rank may hold when experts are split.
MIN_EXPERT_ROWS_PER_RANK = 128


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
    # Mixture of experts (`qwen3_5_moe`; 0 for the dense models): every layer's MLP is a sparse block of
    # `num_experts` routed experts (top `num_experts_per_tok`) plus one shared expert (modeling/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # How tensor parallelism splits the routed experts: "ep" (expert parallel: each rank a block of whole
    # experts), "tp" (every expert split along its intermediate size) or "auto" (`expert_parallel_mode`). Not a
    # config.json field: set with `dataclasses.replace(config, moe_parallel=...)`.
    moe_parallel: str = "auto"
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mtp_num_hidden_layers(self) -> int:
        """Layers of the multi-token-prediction head (`mtp.*`, modeling/mtp.py): the text config's field, 0 without.
        Read from the raw config, not a field: the plain model never uses it (and configs compare without it)."""
        text = self.raw.get("text_config", self.raw) if isinstance(self.raw, dict) else {}
        return int(text.get("mtp_num_hidden_layers", 0) or 0)

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

    def expert_parallel_mode(self, tp_degree: int) -> str:
        """How `tp_degree` ranks split the routed experts: "ep" or "tp" ("tp" at degree 1: nothing is split).

        The rule for "auto" (docs/moe.md): split every expert ("tp") while each rank keeps at least
        MIN_EXPERT_ROWS_PER_RANK of an expert's intermediate rows (one full 128-partition tile on Neuron's TensorE,
        so the per-expert matmuls stay full-width); beyond that, give each rank whole experts ("ep"). Qwen3.5-35B-A3B
        (expert width 512): "tp" up to degree 4, "ep" at 8 and 16."""
        if tp_degree == 1 or not self.is_moe:
            return "tp"
        if self.moe_parallel not in ("auto", "ep", "tp"):
            raise UsageError(f"moe_parallel={self.moe_parallel!r}: choose 'auto', 'ep' or 'tp'")
        if self.moe_parallel != "auto":
            return self.moe_parallel
        return "tp" if self.moe_intermediate_size // tp_degree >= MIN_EXPERT_ROWS_PER_RANK else "ep"

    def check_tp_degree(self, tp_degree: int) -> None:
        from optimum_qwen35.validation import positive_int  # start-up time: validation imports torch, and `import optimum_qwen35` imports this module

        positive_int(tp_degree, "tensor_parallel_size")
        valid = self.valid_tp_degrees()
        if tp_degree not in valid:
            raise UsageError(
                f"tensor_parallel_size={tp_degree} does not split this model by whole heads "
                f"({self.num_attention_heads} attention heads, {self.num_key_value_heads} KV heads, "
                f"{self.linear_num_key_heads} DeltaNet key heads). Valid degrees: {valid}."
            )
        if self.is_moe and self.expert_parallel_mode(tp_degree) == "ep" and tp_degree > self.num_experts:
            raise UsageError(
                f"tensor_parallel_size={tp_degree} with expert parallelism leaves ranks without an expert "
                f"({self.num_experts} experts); use at most {self.num_experts} ranks or moe_parallel='tp'."
            )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "Qwen35Config":
        """Parse a Qwen3.5 config dict: nested (`qwen3_5` with `text_config`) or bare (`qwen3_5_text`)."""
        model_type = config.get("model_type")
        if model_type in OTHER_ARCHITECTURES:
            raise UnsupportedModelError(f"{OTHER_ARCHITECTURES[model_type]}: this package does not run it")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not a Qwen3.5 model; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        nested = model_type in NESTED_TEXT_TYPES
        text = config.get("text_config") if nested else config
        if nested and not isinstance(text, dict):
            raise UnsupportedModelError(f"a `{model_type}` config.json must hold a `text_config` object")
        text_type = NESTED_TEXT_TYPES.get(model_type, model_type)
        if text.get("model_type", text_type) != text_type:
            raise UnsupportedModelError(
                f"text_config.model_type {text.get('model_type')!r} is not supported in a {model_type!r} config "
                f"(expected {text_type!r})"
            )
        moe = text_type == "qwen3_5_moe_text"

        def get(name, default=dataclasses.MISSING):
            if name in text:
                return text[name]
            if name in config and nested:
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

        state_dtype = get("mamba_ssm_dtype", "float32")
        if state_dtype not in STATE_DTYPES:
            raise UnsupportedModelError(
                f"mamba_ssm_dtype {state_dtype!r}: this package keeps the DeltaNet recurrent state in float32 (what "
                "every Qwen3.5 / 3.6 / 3.8 config asks for); set mamba_ssm_dtype to \"float32\" in config.json"
            )
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        eos = get("eos_token_id", None)
        moe_fields = {}
        if moe:
            # transformers 5.24's qwen3_5_moe makes every layer sparse: a dense layer listed in `mlp_only_layers`
            # would have no `intermediate_size` to build it from, and transformers would build it sparse anyway.
            dense_layers = text.get("mlp_only_layers") or []
            if dense_layers:
                raise UnsupportedModelError(
                    f"mlp_only_layers={list(dense_layers)}: Qwen3.5 MoE layers are all sparse (transformers ignores "
                    "this field); a checkpoint with dense MLP layers is not a Qwen3.5 MoE checkpoint"
                )
            moe_fields = {
                "num_experts": int(get("num_experts", 256)),
                "num_experts_per_tok": int(get("num_experts_per_tok", 8)),
                "moe_intermediate_size": int(get("moe_intermediate_size", 512)),
                "shared_expert_intermediate_size": int(get("shared_expert_intermediate_size", 512)),
            }
        cfg = cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            # MoE configs have no dense MLP: 0.
            intermediate_size=0 if moe else int(get("intermediate_size")),
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
            **moe_fields,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Qwen35Config":
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            from optimum_qwen35.validation import looks_like_hub_id, missing_folder_error  # start-up time: validation imports torch, and `import optimum_qwen35` imports this module

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
        if self.moe_parallel not in ("auto", "ep", "tp"):
            raise UsageError(f"moe_parallel={self.moe_parallel!r}: choose 'auto', 'ep' or 'tp'")
        if self.is_moe and not (
            0 < self.num_experts_per_tok <= self.num_experts
            and self.moe_intermediate_size > 0
            and self.shared_expert_intermediate_size > 0
        ):
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts}), "
                f"moe_intermediate_size ({self.moe_intermediate_size}) and shared_expert_intermediate_size "
                f"({self.shared_expert_intermediate_size}) positive"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedModelError(
                f"partial_rotary_factor {self.partial_rotary_factor} x head_dim {self.head_dim} must give an even "
                "rotary dimension"
            )

    def to_text_dict(self) -> dict[str, Any]:
        """The bare text config (`qwen3_5_text`, or `qwen3_5_moe_text`), as transformers writes it."""
        sizes = (
            {
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
            }
            if self.is_moe
            else {"intermediate_size": self.intermediate_size}
        )
        return {
            "model_type": "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            **sizes,
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
    from optimum_qwen35.config import transformers_configs as hf_configs  # noqa: PLC0415 (imports transformers only when asked)

    if not hasattr(hf_configs, "register"):
        return False  # hf_configs is the importer of transformers, half built: it registers itself once built
    return hf_configs.register()
