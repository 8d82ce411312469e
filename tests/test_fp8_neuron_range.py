"""FP8 weights for the Neuron targets' E4M3 (checkpoint/fp8.py `fit_e4m3_range`, checkpoint/quantize.py
`QuantizingReader`, backends/nxd/fp8.py's rank tensors; no Neuron SDK needed; docs/fp8.md).

trn1, inf2 and trn2 compute FP8 E4M3 as float8_e4m3 (max 240), not float8_e4m3fn (max 448, Qwen's format): the
weights an NxD export loads are first brought within 240, so that neuronx-cc's reading of F8E4M3FN as F8E4M3 is
exact. The graphs themselves are built and run in tests/neuron_xla/test_fp8_xla.py.
"""

from __future__ import annotations

import pytest
import torch

from optimum_qwen35.backends.nxd import fp8 as nxd_fp8
from optimum_qwen35.checkpoint import CheckpointReader, fp8
from optimum_qwen35.checkpoint.fp8_shard import fp8_rank_tensors
from optimum_qwen35.checkpoint.quantize import QuantizingReader, quantize_checkpoint
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import CheckpointError, UsageError
from optimum_qwen35.export import layout

from .conftest import FIXTURES


@pytest.mark.parametrize("along", ["rows", "cols"])
def test_fit_e4m3_range_keeps_each_weight_within_240(along):
    """Every value within 240; the dequantized weight unchanged except where a halved value left float8's normal
    range (at most 2^-10 of its new scale); runs already within range untouched; a second fit changes nothing."""
    torch.manual_seed(0)
    weight = torch.randn(3, 300, 200) * torch.logspace(-3, 1, 200)  # columns of very different magnitude
    q, scale_inv = fp8.quantize(weight)
    scale = fp8.expand_along(scale_inv, tuple(q.shape), along)
    fitted, fitted_scale = fp8.fit_e4m3_range(q, scale)
    assert fitted.dtype == fp8.FP8_DTYPE
    assert float(fitted.float().abs().max()) <= fp8.E4M3_MAX < float(q.float().abs().max())
    before = fp8.dequantize_expanded(q, scale, torch.float64)
    after = fp8.dequantize_expanded(fitted, fitted_scale, torch.float64)
    per_element = fp8._per_element(fitted_scale, tuple(q.shape)).double()
    changed = before != after
    assert float(((after - before).abs() / per_element).max()) <= 2.0**-10
    assert changed.float().mean() < 1e-2 and bool((q.float()[changed].abs() < 2.0**-5).all())
    untouched = fitted_scale == scale
    assert bool(untouched.any()) and bool((fitted_scale[~untouched] == 2 * scale[~untouched]).all())
    again, again_scale = fp8.fit_e4m3_range(fitted, fitted_scale)
    assert torch.equal(again.view(torch.uint8), fitted.view(torch.uint8)) and torch.equal(again_scale, fitted_scale)
    print(f"\n{along}: {int(changed.sum())} of {changed.numel()} products changed, max relative to the scale "
          f"{float(((after - before).abs() / per_element).max()):.2e}")


@pytest.mark.parametrize("layout_name", ["tiny-moe", "tiny-nv3x"])
def test_the_quantizing_reader_serves_what_quantize_checkpoint_writes(tmp_path, layout_name):
    """A bf16 / fp32 checkpoint read through `QuantizingReader` gives each rank the same bytes as the folder
    `quantize_checkpoint` writes (per-expert parts each quantized on their own grid, as there), at TP 1 and 2."""
    source = FIXTURES / layout_name
    config = Qwen35Config.from_pretrained(source)
    written = CheckpointReader(quantize_checkpoint(source, tmp_path / "fp8"))
    for tp, rank in ((1, 0), (2, 1)):
        ours = fp8_rank_tensors(QuantizingReader(source), config, tp, rank, torch.bfloat16, e4m3_range=True)
        theirs = fp8_rank_tensors(written, config, tp, rank, torch.bfloat16, e4m3_range=True)
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            as_bits = (lambda t: t.view(torch.uint8)) if tensor.dtype == fp8.FP8_DTYPE else (lambda t: t)
            assert torch.equal(as_bits(tensor), as_bits(theirs[name])), (tp, rank, name)
        assert sum(t.dtype == fp8.FP8_DTYPE for t in ours.values()) > 0


