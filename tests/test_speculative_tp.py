"""Speculative decoding with the MTP head at tensor-parallel degree 2 (real gloo collectives, tests/kit/tp.py): the
head sharded as the main layers are (its attention layer by heads, its MLP by intermediate rows, fc and the input
norms replicated: checkpoint/shard.py), greedy speculation returns plain greedy decoding's tokens for k = 1..3 in
fp32 and bf16 (bf16 against plain bf16 at the same degree), with a head fitted to its main model so that drafts are
accepted (tests/kit/mtp_fit.py); the head's logits at TP 2 equal TP 1's within a bound."""

import json

import pytest
import torch

from optimum_qwen35.checkpoint import CheckpointReader
from optimum_qwen35.checkpoint.convert import convert_mtp
from optimum_qwen35.checkpoint.shard import shard_tensor, unshard_tensor
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.torch_layers import TorchLayers

from .conftest import FIXTURES

KS = (1, 2, 3)
NEW = 24
DTYPES = (torch.float32, torch.bfloat16)
# fp32 logits of TP 2 against TP 1: the repository's TP bound (docs/tensor_parallel.md), rounding only.
FP32_ATOL = 1e-4
BF16_RTOL = 0.02  # of the largest logit


@pytest.mark.parametrize("fixture", ["tiny-2b", "tiny-moe"])
def test_the_heads_shards_reassemble_and_fit_the_sharded_head(fixture):
    """Every `mtp.*` tensor has a sharding rule; rank shards reassemble to the whole tensor, and their shapes are
    those of the head built at TP 2."""
    config = Qwen35Config.from_pretrained(FIXTURES / fixture)
    with torch.device("meta"):
        params = {n: p for n, p in Qwen35Decoder(config, 2, TorchLayers(2, 0, "unused"), mtp=True).named_parameters()
                  if n.startswith("mtp.")}
    whole = dict(convert_mtp(CheckpointReader(FIXTURES / fixture, mtp=True), config))
    assert sorted(whole) == sorted(params)
    for name, tensor in whole.items():
        shards = [shard_tensor(name, tensor, config, 2, r) for r in range(2)]
        assert shards[0].shape == params[name].shape, name
        assert torch.equal(unshard_tensor(name, shards, config), tensor), name
    assert params["mtp.fc.weight"].shape == whole["mtp.fc.weight"].shape  # replicated
    assert params["mtp.layers.0.self_attn.q_proj.weight"].shape[0] * 2 == whole["mtp.layers.0.self_attn.q_proj.weight"].shape[0]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The fitted checkpoint and two in-sample prompts (a fitted prompt and the start of its continuation) of 12 and
    20 tokens: either side of the 16-token context bucket."""
    from optimum_qwen35.runtime import Qwen35Runtime
    from tests.kit.mtp_fit import fitted_checkpoint  # builds a checkpoint (10-30 s)

    folder = fitted_checkpoint(FIXTURES / "tiny-2b", tmp_path_factory.mktemp("fitted"))
    fit = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:2]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=2, max_length=64, buckets=[16, 32])
    continued = model.generate(fit, max_new_tokens=12)
    return folder, [fit[0] + continued[0][:4], fit[1] + continued[1][:12]]


def test_greedy_speculation_at_tp2_equals_greedy_decoding(fitted):
    from tests.kit.tp import run_speculative_tensor_parallel

    folder, prompts = fitted
    tp1 = run_speculative_tensor_parallel(folder, 1, prompts, NEW, KS, DTYPES)
    tp2 = run_speculative_tensor_parallel(folder, 2, prompts, NEW, KS, DTYPES)
    for dtype, one, two in zip(DTYPES, tp1, tp2):
        for k in KS:
            assert two.tokens[k] == two.tokens[0], (dtype, k)
        print(f"TP 2 {dtype}: acceptance length per k {two.acceptance} (TP 1: {one.acceptance}); head logits "
              f"max |TP 2 - TP 1| {(two.head_logits - one.head_logits).abs().max().item():.2e} (max |logit| "
              f"{one.head_logits.abs().max().item():.2f})")
    fp32_1, fp32_2 = tp1[0], tp2[0]
    assert fp32_2.tokens[0] == fp32_1.tokens[0]  # and the same tokens as the whole model
    # The drafts were accepted at TP 2: exactness under acceptance, not only under rejection.
    assert all(fp32_2.acceptance[k] > 1.5 for k in KS), fp32_2.acceptance
    assert (fp32_2.head_logits - fp32_1.head_logits).abs().max().item() < FP32_ATOL
    # bf16: two summation orders of bf16 partial sums (measured 0.16 on logits up to 11: 1.4%, about 2.5 bf16 ulps).
    bf16_1, bf16_2 = tp1[1], tp2[1]
    assert (bf16_2.head_logits - bf16_1.head_logits).abs().max() < BF16_RTOL * bf16_1.head_logits.abs().max()


def test_the_moe_head_at_tp2_computes_tp1s_function():
    """tiny-moe's head (a sparse MoE block, its experts split as the main layers' are): its random head accepts about
    nothing, so this checks the sharded head's numbers (logits within the fp32 bound) and exactness under rejection."""
    from tests.kit.tp import run_speculative_tensor_parallel

    prompts = [list(range(5, 20)), [7, 300, 2] * 6]
    (one,) = run_speculative_tensor_parallel(FIXTURES / "tiny-moe", 1, prompts, 12, (2,))
    (two,) = run_speculative_tensor_parallel(FIXTURES / "tiny-moe", 2, prompts, 12, (2,))
    assert two.tokens[2] == two.tokens[0] == one.tokens[0]
    print(f"tiny-moe head logits max |TP 2 - TP 1| {(two.head_logits - one.head_logits).abs().max().item():.2e}")
    assert (two.head_logits - one.head_logits).abs().max().item() < FP32_ATOL
