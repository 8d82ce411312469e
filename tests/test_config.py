import json
from pathlib import Path

import pytest

from optimum_qwen35 import Qwen35Config, UnsupportedModelError
from optimum_qwen35.config import FULL_ATTENTION

# The config.json of Qwen/Qwen3.5-0.8B as published (the vision-language wrapper with a nested text_config).
REAL_CONFIG = Path(__file__).parent / "qwen3.5-0.8b.config.json"

# The dense sizes of ANCHORS.md: hidden, layers, heads, kv heads, intermediate, linear key/value heads, tied.
SIZES = {
    "0.8B": (1024, 24, 8, 2, 3584, 16, 16, True),
    "2B": (2048, 24, 8, 2, 6144, 16, 16, True),
    "4B": (2560, 32, 16, 4, 9216, 16, 32, True),
    "9B": (4096, 32, 16, 4, 12288, 16, 32, False),
    "27B": (5120, 64, 24, 4, 17408, 16, 48, False),
}


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def sized_config(size: str) -> dict:
    hidden, layers, heads, kv, inter, nk, nv, tied = SIZES[size]
    cfg = real_config()
    t = cfg["text_config"]
    t.update(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, linear_num_key_heads=nk, linear_num_value_heads=nv, tie_word_embeddings=tied,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    cfg["tie_word_embeddings"] = tied
    return cfg


def test_real_config_parses():
    c = Qwen35Config.from_dict(real_config())
    assert c.hidden_size == 1024 and c.num_hidden_layers == 24 and c.vocab_size == 248320
    assert c.layer_types.count(FULL_ATTENTION) == 6 and c.layer_types[3] == FULL_ATTENTION
    assert c.rope_theta == 1e7 and c.partial_rotary_factor == 0.25 and c.rotary_dim == 64
    assert c.mrope_section == (11, 11, 10) and c.mrope_interleaved
    assert c.tie_word_embeddings and c.eos_token_id == 248044 and c.rms_norm_eps == 1e-6
    assert c.linear_conv_dim == 3 * 16 * 128 and c.linear_layers == [i for i in range(24) if (i + 1) % 4]


@pytest.mark.parametrize("size", SIZES)
def test_every_dense_size(size):
    hidden, layers, heads, kv, inter, nk, nv, tied = SIZES[size]
    c = Qwen35Config.from_dict(sized_config(size))
    assert (c.hidden_size, c.num_hidden_layers, c.linear_num_value_heads) == (hidden, layers, nv)
    assert c.linear_value_heads_per_key_head == nv // nk
    assert c.tie_word_embeddings == tied
    assert len(c.attention_layers) == layers // 4


@pytest.mark.parametrize(
    "size, degrees",
    [("0.8B", [1, 2, 4, 8]), ("2B", [1, 2, 4, 8]), ("4B", [1, 2, 4, 8, 16]), ("9B", [1, 2, 4, 8, 16]), ("27B", [1, 2, 4, 8])],
)
def test_valid_tp_degrees(size, degrees):
    c = Qwen35Config.from_dict(sized_config(size))
    assert c.valid_tp_degrees() == degrees
    for t in degrees:
        c.check_tp_degree(t)


def test_invalid_tp_degree_names_valid_ones():
    c = Qwen35Config.from_dict(sized_config("2B"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*Valid degrees: \[1, 2, 4, 8\]"):
        c.check_tp_degree(3)


def test_bare_text_config_and_interval_fallback():
    text = real_config()["text_config"]
    del text["layer_types"]
    text["full_attention_interval"] = 4
    c = Qwen35Config.from_dict(text)
    assert c.layer_types == Qwen35Config.from_dict(real_config()).layer_types


def test_rope_theta_is_read_from_the_file():
    cfg = real_config()
    cfg["text_config"]["rope_parameters"]["rope_theta"] = 1234.0
    assert Qwen35Config.from_dict(cfg).rope_theta == 1234.0
    del cfg["text_config"]["rope_parameters"]["rope_theta"]
    with pytest.raises(UnsupportedModelError, match="rope_theta"):
        Qwen35Config.from_dict(cfg)


def test_from_pretrained_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(real_config()))
    assert Qwen35Config.from_pretrained(tmp_path).hidden_size == 1024
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Qwen35Config.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="qwen3_5_moe"), "expected 'qwen3_5_moe_text'"),
        (lambda c: c.update(model_type="llama"), "not a Qwen3.5 model"),
        (lambda c: c["text_config"]["layer_types"].__setitem__(0, "sliding_attention"), "unknown layer types"),
        (lambda c: c["text_config"].update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda c: c["text_config"].update(linear_num_value_heads=24), "multiple of linear_num_key_heads"),
        (lambda c: c["text_config"].pop("hidden_size"), "no `hidden_size`"),
        (lambda c: c["text_config"].update(num_hidden_layers=23), "layer_types has 24 entries"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    ],
)
def test_unsupported_variants_get_clear_errors(edit, message):
    cfg = real_config()
    edit(cfg)
    with pytest.raises(UnsupportedModelError, match=message):
        Qwen35Config.from_dict(cfg)


def test_transformers_autoconfig_reads_qwen35_folders(tmp_path):
    """On transformers 4.57 our classes are registered; on >= 5 transformers' own are used."""
    import transformers

    import optimum_qwen35  # noqa: F401  (registers where needed)

    (tmp_path / "config.json").write_text(json.dumps(real_config()))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "qwen3_5"
    text = config.get_text_config()
    assert text.hidden_size == 1024 and text.linear_num_value_heads == 16
    assert text.layer_types[3] == "full_attention"
    own = type(config).__module__.startswith("optimum_qwen35")
    assert own == (int(transformers.__version__.split(".")[0]) < 5)
    assert not optimum_qwen35.register_transformers_configs()  # idempotent: never registers twice


def test_partial_rotary_factor_defaults_as_in_transformers():
    """A config without partial_rotary_factor rotates a quarter of each head, as transformers' Qwen3.5 does."""
    from tests.kit import tiny_text_config

    text = tiny_text_config("tiny-2b")
    text["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items() if k != "partial_rotary_factor"}
    c = Qwen35Config.from_dict(text)
    assert c.partial_rotary_factor == 0.25 and c.rotary_dim == text["head_dim"] // 4
