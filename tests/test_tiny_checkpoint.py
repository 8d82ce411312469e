"""The tiny random Qwen3.5 checkpoints: on-disk format, determinism, tokenizer, committed fixtures.

Runs in every environment (no transformers >= 5 needed); the tokenizer tests use whichever transformers is
installed. That transformers' own Qwen3.5 loads these files without a missing or unexpected key is checked
by tests/fixtures/make_reference.py (see test_fixtures_current.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from optimum_qwen35 import Qwen35Config
from tests.kit import (
    SPECIAL_TOKENS,
    TINY_LAYOUTS,
    build_tiny_checkpoint,
    read_safetensors,
    special_token_id,
    write_safetensors,
)

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = sorted(TINY_LAYOUTS)

# The keys of the real Qwen3.5-0.8B config.json (text_config and vision_config), so the tiny files keep every field.
REAL_TOP_KEYS = {
    "architectures", "image_token_id", "model_type", "text_config", "tie_word_embeddings", "transformers_version",
    "video_token_id", "vision_config", "vision_end_token_id", "vision_start_token_id",
}  # fmt: skip
REAL_TEXT_KEYS = {
    "attention_bias", "attention_dropout", "attn_output_gate", "dtype", "eos_token_id", "full_attention_interval",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_value_head_dim", "max_position_embeddings", "mlp_only_layers", "model_type", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "rms_norm_eps", "tie_word_embeddings", "use_cache", "vocab_size", "mamba_ssm_dtype", "rope_parameters",
}  # fmt: skip
REAL_VISION_KEYS = {
    "deepstack_visual_indexes", "depth", "hidden_act", "hidden_size", "in_channels", "initializer_range",
    "intermediate_size", "model_type", "num_heads", "num_position_embeddings", "out_hidden_size", "patch_size",
    "spatial_merge_size", "temporal_patch_size",
}  # fmt: skip


def _load_make_reference():
    spec = importlib.util.spec_from_file_location("make_reference", FIXTURES / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_tensors(folder: Path) -> dict[str, tuple[str, dict]]:
    """name -> (file, header entry) over every safetensors file of the folder."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        header, _ = read_safetensors(file)
        for name, entry in header.items():
            assert name not in out, f"{name} is in two files"
            out[name] = (file.name, entry)
    return out