def test_the_quantizing_reader_with_lm_head_serves_what_quantize_checkpoint_writes(tmp_path):
    """`lm_head=True` (`fp8_lm_head`): a tied bf16 checkpoint read untied, its lm_head the embedding's float8 copy,
    and an FP8 checkpoint read as stored but for its lm_head: each rank's bytes those of `quantize_checkpoint(...,
    lm_head=True)`'s folder, at TP 1 and 2 (lm_head split by vocabulary with its scales)."""
    from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

    bf16 = FIXTURES / "tiny-2b"
    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    for source in (bf16, q):
        written_folder = quantize_checkpoint(source, tmp_path / f"{source.name}-lm_head", lm_head=True)
        config, written = Qwen35Config.from_pretrained(written_folder), CheckpointReader(written_folder)
        assert not config.tie_word_embeddings and written.is_fp8("lm_head.weight")
        for tp, rank in ((1, 0), (2, 1)):
            ours = fp8_rank_tensors(QuantizingReader(source, lm_head=True), config, tp, rank, torch.bfloat16, e4m3_range=True)
            theirs = fp8_rank_tensors(written, config, tp, rank, torch.bfloat16, e4m3_range=True)
            assert ours.keys() == theirs.keys() and ours["lm_head.weight"].dtype == fp8.FP8_DTYPE
            for name, tensor in ours.items():
                as_bits = (lambda t: t.view(torch.uint8)) if tensor.dtype == fp8.FP8_DTYPE else (lambda t: t)
                assert torch.equal(as_bits(tensor), as_bits(theirs[name])), (source.name, tp, rank, name)
    assert "lm_head.weight" not in nxd_fp8.checkpoint_reader(q)  # (tied)
    assert nxd_fp8.checkpoint_reader(q, lm_head=True).is_fp8("lm_head.weight")


def test_the_quantizing_reader_refuses_an_fp8_checkpoint(tmp_path):
    from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

    folder = build_tiny_fp8_checkpoint(tmp_path / "fp8", "tiny-2b")
    with pytest.raises(UsageError, match="already an FP8 checkpoint"):
        QuantizingReader(folder)


class _Config:  # what the NxD class is built with: the export's text config
    def __init__(self, folder, names):
        self.__dict__.update(Qwen35Config.from_pretrained(folder).raw["text_config"])
        setattr(self, layout.FP8_EXPORT_KEY, {"weights": names})

    def to_dict(self):
        return dict(vars(self))


@pytest.mark.parametrize(("layout_name", "tp"), [("tiny-moe", 2), ("tiny-nv3x", 2), ("tiny-2b", 1)])
def test_each_nxd_rank_holds_its_float8_shards_by_the_traced_modules_names(layout_name, tp):
    """Rank tensors of an NxD export with FP8 weights: each float8 weight under the parametrization's name with its
    scale beside it, of the shape `scale_shape` gives the traced module (experts transposed as neuronx-distributed
    holds them), every float8 value within 240; the names the export records are what the checkpoint quantizes."""
    source = FIXTURES / layout_name
    config = Qwen35Config.from_pretrained(source)
    names = nxd_fp8.fp8_weight_names(source, config)
    assert names == nxd_fp8.rule_weight_names(config)  # (what the benchmarks' shape-only graphs hold)
    assert names and all(n.endswith(("weight", "experts.gate_up_proj", "experts.down_proj")) for n in names)
    for rank in range(tp):
        tensors = nxd_fp8.fp8_rank_state_dict(source, _Config(source, names), tp, rank, torch.bfloat16)
        for name in names:
            nxd = nxd_fp8.nxd_name(name)
            weight = tensors[nxd_fp8.parametrized_name(nxd)]
            scale = tensors[nxd_fp8.parametrized_name(nxd + "_scale")]
            assert weight.dtype == fp8.FP8_DTYPE and scale.dtype == torch.float32
            assert float(weight.float().abs().max()) <= fp8.E4M3_MAX
            assert scale.shape == nxd_fp8.scale_shape(name, tuple(weight.shape), config, tp), name
        assert not any(t.dtype == fp8.FP8_DTYPE for n, t in tensors.items() if ".parametrizations." not in n)


def test_an_nxd_load_of_another_checkpoint_is_refused_in_one_line(tmp_path):
    source = FIXTURES / "tiny-2b"
    names = nxd_fp8.fp8_weight_names(source, Qwen35Config.from_pretrained(source))
    with pytest.raises(CheckpointError, match="not the ones this export was compiled with"):
        nxd_fp8.fp8_rank_state_dict(source, _Config(source, names[:-1]), 1, 0, torch.bfloat16)
