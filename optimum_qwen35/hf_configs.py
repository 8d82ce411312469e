"""transformers configuration classes for Qwen3.5, for transformers releases that predate it (4.57).

optimum-neuron 0.4.x pins transformers ~= 4.57, which has no `qwen3_5`, so `AutoConfig.from_pretrained`
on a Qwen3.5 folder fails there. `register()` adds these classes to AutoConfig, and only when the
installed transformers lacks its own (transformers >= 5 ships them, and those are always preferred).
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class Qwen3_5TextConfig(PretrainedConfig):
    model_type = "qwen3_5_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters=None,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=None,
        full_attention_interval=4,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters or {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        }
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.layer_types = layer_types or [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)
        ]
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class Qwen3_5VisionConfig(PretrainedConfig):
    """Kept as written in the file: this package runs the text decoder only."""

    model_type = "qwen3_5_vision"
    base_config_key = "vision_config"


class Qwen3_5Config(PretrainedConfig):
    model_type = "qwen3_5"
    sub_configs = {"text_config": Qwen3_5TextConfig, "vision_config": Qwen3_5VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, text_config=None, vision_config=None, tie_word_embeddings=False, **kwargs):
        if isinstance(text_config, dict):
            # optimum-neuron reads the dtype from the text config: one without it inherits the file's, or
            # bfloat16 (the dtype of every published Qwen3.5 checkpoint).
            dtype = kwargs.get("dtype") or kwargs.get("torch_dtype") or "bfloat16"
            text_config = {"dtype": dtype, **{k: v for k, v in text_config.items() if v is not None or k != "dtype"}}
            if text_config.get("torch_dtype") and "dtype" not in text_config:
                text_config["dtype"] = text_config["torch_dtype"]
            text_config = Qwen3_5TextConfig(**text_config)
        self.text_config = text_config if text_config is not None else Qwen3_5TextConfig()
        if isinstance(vision_config, dict):
            vision_config = {k: v for k, v in vision_config.items() if k != "model_type"}
            vision_config = Qwen3_5VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else Qwen3_5VisionConfig()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def register() -> bool:
    """Register the classes above with AutoConfig where transformers lacks `qwen3_5`. True if it did."""
    if "qwen3_5" in CONFIG_MAPPING:
        return False
    AutoConfig.register("qwen3_5_text", Qwen3_5TextConfig)
    AutoConfig.register("qwen3_5", Qwen3_5Config)
    return True