def _expected_text_shapes(t: dict) -> dict[str, tuple[int, ...]]:
    """Shapes of the text decoder tensors, written from the Qwen3.5 architecture (not from the builder)."""
    h, hd = t["hidden_size"], t["head_dim"]
    nk, nv, dk, dv = (t[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    shapes = {"model.language_model.embed_tokens.weight": (t["vocab_size"], h), "model.language_model.norm.weight": (h,)}

    def layer(p, kind):
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkv.weight": (2 * nk * dk + nv * dv, h), a + "in_proj_z.weight": (nv * dv, h),
                a + "in_proj_b.weight": (nv, h), a + "in_proj_a.weight": (nv, h),
                a + "conv1d.weight": (2 * nk * dk + nv * dv, 1, t["linear_conv_kernel_dim"]),
                a + "A_log": (nv,), a + "dt_bias": (nv,), a + "norm.weight": (dv,), a + "out_proj.weight": (h, nv * dv),
            })  # fmt: skip
        else:
            a = p + "self_attn."
            nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
            shapes.update({
                a + "q_proj.weight": (2 * nq * hd, h), a + "k_proj.weight": (nkv * hd, h),
                a + "v_proj.weight": (nkv * hd, h), a + "o_proj.weight": (h, nq * hd),
                a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
            })  # fmt: skip
        i = t["intermediate_size"]
        shapes.update({
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip

    for n, kind in enumerate(t["layer_types"]):
        layer(f"model.language_model.layers.{n}.", kind)
    layer("mtp.layers.0.", "full_attention")
    shapes.update({
        "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
    })  # fmt: skip
    if not t["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (t["vocab_size"], h)
    return shapes


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {layout: build_tiny_checkpoint(root / layout, layout) for layout in LAYOUTS}


def test_layouts_are_the_requested_shapes():
    t = TINY_LAYOUTS
    assert set(t) == {"tiny-2b", "tiny-nv2x", "tiny-nv3x"}
    assert t["tiny-2b"]["linear_num_value_heads"] == t["tiny-2b"]["linear_num_key_heads"]
    assert t["tiny-nv2x"]["linear_num_value_heads"] == 2 * t["tiny-nv2x"]["linear_num_key_heads"]
    assert t["tiny-nv3x"]["linear_num_value_heads"] == 3 * t["tiny-nv3x"]["linear_num_key_heads"]
    assert t["tiny-nv3x"]["linear_key_head_dim"] != t["tiny-nv3x"]["linear_value_head_dim"]
    assert [c["tie_word_embeddings"] for c in (t["tiny-2b"], t["tiny-nv2x"], t["tiny-nv3x"])] == [True, True, False]
    assert t["tiny-2b"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    for c in t.values():
        rope = c["rope_parameters"]
        rotary = int(c["head_dim"] * rope["partial_rotary_factor"])
        assert 2 * sum(rope["mrope_section"]) == rotary
        assert rope["rope_theta"] == 1e7 and rope["mrope_interleaved"] is True
        assert c["eos_token_id"] == special_token_id("<|im_end|>")
        assert c["vocab_size"] == 512


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_files(built, layout):
    folder = built[layout]
    cfg = json.loads((folder / "config.json").read_text())
    assert set(cfg) == REAL_TOP_KEYS
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert set(cfg["text_config"]) == REAL_TEXT_KEYS
    assert set(cfg["vision_config"]) == REAL_VISION_KEYS
    assert cfg["text_config"]["model_type"] == "qwen3_5_text"
    assert cfg["tie_word_embeddings"] == cfg["text_config"]["tie_word_embeddings"] == TINY_LAYOUTS[layout]["tie_word_embeddings"]
    assert cfg["vision_config"]["out_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert cfg["image_token_id"] == special_token_id("<|image_pad|>")
    assert cfg["video_token_id"] == special_token_id("<|video_pad|>")
    assert cfg["vision_start_token_id"] == special_token_id("<|vision_start|>")
    assert cfg["vision_end_token_id"] == special_token_id("<|vision_end|>")
    gen = json.loads((folder / "generation_config.json").read_text())
    assert special_token_id("<|im_end|>") in gen["eos_token_id"]

    parsed = Qwen35Config.from_pretrained(folder)
    t = TINY_LAYOUTS[layout]
    assert parsed.hidden_size == t["hidden_size"] and parsed.num_hidden_layers == t["num_hidden_layers"]
    assert parsed.linear_value_heads_per_key_head == t["linear_num_value_heads"] // t["linear_num_key_heads"]
    assert parsed.tie_word_embeddings == t["tie_word_embeddings"]
    assert parsed.rope_theta == 1e7 and parsed.rotary_dim == 8
    assert parsed.eos_token_ids == (special_token_id("<|im_end|>"),)
    assert parsed.attention_layers == [i for i, k in enumerate(t["layer_types"]) if k == "full_attention"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensor_names_and_shapes(built, layout):
    folder = built[layout]
    tensors = _all_tensors(folder)
    t = TINY_LAYOUTS[layout]
    expected = _expected_text_shapes(t)
    text_and_mtp = {k: tuple(v[1]["shape"]) for k, v in tensors.items() if not k.startswith("model.visual.")}
    assert set(text_and_mtp) == set(expected), (
        f"missing {sorted(set(expected) - set(text_and_mtp))}, extra {sorted(set(text_and_mtp) - set(expected))}"
    )
    for name, shape in expected.items():
        assert text_and_mtp[name] == shape, name
    assert ("lm_head.weight" in tensors) == (not t["tie_word_embeddings"])
    assert any(k.startswith("mtp.layers.0.self_attn.") for k in tensors)

    # The vision tower (names as transformers' Qwen3_5VisionModel has them; the full-load check is make_reference.py).
    v = json.loads((folder / "config.json").read_text())["vision_config"]
    visual = {k: tuple(e["shape"]) for k, (_, e) in tensors.items() if k.startswith("model.visual.")}
    e, ps = v["hidden_size"], v["patch_size"]
    assert visual["model.visual.patch_embed.proj.weight"] == (e, v["in_channels"], v["temporal_patch_size"], ps, ps)
    assert visual["model.visual.pos_embed.weight"] == (v["num_position_embeddings"], e)
    assert visual["model.visual.merger.linear_fc2.weight"] == (v["out_hidden_size"], e * v["spatial_merge_size"] ** 2)
    blocks = {k.split(".")[3] for k in visual if k.startswith("model.visual.blocks.")}
    assert blocks == {str(i) for i in range(v["depth"])}
    assert visual["model.visual.blocks.0.attn.qkv.weight"] == (3 * e, e)
    assert len(visual) == 3 + 12 * v["depth"] + 6

    # All tensors carry the safetensors metadata of a PyTorch checkpoint, in the requested dtype.
    for file in folder.glob("*.safetensors"):
        raw = file.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        assert header["__metadata__"] == {"format": "pt"}
        assert {e["dtype"] for k, e in header.items() if k != "__metadata__"} == {"F32"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_safetensors_library_reads_the_files(built, layout):
    from safetensors.numpy import load_file

    folder = built[layout]
    seen = {}
    for file in folder.glob("*.safetensors"):
        seen.update(load_file(file))
    sd = seen
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in sd.values())
    t = TINY_LAYOUTS[layout]
    lin = t["layer_types"].index("linear_attention")
    p = f"model.language_model.layers.{lin}.linear_attn."
    a = np.exp(sd[p + "A_log"])
    assert (a >= 0.01).all() and (a <= 2).all()
    assert abs(sd[p + "dt_bias"].mean() - 1) < 0.3
    assert abs(sd[p + "norm.weight"].mean() - 1) < 0.3  # the gated norm uses w itself
    assert abs(sd["model.language_model.norm.weight"].mean()) < 0.1  # the other norms use 1 + w
    assert sd[p + "conv1d.weight"].std() == pytest.approx(0.5, rel=0.2)


def test_sharded_index_is_consistent(built):
    folder = built["tiny-2b"]
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = _all_tensors(folder)
    assert index["weight_map"] == {k: f for k, (f, _) in tensors.items()}
    assert set(index["weight_map"].values()) == set(files)
    total = sum(int(np.prod(e["shape"])) * 4 for _, e in tensors.values())  # fp32
    assert index["metadata"]["total_size"] == total
    for layout in ("tiny-nv2x", "tiny-nv3x"):
        assert sorted(p.name for p in built[layout].glob("*.safetensors")) == ["model.safetensors"]
        assert not (built[layout] / "model.safetensors.index.json").exists()


def test_builder_is_deterministic(tmp_path, built):
    for layout in LAYOUTS:
        again = build_tiny_checkpoint(tmp_path / layout, layout)
        names = sorted(p.name for p in built[layout].iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        for name in names:
            assert (again / name).read_bytes() == (built[layout] / name).read_bytes(), f"{layout}/{name}"
    other = build_tiny_checkpoint(tmp_path / "seed1", "tiny-nv2x", seed=1)
    _, a = read_safetensors(other / "model.safetensors")
    _, b = read_safetensors(built["tiny-nv2x"] / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)


def test_bfloat16_checkpoint(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "bf16", "tiny-nv2x", dtype="bfloat16")
    header, raw = read_safetensors(folder / "model.safetensors")
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    _, raw32 = read_safetensors(build_tiny_checkpoint(tmp_path / "fp32", "tiny-nv2x") / "model.safetensors")
    name = "model.language_model.embed_tokens.weight"
    bf = (np.frombuffer(raw[name], "<u2").astype(np.uint32) << 16).view(np.float32)
    fp = np.frombuffer(raw32[name], "<f4")
    assert np.abs(bf - fp).max() <= np.abs(fp).max() * 2**-8
    with pytest.raises(ValueError):
        build_tiny_checkpoint(tmp_path / "bad", "tiny-nv2x", dtype="int8")
    with pytest.raises(ValueError):
        build_tiny_checkpoint(tmp_path / "bad", "tiny-7b")


def test_write_safetensors_roundtrip(tmp_path):
    from safetensors.numpy import load_file

    x = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones((3,), np.float32)}
    write_safetensors(tmp_path / "x.safetensors", x)
    y = load_file(tmp_path / "x.safetensors")
    assert set(y) == {"a", "b"} and all(np.array_equal(x[k], y[k]) for k in x)


# ----------------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("layout", ["tiny-2b"])
def test_tokenizer_loads_and_chat_template_renders(built, layout):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(built[layout])
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == special_token_id("<|im_end|>")
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == special_token_id("<|endoftext|>")
    for token in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(token) == special_token_id(token)
    assert all(i < TINY_LAYOUTS[layout]["vocab_size"] for i in tok.get_vocab().values())

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("France?<|im_end|>\n")
    no_think = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    ids = tok.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == special_token_id("<|im_start|>")
    assert ids.count(special_token_id("<|im_end|>")) == 2
    assert tok.decode(ids) == tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)

    sample = "The harbor town woke up slowly, at 7:30 (or so)."
    enc = tok(sample)["input_ids"]
    assert tok.decode(enc) == sample
    assert len(enc) < 0.6 * len(sample.encode())  # real merges were learned
    assert tok.decode(tok("héllo wörld ✓")["input_ids"]) == "héllo wörld ✓"  # byte level: nothing is unknown


def test_tokenizer_json_matches_the_tokenizers_library(built):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(built["tiny-2b"] / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    enc = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert enc.ids[0] == special_token_id("<|im_start|>") and enc.ids[-1] == special_token_id("<|im_end|>")


# ----------------------------------------------------------------------------------------------- committed fixtures


@pytest.mark.parametrize("layout", LAYOUTS)
def test_committed_checkpoints_match_the_builder(built, layout):
    """The committed tests/fixtures/<layout> files are what the builder writes today (reference.npz aside)."""
    committed = FIXTURES / layout
    assert committed.is_dir(), f"missing fixtures {committed}: run tests/fixtures/make_reference.py"
    names = sorted(p.name for p in built[layout].iterdir())
    assert sorted(p.name for p in committed.iterdir() if p.name != "reference.npz") == names
    stale = [n for n in names if (committed / n).read_bytes() != (built[layout] / n).read_bytes()]
    assert not stale, f"{layout}: committed {stale} differ from build_tiny_checkpoint(): rerun make_reference.py"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_committed_reference_npz(layout):
    mr = _load_make_reference()
    vocab = TINY_LAYOUTS[layout]["vocab_size"]
    with np.load(FIXTURES / layout / "reference.npz") as ref:
        meta = json.loads(str(ref["meta"]))
        assert meta["layout"] == layout
        prompts, gen_prompts = mr.make_prompts(layout)
        for i, n in enumerate(mr.PROMPT_LENGTHS):
            assert ref[f"prompt_{i}"].dtype == np.int64 and np.array_equal(ref[f"prompt_{i}"], prompts[i])
            logits = ref[f"logits_{i}"]
            assert logits.shape == (n, vocab) and logits.dtype == np.float32 and np.isfinite(logits).all()
            assert ref[f"hf_bf16_mae_{i}"].shape == ()
        # Logits are not flat: a std of about one unit across the vocabulary (see tiny.weights._LOGIT_STD).
        std = np.concatenate([ref[f"logits_{i}"] for i in range(len(mr.PROMPT_LENGTHS))]).std(-1).mean()
        assert 0.8 < std < 1.5, std
        assert 0 < float(ref["hf_bf16_mean_abs_err"]) < 1
        assert 0.5 < float(ref["hf_bf16_top1_agreement"]) <= 1
        for j, n in enumerate(mr.GEN_PROMPT_LENGTHS):
            assert np.array_equal(ref[f"gen_prompt_{j}"], gen_prompts[j])
            tokens, margin = ref[f"gen_tokens_{j}"], ref[f"gen_margin_{j}"]
            assert tokens.shape == margin.shape == (mr.GEN_NEW_TOKENS,)
            assert tokens.dtype == np.int64 and ((0 <= tokens) & (tokens < vocab)).all()
            # The margins and tokens themselves are checked against an independent model in test_oracle.py.
            assert len(np.unique(tokens)) > 10  # not stuck on one token


def test_compare_dirs_reports_differences(tmp_path):
    """The staleness check of make_reference.py --check can fail: tamper with a copy and look for each difference."""
    mr = _load_make_reference()
    layout = "tiny-nv2x"
    shutil.copytree(FIXTURES / layout, tmp_path / "new" / layout)
    # The float64 run the check compares against (here the committed logits themselves: no change of the model).
    with np.load(FIXTURES / layout / "reference.npz") as z:
        truth = {k: z[k].astype(np.float64) for k in z.files if k.startswith("logits_")}
    np.savez(tmp_path / "new" / layout / mr.TRUTH_FILE, **truth)
    assert mr.compare_dirs(tmp_path / "new", FIXTURES, [layout]) == []

    file = tmp_path / "new" / layout / "model.safetensors"
    header, raw = read_safetensors(file)
    tensors = {k: np.frombuffer(raw[k], "<f4").reshape(e["shape"]).copy() for k, e in header.items()}
    tensors["model.language_model.norm.weight"][0] += 1e-3
    write_safetensors(file, tensors)
    cfg = tmp_path / "new" / layout / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    npz = tmp_path / "new" / layout / "reference.npz"
    with np.load(npz) as z:
        arrays = dict(z)
    arrays["logits_3"] = arrays["logits_3"] + 1e-3  # fp32 output 1e-3 from the float64 truth: not rounding
    arrays["gen_tokens_1"] = arrays["gen_tokens_1"].copy()
    arrays["gen_tokens_1"][7] = (arrays["gen_tokens_1"][7] + 1) % 512
    np.savez_compressed(npz, **arrays)

    diffs = "\n".join(mr.compare_dirs(tmp_path / "new", FIXTURES, [layout]))
    assert "model.language_model.norm.weight" in diffs
    assert "config.json" in diffs
    assert "logits_3: transformers' fp32 error 0.001" in diffs
    assert "gen_tokens_1: differs first at index 7" in diffs
    assert "logits_2" not in diffs


def test_compare_logits_tells_rounding_from_a_change():
    """make_reference.compare_logits on made-up logits: noise of fp32 size passes, a shift of the truth (a changed
    model) or an fp32 output further from it than recorded (a less accurate path) fails, each with its own message."""
    mr = _load_make_reference()
    rng = np.random.default_rng(0)
    truth = rng.standard_normal((64, 512))
    rounding = lambda: (truth + rng.uniform(-1.5e-5, 1.5e-5, truth.shape)).astype(np.float32)  # noqa: E731
    committed, recorded = rounding(), 1.5e-5
    assert mr.compare_logits("l", rounding(), committed, truth, recorded) == []
    moved = truth.copy()
    moved[10, 3] += 1e-4
    diffs = mr.compare_logits("l", moved.astype(np.float32), committed, moved, recorded)
    assert ["the reference changed" in d for d in diffs] == [True]
    worse = (truth + rng.uniform(-1e-4, 1e-4, truth.shape)).astype(np.float32)
    assert ["less accurate" in d for d in mr.compare_logits("l", worse, committed, truth, recorded)] == [True]
