"""The model against an independent float64 implementation (tests/oracle.py), itself anchored to transformers.

`tests/test_parity.py` compares with transformers' recorded fp32 outputs at 1e-4. These tests add a second,
independent reference that runs in float64, so the model in float64 can be held to rounding error (~1e-12) rather
than fp32 tolerance, through the public entry points: prefill (all positions, right-padded mixed lengths across
chunk boundaries), decode steps, and a bf16 checkpoint read from disk. A bug in the gates, the GQA head
mapping (attention and DeltaNet), the chunked rule, the conv or the norms moves the logits by far more than that.
"""

import pytest
import torch

from optimum_qwen35.runtime import Qwen35Runtime
from tests.kit import build_tiny_checkpoint

from . import oracle
from .conftest import FIXTURES, load_reference, reference_prompts

# The oracle (float64) against transformers' recorded fp32 logits: measured 1.8e-5 at most (fp32 rounding of the
# recording); the parity tolerance.
ORACLE_VS_TRANSFORMERS = 1e-4
# The model in float64 against the oracle in float64, whole-prompt prefill. Both sides are float64
# throughout (measured 2.6e-14), so anything above rounding is a bug.
PREFILL_ATOL = 1e-9
# Decode steps: the model keeps the DeltaNet recurrent state in fp32 between graph calls (its contract, also for
# float64 models), so a decode step carries fp32 rounding of the state: measured 1.4e-7. Bound at ~7x.
DECODE_ATOL = 1e-6
# A model in fp32 against the oracle: fp32 rounding only (measured 9.6e-6), held to the parity tolerance.
FP32_ATOL = 1e-4

LAYOUTS = ("tiny-2b", "tiny-nv2x", "tiny-nv3x")  # nv = nk; nv = 2 nk; nv = 3 nk with dk != dv, untied lm_head
LENGTHS = (130, 65, 1)  # across the 64-token chunk boundary twice, once, and a single token
CONTINUATION = [7, 100, 3, 250, 42]  # teacher-forced decode tokens


def prompts_of(layout):
    by_length = {len(p): p for p, _ in reference_prompts(load_reference(layout))}
    return [by_length[n] for n in LENGTHS]


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def expected(layout):
    """The oracle's logits of each prompt followed by CONTINUATION, every position (causal: the prompt's rows are
    the prompt's own logits)."""
    return [oracle.cached_logits(FIXTURES / layout, p + CONTINUATION) for p in prompts_of(layout)]


def test_oracle_matches_transformers(layout, expected):
    """The oracle is right: transformers' recorded logits at every position of three prompts."""
    recorded = {len(p): torch.from_numpy(e) for p, e in reference_prompts(load_reference(layout))}
    for prompt, want in zip(prompts_of(layout), expected):
        diff = (want[: len(prompt)] - recorded[len(prompt)]).abs().max().item()
        assert diff <= ORACLE_VS_TRANSFORMERS, f"{layout} len {len(prompt)}: oracle vs transformers {diff:.2e}"


def test_prefill_and_decode_match_the_oracle_in_float64(layout, expected):
    """Right-padded prompts of three lengths in one batch (in slots 2, 0, 1): every position, then the last token only
    (what generate runs), then decode steps."""
    prompts = prompts_of(layout)
    slots = [2, 0, 1]
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=3, max_length=160, dtype=torch.float64)
    every = model.prefill(prompts, slots, all_logits=True)
    assert every.dtype == torch.float64
    for row, (prompt, want) in enumerate(zip(prompts, expected)):
        diff = (every[row, : len(prompt)] - want[: len(prompt)]).abs().max().item()
        assert diff <= PREFILL_ATOL, f"{layout} prefill len {len(prompt)}: |model - oracle| {diff:.2e}"
    # Prefill as generate runs it (only each prompt's last real token reaches lm_head), in the same slots.
    last = model.prefill(prompts, slots)
    for row, (prompt, want) in enumerate(zip(prompts, expected)):
        diff = (last[row] - want[len(prompt) - 1]).abs().max().item()
        assert diff <= PREFILL_ATOL, f"{layout} prefill (last token) len {len(prompt)}: |model - oracle| {diff:.2e}"
    for i, token in enumerate(CONTINUATION):
        got = model.decode([token] * 3, [len(p) + i for p in prompts], slots)
        for row, (prompt, want) in enumerate(zip(prompts, expected)):
            diff = (got[row] - want[len(prompt) + i]).abs().max().item()
            assert diff <= DECODE_ATOL, f"{layout} decode step {i}, prompt of {len(prompt)}: |model - oracle| {diff:.2e}"


def test_bf16_checkpoint_on_disk_matches_the_oracle(tmp_path):
    """Real Hub checkpoints are bf16: such a file (several shards, nv = 3 nk, dk != dv) loads bit-exactly.

    Loaded in float64 it matches the oracle fed the same bf16 tensors to rounding; loaded in fp32 (the default
    dtype) to fp32 tolerance; loaded in bf16, its weights are the file's bits."""
    folder = build_tiny_checkpoint(tmp_path / "bf16", "tiny-nv3x", seed=11, dtype="bfloat16")
    weights = oracle.read_text_weights(folder)
    prompts = prompts_of("tiny-nv3x")[1:]
    want = [oracle.logits(weights, p) for p in prompts]
    for dtype, atol in ((torch.float64, PREFILL_ATOL), (torch.float32, FP32_ATOL)):
        model = Qwen35Runtime.from_pretrained(folder, batch_size=2, max_length=128, dtype=dtype)
        every = model.prefill(prompts, [0, 1], all_logits=True)
        for row, prompt in enumerate(prompts):
            diff = (every[row, : len(prompt)].double() - want[row]).abs().max().item()
            assert diff <= atol, f"bf16 checkpoint loaded as {dtype}, len {len(prompt)}: |model - oracle| {diff:.2e}"
    model = Qwen35Runtime.from_pretrained(folder, max_length=64, dtype=torch.bfloat16)
    embed = model.decoder.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and torch.equal(embed.double(), weights[1]["embed_tokens.weight"])


def test_recorded_greedy_tokens_and_margins_are_the_oracles(layout):
    """The fixtures' greedy runs (what test_parity.py and test_generation_loop.py compare with) are right: each token
    is the oracle's argmax after the ones before it, and each recorded top-2 margin is the oracle's, to fp32 error."""
    ref = load_reference(layout)
    j = 0
    while f"gen_prompt_{j}" in ref:
        prompt, tokens = ref[f"gen_prompt_{j}"].tolist(), ref[f"gen_tokens_{j}"].tolist()
        steps = oracle.cached_logits(FIXTURES / layout, prompt + tokens[:-1])[len(prompt) - 1 :]
        top2 = steps.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).numpy()
        assert abs(margin - ref[f"gen_margin_{j}"]).max() <= 2 * ORACLE_VS_TRANSFORMERS
        clear = margin > 2 * ORACLE_VS_TRANSFORMERS  # a near-tie may go either way in fp32
        assert clear.mean() > 0.9
        assert (steps.argmax(-1).numpy() == ref[f"gen_tokens_{j}"])[clear].all()
        j += 1
    assert j == 2
