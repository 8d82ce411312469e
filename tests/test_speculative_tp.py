"""Speculative decoding with the MTP head at tensor-parallel degree 2 (real gloo collectives, tests/kit/tp.py), the
head sharded as the main layers are (its attention layer by heads, its MLP by intermediate rows, fc and the input
norms replicated: checkpoint/shard.py), with a head fitted to its main model so that drafts are accepted
(optimum_qwen35/tiny/mtp_fit.py). Every rank runs the host loop (SPMD). What the tests prove:

- greedy speculation returns plain greedy decoding's tokens for k = 1..4 in fp32 and bf16 (bf16 against plain bf16 at
  the same degree); the head's logits at TP 2 equal TP 1's within a bound;
- every rank picks tokens from bitwise the same logits (the all-gathered head logits, fp32 and bf16), and the ranks'
  greedy and sampled tokens are equal (the kit fails the run otherwise; a rank seeded differently fails it: checked by
  hand);
- sampled speculation (the rejection rule) with a point-mass distribution (top_k = 1) is greedy decoding at TP 2,
  with greedy speculation's acceptance lengths (k = 1..4, fp32 and bf16);
- sampled speculation at TP 2 with a seeded generator returns, in fp32, TP 1's tokens for the same seed and k
  (k = 2, 4, three seeds each), in runs that keep drafts and draw replacements; TP 1's sampled law is tested in
  tests/test_speculative_sampling.py, so TP 2 draws from plain sampling's law as well (for these seeds, token for
  token). Not proved: bf16 sampled TP 2 against TP 1 (logit rounding changes sampled tokens; measured, printed)."""

import json

import pytest
import torch

from optimum_qwen35.checkpoint import CheckpointReader
from optimum_qwen35.checkpoint.convert import convert_mtp
from optimum_qwen35.checkpoint.shard import shard_tensor, unshard_tensor
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.torch_layers import TorchLayers

from tests.kit.tp import Sampled

from .conftest import FIXTURES

KS = (1, 2, 3, 4)
NEW = 24
DTYPES = (torch.float32, torch.bfloat16)
# fp32 logits of TP 2 against TP 1: the repository's TP bound (docs/tensor_parallel.md), rounding only.
FP32_ATOL = 1e-4
BF16_RTOL = 0.02  # of the largest logit
POINT_MASS = [Sampled(k, top=1) for k in KS]
# The 2 most likely tokens at temperature 0.25, three seeds each: sampled runs that keep some drafts (tiny-2b's
# logits are flat enough that sampling leaves the fitted continuation fast, and the head then accepts little).
SEEDED = [Sampled(k, top=2, temperature=0.25, seed=seed) for k in (2, 4) for seed in (0, 1, 2)]


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
def runs(fitted_tiny_2b):
    """TP 1 (this process) and TP 2 (two gloo processes) over the fitted checkpoint and two in-sample prompts (a fitted
    prompt and the start of its continuation) of 12 and 20 tokens, either side of the 16-token context bucket: plain
    greedy, greedy speculation for each k in KS, and the SAMPLED runs, fp32 and bf16 in the same processes (process
    start-up and loading dominate, so every test here shares one run per degree)."""
    from optimum_qwen35.runtime import Qwen35Runtime
    from tests.kit.tp import run_speculative_tensor_parallel

    folder = fitted_tiny_2b
    fit = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:2]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=2, max_length=64, buckets=[16, 32])
    continued = model.generate(fit, max_new_tokens=12)
    prompts = [fit[0] + continued[0][:4], fit[1] + continued[1][:12]]
    tp1 = run_speculative_tensor_parallel(folder, 1, prompts, NEW, KS, DTYPES, sampled=POINT_MASS + SEEDED)
    tp2 = run_speculative_tensor_parallel(folder, 2, prompts, NEW, KS, DTYPES, sampled=POINT_MASS + SEEDED)
    return tp1, tp2


def test_greedy_speculation_at_tp2_equals_greedy_decoding(runs):
    tp1, tp2 = runs
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
    # bf16: two summation orders of bf16 partial sums (measured 0.15-0.16 on logits up to 11: 1.4%, about 2.5 bf16 ulps).
    bf16_1, bf16_2 = tp1[1], tp2[1]
    assert (bf16_2.head_logits - bf16_1.head_logits).abs().max() < BF16_RTOL * bf16_1.head_logits.abs().max()


def test_every_rank_reads_the_same_logits(runs):
    """The host loop runs on every rank (SPMD) and picks tokens from its own copy of the logits: the all-gathered
    head logits are bitwise equal on both ranks, in bf16 too (the kit also fails the run if any rank's greedy or
    sampled tokens differ from rank 0's)."""
    _, tp2 = runs
    assert [two.rank_spread for two in tp2] == [0.0] * len(DTYPES)


def test_point_mass_sampling_at_tp2_is_greedy(runs):
    """Sampled speculation (the rejection rule) with top_k = 1: p and q are point masses, so a draft is kept exactly
    when it is the main model's argmax and the replacement is that argmax: greedy's tokens and greedy speculation's
    acceptance length, at TP 2, fp32 and bf16."""
    _, tp2 = runs
    for dtype, two in zip(DTYPES, tp2):
        for run in POINT_MASS:
            assert two.sampled[run] == two.tokens[0], (dtype, run)
            assert two.sampled_acceptance[run] == two.acceptance[run.k], (dtype, run)


def test_seeded_sampling_at_tp2_draws_tp1s_tokens(runs):
    """Sampled speculation at TP 2 with a seeded generator (each rank seeds its own) returns, in fp32, the tokens TP 1
    returns with the same seed and k; TP 1's are held to plain sampling's law by tests/test_speculative_sampling.py.
    The runs leave greedy decoding, and both branches of the rule ran (drafts kept in some rounds, a replacement drawn
    in others). bf16 is held to rank agreement only: its TP 2 logits differ from TP 1's by rounding (above), which
    changes sampled tokens."""
    tp1, tp2 = runs
    one, two = tp1[0], tp2[0]
    for run in SEEDED:
        assert two.sampled[run] == one.sampled[run], run
        assert all(row != greedy for row, greedy in zip(two.sampled[run], two.tokens[0])), run
    for k in {run.k for run in SEEDED}:
        lengths = [two.sampled_acceptance[run] for run in SEEDED if run.k == k]
        print(f"TP 2 fp32 sampled k={k}: acceptance length per seed {[round(x, 3) for x in lengths]}")
        # > 1: some round kept a draft; < k + 1: some round drew a replacement (the cache never cuts a round here).
        assert 1 < sum(lengths) / len(lengths) < k + 1, (k, lengths)
    for run in SEEDED:
        differ = [next((i for i, (a, b) in enumerate(zip(r1, r2)) if a != b), None)
                  for r1, r2 in zip(tp1[1].sampled[run], tp2[1].sampled[run])]
        print(f"bf16 {run}: first position where TP 2's sampled tokens leave TP 1's, per row: {differ}")


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
