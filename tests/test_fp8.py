"""Qwen's block-FP8 checkpoints (checkpoint/fp8.py, tiny/fp8.py): the format our tiny FP8 checkpoints are written in,
dequantization at load (partial blocks, MoE expert forms, the MTP head, tensor-parallel shards), accuracy against the
float64 oracle of the dequantized model, and every bad input refused in one line (docs/fp8.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from optimum_qwen35.checkpoint import CheckpointReader, fp8
from optimum_qwen35.checkpoint.convert import convert_mtp
from optimum_qwen35.checkpoint.quantize import quantize_checkpoint
from optimum_qwen35.checkpoint.shard import convert_and_shard
from optimum_qwen35.checkpoint.sharded_files import save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import CheckpointError
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

from . import oracle

F64 = torch.float64
# Our fp32 path against the float64 oracle of the same dequantized weights: fp32 rounding only (the parity
# tolerance of tests/test_oracle.py; the fp32 product fp8 x scale adds ~6e-8 relative to each weight).
FP32_ATOL = 1e-4
# Our float64 path against the float64 oracle: both exact up to float64 rounding (the product is taken in float64).
F64_ATOL = 1e-9
POSITIONS = 520  # teacher-forced positions of one sequence (>= 512)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def exact_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 folder in float64, each float8 weight times its block's scale, written independently
    of checkpoint/fp8.py: element (r, c) takes scale[r // 128, c // 128] (the ceiling grid)."""
    raw = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for key, tensor in raw.items():
        if key.endswith("_scale_inv"):
            continue
        if key + "_scale_inv" in raw:
            s = raw[key + "_scale_inv"].to(F64)
            rows, cols = tensor.shape[-2:]
            s = s[..., torch.arange(rows) // 128, :][..., torch.arange(cols) // 128]
            out[key] = tensor.to(F64) * s
        else:
            assert tensor.dtype != torch.float8_e4m3fn, key
            out[key] = tensor.to(F64)
    return out


def write_unquantized(fp8_folder: Path, out: Path) -> Path:
    """The same model without quantization: the exactly dequantized weights in float64, config without
    quantization_config."""
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(fp8_folder / f, out / f)
    config = json.loads((fp8_folder / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in exact_dequantized(fp8_folder).items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (FP8 folder, unquantized float64 folder)}: dense (all dims multiples of 128), dense with 96 / 192 dims
    (partial blocks), MoE per-expert and MoE fused."""
    root = tmp_path_factory.mktemp("fp8")
    cases = {"tiny-2b": ("tiny-2b", None), "tiny-nv3x": ("tiny-nv3x", None),
             "tiny-moe": ("tiny-moe", "per_expert"), "tiny-moe-top1": ("tiny-moe-top1", "fused")}
    out = {}
    for name, (layout, form) in cases.items():
        q = build_tiny_fp8_checkpoint(root / name, layout, expert_form=form)
        out[name] = (q, write_unquantized(q, root / f"{name}-f64"))
    # tiny-2b with its lm_head in FP8 too (`fp8_lm_head`, past Qwen's format: quantized from the FP8 checkpoint).
    q = quantize_checkpoint(out["tiny-2b"][0], root / "tiny-2b-lm_head", lm_head=True)
    out["tiny-2b-lm_head"] = (q, write_unquantized(q, root / "tiny-2b-lm_head-f64"))
    return out


# ---- quantization ------------------------------------------------------------------------------------------------

def test_quantize_partial_blocks_on_the_ceiling_grid():
    w = torch.randn(200, 72, generator=torch.Generator().manual_seed(1), dtype=F64)
    w[128:, :] *= 10  # the second (short) row block has its own scale
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 1)
    assert s[0, 0] == pytest.approx(w[:128].abs().max().item() / 448, rel=1e-6)
    assert s[1, 0] == pytest.approx(w[128:].abs().max().item() / 448, rel=1e-6)
    back = fp8.dequantize(q, s, F64)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each element (normals), <= 2^-9 * scale (subnormals).
    scale = fp8.expand_scale(s.to(F64), tuple(w.shape))
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + scale * 2.0**-9).all()
    q2, s2 = fp8.quantize(back)  # a dequantized weight quantizes back to itself
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.allclose(s2, s)
    q3, s3 = fp8.quantize(torch.zeros(4, 3, 5))  # fused [E, rows, cols]; an all-zero block keeps scale 1
    assert s3.shape == (4, 1, 1) and (s3 == 1).all()


def test_tiny_fp8_checkpoint_is_in_qwens_format(folders):
    folder = folders["tiny-moe"][0]
    config = json.loads((folder / "config.json").read_text())
    q = config["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "lm_head" in q["modules_to_not_convert"] and "model.language_model.layers.0.mlp.gate" in q["modules_to_not_convert"]
    headers = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            headers.update({k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    lm = "model.language_model.layers.0."
    assert headers[lm + "mlp.experts.0.gate_proj.weight"] == ("F8_E4M3", (32, 64))
    assert headers[lm + "mlp.experts.0.gate_proj.weight_scale_inv"] == ("F32", (1, 1))
    assert headers[lm + "mlp.shared_expert.down_proj.weight"][0] == "F8_E4M3"
    for bf16 in ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "linear_attn.in_proj_a.weight",
                 "linear_attn.in_proj_b.weight", "linear_attn.conv1d.weight", "input_layernorm.weight"):
        assert headers[lm + bf16][0] == "BF16", bf16
    assert headers["lm_head.weight"][0] == "BF16" and headers["model.language_model.embed_tokens.weight"][0] == "BF16"
    assert headers["mtp.fc.weight"][0] == "F8_E4M3" and headers["mtp.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"
    assert headers["mtp.layers.0.mlp.experts.5.down_proj.weight_scale_inv"] == ("F32", (1, 1))
    assert not any(k.startswith("model.visual.") and d == "F8_E4M3" for k, (d, _) in headers.items())
    fused = CheckpointReader(folders["tiny-moe-top1"][0])
    assert "layers.0.mlp.experts.gate_up_proj" in fused._files  # fused experts, scale `gate_up_proj_scale_inv`
    dense = json.loads((folders["tiny-nv3x"][0] / "config.json").read_text())["text_config"]
    assert dense["intermediate_size"] == 192  # a partial block: scale grid 2 x 1 for up_proj [192, 96]


# ---- reading (a): dequantized at load ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-2b", "tiny-nv3x", "tiny-moe", "tiny-moe-top1"])
def test_reader_dequantizes_every_tensor_exactly(folders, name):
    """Text tensors and the MTP head, MoE experts per expert and fused: the FP8 folder read in float64 is the exact
    dequantization, under the same names and shapes as the unquantized checkpoint's."""
    q, f64 = folders[name]
    a, b = CheckpointReader(q, mtp=True, dequantize_dtype=F64), CheckpointReader(f64, mtp=True)
    assert sorted(a.names()) == sorted(b.names()) and sorted(a.mtp_names()) == sorted(b.mtp_names())
    for n in a.names():
        assert a.shape(n) == b.shape(n) and torch.equal(a.get(n), b.get(n).to(a.get(n).dtype)), n
    for n in a.mtp_names():
        assert torch.equal(a.get_mtp(n), b.get_mtp(n)), n
    assert CheckpointReader(q).dtype("layers.0.mlp.down_proj.weight" if "moe" not in name else
                                     "layers.0.mlp.shared_expert.down_proj.weight") == torch.bfloat16


@pytest.mark.parametrize("name,tp", [("tiny-2b", 2), ("tiny-2b", 4), ("tiny-nv3x", 2), ("tiny-nv3x", 4), ("tiny-moe", 2)])
def test_tensor_parallel_shards_of_fp8_checkpoints(folders, name, tp):
    """Each rank's shard equals the shard of the dequantized weight: 128-row blocks split across ranks and 96 / 192
    dims at TP 2 / 4 take each element's own block scale (blocks are dequantized before the split)."""
    q, f64 = folders[name]
    config = Qwen35Config.from_pretrained(q)
    for rank in range(tp):
        got = dict(convert_and_shard(CheckpointReader(q, dequantize_dtype=F64), config, tp, rank))
        want = dict(convert_and_shard(CheckpointReader(f64), config, tp, rank))
        assert got.keys() == want.keys()
        for n in got:
            assert torch.equal(got[n], want[n]), f"{name} TP {tp} rank {rank}: {n}"


def test_mtp_head_loads_dequantized(folders):
    q, f64 = folders["tiny-2b"]
    config = Qwen35Config.from_pretrained(q)
    got = dict(convert_mtp(CheckpointReader(q, mtp=True, dequantize_dtype=F64), config, F64))
    want = dict(convert_mtp(CheckpointReader(f64, mtp=True), config, F64))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    assert got["mtp.fc.weight"].dtype == F64


# ---- accuracy against the float64 oracle ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-2b", "tiny-nv3x"])
def test_dense_fp8_matches_the_oracle_over_520_positions(folders, name):
    """Truth: the oracle (tests/oracle.py, float64) on the exactly dequantized weights. Our float64 path is held to
    float64 rounding, our fp32 path to fp32 rounding, at every one of 520 teacher-forced positions."""
    q, _ = folders[name]
    text = json.loads((q / "config.json").read_text())["text_config"]
    weights = {k[len("model.language_model."):] if k.startswith("model.language_model.") else k: v
               for k, v in exact_dequantized(q).items() if k.startswith("model.language_model.") or k == "lm_head.weight"}
    weights.setdefault("lm_head.weight", weights["embed_tokens.weight"])
    tokens = _tokens(POSITIONS)
    want = oracle.logits((text, weights), tokens)
    for dtype, atol in ((F64, F64_ATOL), (torch.float32, FP32_ATOL)):
        model = Qwen35Runtime.from_pretrained(q, batch_size=1, max_length=POSITIONS + 8, dtype=dtype)
        got = model.prefill([tokens], [0], all_logits=True)[0, :POSITIONS].to(F64)
        diff = (got - want).abs().max().item()
        assert diff <= atol, f"{name} {dtype}: |model - oracle| {diff:.2e} over {POSITIONS} positions"


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-top1"])
def test_moe_fp8_matches_its_dequantized_model_over_520_positions(folders, name):
    """MoE (no MoE in the oracle): the FP8 folder against the unquantized float64 folder of the exactly dequantized
    weights, in float64 (equal to rounding) and in fp32 (fp32 rounding)."""
    q, f64 = folders[name]
    tokens = _tokens(POSITIONS, seed=1)
    want = Qwen35Runtime.from_pretrained(f64, batch_size=1, max_length=POSITIONS + 8, dtype=F64).prefill(
        [tokens], [0], all_logits=True)[0, :POSITIONS]
    for dtype, atol in ((F64, F64_ATOL), (torch.float32, FP32_ATOL)):
        model = Qwen35Runtime.from_pretrained(q, batch_size=1, max_length=POSITIONS + 8, dtype=dtype)
        got = model.prefill([tokens], [0], all_logits=True)[0, :POSITIONS].to(F64)
        diff = (got - want).abs().max().item()
        assert diff <= atol, f"{name} {dtype}: |fp8 - dequantized| {diff:.2e}"


# ---- bad input: one line each, nothing written -------------------------------------------------------------------

def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bad"
    shutil.copytree(folder, out)
    return out


def _rewrite(folder: Path, edit) -> None:
    file = folder / "model.safetensors"
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _quant(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _refused(folder: Path, tmp_path: Path, *needles: str) -> None:
    out = tmp_path / "export"
    for attempt in (lambda: CheckpointReader(folder), lambda: save_sharded(folder, None, 2, out, progress=False)):
        with pytest.raises(CheckpointError) as e:
            attempt()
        line = str(e.value)
        assert "\n" not in line and all(n in line for n in needles), line
    assert not out.exists()  # nothing half-written


def test_missing_scale_is_refused(folders, tmp_path):
    bad = _copy(folders["tiny-moe-top1"][0], tmp_path)
    _rewrite(bad, lambda t: t.pop("model.language_model.layers.1.mlp.shared_expert.up_proj.weight_scale_inv"))
    _refused(bad, tmp_path, "without their weight_scale_inv", "layers.1.mlp.shared_expert.up_proj.weight")


def test_scale_of_the_wrong_shape_is_refused(folders, tmp_path):
    bad = _copy(folders["tiny-moe-top1"][0], tmp_path)
    key = "model.language_model.layers.2.mlp.experts.gate_up_proj_scale_inv"
    _rewrite(bad, lambda t: t.__setitem__(key, torch.ones(4, 2, 1)))
    _refused(bad, tmp_path, "wrong shape", key, "(4, 1, 1)")


@pytest.mark.parametrize("block", [[64, 64], [1, 128], None])
def test_other_block_sizes_are_refused(folders, tmp_path, block):
    bad = _copy(folders["tiny-moe-top1"][0], tmp_path)
    _quant(bad, weight_block_size=block)
    _refused(bad, tmp_path, "weight_block_size", "[128, 128]")


@pytest.mark.parametrize("method,name", [("gptq", "GPTQ"), ("awq", "AWQ"), ("bitsandbytes", "bitsandbytes"),
                                         ("compressed-tensors", "compressed-tensors"), ("mystery", "'mystery'")])
def test_other_quantizations_are_refused_by_name(folders, tmp_path, method, name):
    bad = _copy(folders["tiny-moe-top1"][0], tmp_path)
    _quant(bad, quant_method=method)
    _refused(bad, tmp_path, name, "not supported")


# ---- transformers 5 + accelerate on the same FP8 folder ----------------------------------------------------------

@pytest.mark.reference  # transformers >= 5 with accelerate (the reference session)
@pytest.mark.parametrize("name", ["tiny-2b", "tiny-moe"])
def test_transformers_on_the_fp8_folder_agrees_with_our_fp32_path(folders, name):
    """transformers 5.25 + accelerate loads the FP8 folder on a CPU (dequantizing at load, FineGrainedFP8) and agrees
    with our fp32 path to fp32 rounding over 520 positions: measured 1.7e-5 (dense), 1.9e-5 (MoE, per-expert). Only
    where every dimension is a multiple of 128 or fits one block: transformers infers the block as rows // scale_rows,
    so a 192-row weight (tiny-nv3x) is dequantized with 96-row blocks there (docs/fp8.md); ours follows the ceiling
    grid, checked against the oracle above."""
    import transformers

    q, _ = folders[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tokens = _tokens(POSITIONS, seed=2)
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0].to(F64)
    ours = Qwen35Runtime.from_pretrained(q, batch_size=1, max_length=POSITIONS + 8, dtype=torch.float32).prefill(
        [tokens], [0], all_logits=True)[0, :POSITIONS].to(F64)
    diff = (ours - theirs).abs().max().item()
    assert diff <= FP32_ATOL, f"{name}: |ours - transformers| {diff:.2e}"


# ---- (b) FP8 weights kept as float8, dequantized next to the matmul ---------------------------------------------

@pytest.mark.parametrize("name,tp", [("tiny-2b", 1), ("tiny-2b", 4), ("tiny-nv3x", 2), ("tiny-nv3x", 4),
                                     ("tiny-moe", 2), ("tiny-moe-top1", 2)])
def test_kept_fp8_shards_dequantize_to_the_dequantized_shards(folders, name, tp):
    """Each rank's float8 shard with its expanded scale shard (blocks split across ranks, permuted DeltaNet rows,
    padded MLP / expert rows, fused and per-expert experts) gives exactly the shard of the weight dequantized at load."""
    from optimum_qwen35.checkpoint.fp8 import dequantize_expanded
    from optimum_qwen35.checkpoint.fp8_shard import convert_and_shard_fp8

    q, _ = folders[name]
    config = Qwen35Config.from_pretrained(q)
    for rank in range(tp):
        kept = dict(convert_and_shard_fp8(CheckpointReader(q), config, tp, rank, torch.bfloat16))
        want = dict(convert_and_shard(CheckpointReader(q, dequantize_dtype=torch.bfloat16), config, tp, rank))
        fp8_names = [n for n in kept if kept[n].dtype == torch.float8_e4m3fn]
        assert fp8_names and set(kept) - {n + "_scale" for n in fp8_names} == set(want)
        for n in want:
            got = dequantize_expanded(kept[n], kept[n + "_scale"], torch.bfloat16) if n in fp8_names else kept[n]
            assert torch.equal(got, want[n]), f"{name} TP {tp} rank {rank}: {n}"


@pytest.mark.parametrize("name", ["tiny-2b", "tiny-nv3x", "tiny-moe", "tiny-moe-top1", "tiny-2b-lm_head"])
def test_kept_fp8_model_equals_the_dequantized_bf16_model(folders, name):
    """The model holding float8 weights (bf16 activations, fp32 DeltaNet state, the MTP head loaded too) gives the
    logits of the model dequantized to bf16 at load, bit for bit on this CPU, over 520 positions (the dequantized
    weight is the same bf16 tensor; only the matmul kernel could differ, and does not here)."""
    from optimum_qwen35.runtime.eager import load_decoder

    q, _ = folders[name]
    tokens = _tokens(POSITIONS, seed=3)
    out = {}
    for weights_dtype in (None, "fp8"):
        decoder = load_decoder(q, torch.bfloat16, weights_dtype=weights_dtype, mtp=True)
        dtypes = {t.dtype for t in decoder.state_dict().values()}
        assert (torch.float8_e4m3fn in dtypes) == (weights_dtype == "fp8")
        model = Qwen35Runtime.from_decoder(decoder, 1, POSITIONS + 8)
        out[weights_dtype] = model.prefill([tokens], [0], all_logits=True)[0, :POSITIONS]
    assert torch.equal(out[None], out["fp8"]), (out[None] - out["fp8"]).abs().max().item()


def test_keeping_fp8_needs_an_fp8_checkpoint(folders):
    from optimum_qwen35.errors import UnsupportedModelError, UsageError
    from optimum_qwen35.runtime.eager import load_decoder

    with pytest.raises(UnsupportedModelError, match="holds no FP8 weights.*quantize it first"):
        load_decoder(folders["tiny-2b"][1], torch.bfloat16, weights_dtype="fp8")
    with pytest.raises(UsageError, match="weights_dtype 'int4' is not supported"):
        load_decoder(folders["tiny-2b"][0], torch.bfloat16, weights_dtype="int4")


@pytest.mark.reference  # transformers >= 5 (the reference session)
@pytest.mark.parametrize("name", ["tiny-2b", "tiny-moe", "tiny-2b-lm_head"])
def test_kept_fp8_is_no_worse_than_transformers_bf16(folders, name):
    """Truth: the dequantized model in float64 (our float64 path, equal to the oracle to 1e-13 for the dense one,
    above). Over 520 teacher-forced positions the FP8-weight path (bf16 activations) is no worse than transformers'
    bf16 run of the same dequantized model, by mean |dlogit| and top-1 agreement. Measured: dense
    0.0254 / 0.952 against transformers 0.0300 / 0.950; MoE 0.0602 / 0.883 against 0.0635 / 0.875; dense with its
    lm_head in FP8 (the truth then its dequantized lm_head) 0.0254 / 0.967 against 0.0301 / 0.954."""
    import transformers

    from optimum_qwen35.runtime.eager import load_decoder

    q, f64 = folders[name]
    tokens = _tokens(POSITIONS, seed=4)
    truth = Qwen35Runtime.from_pretrained(f64, batch_size=1, max_length=POSITIONS + 8, dtype=F64).prefill(
        [tokens], [0], all_logits=True)[0, :POSITIONS]
    ours = Qwen35Runtime.from_decoder(load_decoder(q, torch.bfloat16, weights_dtype="fp8"), 1, POSITIONS + 8).prefill(
        [tokens], [0], all_logits=True)[0, :POSITIONS].to(F64)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(f64, dtype=torch.bfloat16)
        theirs = model(torch.tensor([tokens])).logits[0].to(F64)

    def error_and_top1(x):
        return (x - truth).abs().mean().item(), (x.argmax(-1) == truth.argmax(-1)).double().mean().item()

    (our_mae, our_top1), (hf_mae, hf_top1) = error_and_top1(ours), error_and_top1(theirs)
    print(f"\n{name}: FP8 weights mean |dlogit| {our_mae:.4f}, top-1 {our_top1:.3f}; transformers bf16 {hf_mae:.4f}, {hf_top1:.3f}")
    assert our_mae <= hf_mae and our_top1 >= hf_top1 - 0.005


# ---- quantizing a bf16 / fp32 checkpoint -------------------------------------------------------------------------

def test_quantize_checkpoint_writes_qwens_format(tmp_path):
    """A (sharded, MoE per-expert) fp32 checkpoint quantized file by file gives the same tensors as the tiny FP8
    builder, with its index and config; the folder is about half the bf16 one (measured below); an FP8 source and an
    existing target are refused in one line, and nothing is left behind."""
    from optimum_qwen35.errors import UsageError
    from tests.kit import build_tiny_checkpoint

    src = build_tiny_checkpoint(tmp_path / "src", "tiny-moe", dtype="float32")
    out = quantize_checkpoint(src, tmp_path / "fp8")
    assert "lm_head" in json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    want = build_tiny_fp8_checkpoint(tmp_path / "want", "tiny-moe")
    got_t, want_t = exact_dequantized(out), exact_dequantized(want)
    assert got_t.keys() == want_t.keys() and all(torch.equal(got_t[k], want_t[k]) for k in got_t)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.0.up_proj.weight_scale_inv" in index
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert Qwen35Config.from_pretrained(out).is_moe and CheckpointReader(out).fp8_block == (128, 128)
    with pytest.raises(UsageError, match="already an FP8 checkpoint"):
        quantize_checkpoint(out, tmp_path / "again")
    with pytest.raises(UsageError, match="exists"):
        quantize_checkpoint(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "src", "want"]


def test_quantize_checkpoint_with_lm_head_unties_it(tmp_path):
    """`lm_head=True` (`fp8_lm_head`): a tied bf16 checkpoint gets its own float8 `lm_head.weight`, the quantized
    embedding, which stays bf16; config.json unties them at both levels and no longer lists lm_head as kept; an FP8
    checkpoint keeps every stored tensor and gains only its lm_head's quantization; done twice, it is refused."""
    from optimum_qwen35.errors import UsageError
    from tests.kit import build_tiny_checkpoint

    src = build_tiny_checkpoint(tmp_path / "src", "tiny-2b", dtype="bfloat16")
    assert Qwen35Config.from_pretrained(src).tie_word_embeddings
    out = quantize_checkpoint(src, tmp_path / "fp8", lm_head=True)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["tie_word_embeddings"] is False and not Qwen35Config.from_pretrained(out).tie_word_embeddings
    assert "lm_head" not in config["quantization_config"]["modules_to_not_convert"]
    embedding = "model.language_model.embed_tokens.weight"
    got, source = stored_tensors(out), stored_tensors(src)
    assert got["lm_head.weight"].dtype == fp8.FP8_DTYPE and got[embedding].dtype == torch.bfloat16
    head, scale = fp8.quantize(source[embedding])
    assert torch.equal(got["lm_head.weight"].view(torch.uint8), head.view(torch.uint8))
    assert torch.equal(got["lm_head.weight_scale_inv"], scale)
    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    before, after = stored_tensors(q), stored_tensors(quantize_checkpoint(q, tmp_path / "q-lm_head", lm_head=True))
    assert set(after) == set(before) | {"lm_head.weight", "lm_head.weight_scale_inv"}
    assert all(torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8)) for k in before)
    with pytest.raises(UsageError, match="already an FP8 checkpoint"):
        quantize_checkpoint(tmp_path / "q-lm_head", tmp_path / "again", lm_head=True)


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder as stored, by its key."""
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_fp8_folder_is_about_half_the_bf16_one(tmp_path):
    """Weight bytes of the tiny-2b checkpoint (hidden 128: every linear a whole number of blocks; the bf16 embedding
    is 512 x 128 of its ~2 MB): the FP8 folder's weights against the bf16 folder's."""
    from tests.kit import build_tiny_checkpoint

    bf16 = build_tiny_checkpoint(tmp_path / "bf16", "tiny-2b", dtype="bfloat16")
    q = build_tiny_fp8_checkpoint(tmp_path / "fp8", "tiny-2b")

    def text_bytes(folder):  # the text decoder and MTP head (the vision tower stays bf16 in both)
        total = 0
        for file in folder.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                for k in f.keys():
                    if not k.startswith("model.visual."):
                        s = f.get_slice(k)
                        total += torch.Size(s.get_shape()).numel() * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[s.get_dtype()]
        return total

    ratio = text_bytes(q) / text_bytes(bf16)
    print(f"\ntiny-2b text weights: FP8 {text_bytes(q)} B, bf16 {text_bytes(bf16)} B, ratio {ratio:.3f}")
    assert 0.5 < ratio < 0.6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-nv3x", "tiny-moe"])
def test_kept_fp8_at_tensor_parallel_2_equals_the_dequantized_model(folders, name):
    """Two gloo ranks each holding only their float8 shards (a 192-row MLP split through a block; MoE experts split
    as `auto` splits them) generate with the logits of the same two ranks loading the dequantized bf16 weights, bit for
    bit, prefill and greedy decode."""
    from tests.kit.tp import run_tensor_parallel

    q, _ = folders[name]
    prompts = [_tokens(70, seed=5), _tokens(9, seed=6)]
    runs = {w: run_tensor_parallel(q, 2, prompts, max_new_tokens=6, dtype=torch.bfloat16, weights_dtype=w)
            for w in (None, "fp8")}
    for a, b in zip(runs[None].prefill_logits, runs["fp8"].prefill_logits):
        assert torch.equal(a, b)
    assert torch.equal(runs[None].decode_logits, runs["fp8"].decode_logits)
    assert torch.equal(runs[None].tokens, runs["fp8"].tokens)


def test_selected_experts_are_gathered_as_float8_before_dequantizing(folders):
    """The routed experts of a kept-FP8 MoE layer: `Experts.select` gathers the chosen experts' float8 rows and scale
    rows, then dequantizes (the bytes of the selected experts, not of all), equal to the whole tensor's rows."""
    from optimum_qwen35.runtime.eager import load_decoder

    decoder = load_decoder(folders["tiny-moe"][0], torch.bfloat16, weights_dtype="fp8")
    experts = decoder.layers[0].mlp.experts
    assert experts.parametrizations.gate_up_proj.original.dtype == torch.float8_e4m3fn
    index = torch.tensor([4, 1, 4])
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(experts.select(name, index), getattr(experts, name).index_select(0, index))
        assert torch.equal(experts.select(name, 3), getattr(experts, name)[3])
