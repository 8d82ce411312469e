"""transformers configuration classes for Qwen3.5, for transformers releases that predate it (4.57).

optimum-neuron 0.4.x pins transformers ~= 4.57, which has no `qwen3_5` nor `qwen3_5_moe`, so
`AutoConfig.from_pretrained` on a Qwen3.5 folder fails there. `register()` adds these classes to AutoConfig, and
only when the installed transformers lacks its own (transformers >= 5 ships them, and those are always preferred).
The MoE classes carry the fields transformers 5.24's `Qwen3_5MoeTextConfig` names (no `intermediate_size`).
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


class Qwen3_5MoeTextConfig(Qwen3_5TextConfig):
    """`qwen3_5_moe_text`: the dense text fields without `intermediate_size`, plus the experts'."""

    model_type = "qwen3_5_moe_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        hidden_size=2048,
        num_hidden_layers=40,
        num_key_value_heads=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts_per_tok=8,
        num_experts=256,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        **kwargs,
    ):
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        # The dense class sets the shared fields (the 35B-A3B's defaults where they differ); the MoE text config has
        # no intermediate_size, as transformers' has none.
        kwargs.pop("intermediate_size", None)
        super().__init__(
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=None,
            **kwargs,
        )
        del self.intermediate_size


class Qwen3_5VisionConfig(PretrainedConfig):
    """Kept as written in the file: this package runs the text decoder only."""

    model_type = "qwen3_5_vision"
    base_config_key = "vision_config"


class Qwen3_5MoeVisionConfig(Qwen3_5VisionConfig):
    """The MoE checkpoints' file names the tower's model_type "qwen3_5_moe"; kept as written, like the dense one."""

    model_type = "qwen3_5_moe_vision"


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
            text_config = self.sub_configs["text_config"](**text_config)
        self.text_config = text_config if text_config is not None else self.sub_configs["text_config"]()
        if isinstance(vision_config, dict):
            vision_config = {k: v for k, v in vision_config.items() if k != "model_type"}
            vision_config = self.sub_configs["vision_config"](**vision_config)
        self.vision_config = vision_config if vision_config is not None else self.sub_configs["vision_config"]()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class Qwen3_5MoeConfig(Qwen3_5Config):
    model_type = "qwen3_5_moe"
    sub_configs = {"text_config": Qwen3_5MoeTextConfig, "vision_config": Qwen3_5MoeVisionConfig}


def register() -> bool:
    """Register the classes above with AutoConfig where transformers lacks `qwen3_5` (and `qwen3_5_moe`). True if it
    registered any."""
    done = False
    for text, nested in ((Qwen3_5TextConfig, Qwen3_5Config), (Qwen3_5MoeTextConfig, Qwen3_5MoeConfig)):
        if nested.model_type not in CONFIG_MAPPING:
            AutoConfig.register(text.model_type, text)
            AutoConfig.register(nested.model_type, nested)
            done = True
    return done


# The start-up hook registers these classes when transformers is imported; where this module is the first importer
# of transformers, the hook finds it half built and leaves the registration to this line.
register()
