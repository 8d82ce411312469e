"""The NKI prefill kernel (kernels/gated_delta_rule/cte.py) on the emulator against the PyTorch reference.

fp32 inputs within 1e-4 relative (outputs and final state), bf16 inputs within 2e-2 (default bf16 operands, and the
fp32 / tf32 options); each row's nonzero initial state in, its final state returned (the kernel writes none of its
inputs); GQA nv = 1x, 2x, 3x nk; the 2B layer (16 heads, dk = dv = 128); mixed prompt lengths with right padding;
partial last chunks; a zero initial state (a fresh row); 2048 adversarial tokens (no decay, beta near 1, identical
keys) with no NaN or Inf.
"""

import pytest
import torch

from optimum_qwen35.kernels.gated_delta_rule import fused
from optimum_qwen35.kernels.gated_delta_rule.reference import recurrent_gated_delta_rule


def make(B, nk, nv, dk, dv, T, dtype, seed=0, zero_rows=()):
    """The seam's inputs with each row's initial state [B, ...] (zeros in `zero_rows`: fresh sequences)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = dict(
        q=r(B, nk, T, dk).to(dtype), k=r(B, nk, T, dk).to(dtype), v=r(B, nv, T, dv).to(dtype),
        a=r(B, T, nv).to(dtype), b=r(B, T, nv).to(dtype), A_log=r(nv) * 0.5, dt_bias=r(nv) * 0.5,
        initial_recurrent=r(B, nv, dk, dv) * 0.3,
    )
    for row in zero_rows:
        inputs["initial_recurrent"][row] = 0
    return inputs


def rel(x, y):
    return ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item()


def run_both(inputs, lengths, **options):
    """(o, final state) of the reference seam and of the NKI one, each on its own copy of the inputs."""
    ref = fused.deltanet_prefill_reference(**{k: v.clone() for k, v in inputs.items()}, lengths=lengths)
    nki = fused.deltanet_prefill_nki(**{k: v.clone() for k, v in inputs.items()}, lengths=lengths, **options)
    return ref, nki


def check(ref, nki, lengths, tol):
    (o_ref, state_ref), (o_nki, state_nki) = ref, nki
    for row, n in enumerate(lengths.tolist()):
        assert rel(o_nki[row, :, :n], o_ref[row, :, :n]) <= tol, f"row {row} output"
        assert rel(state_nki[row], state_ref[row]) <= tol, f"row {row} state"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(2, 2, 32, 32), (2, 4, 16, 32), (2, 6, 16, 16)],
                         ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
def test_prefill_matches_reference_mixed_lengths(shape, dtype, tol):
    """Two prompts (200 and 57 tokens, right-padded to 200: a full and a partial chunk) from nonzero states."""
    nk, nv, dk, dv = shape
    lengths = torch.tensor([200, 57])
    check(*run_both(make(2, nk, nv, dk, dv, 200, dtype), lengths), lengths, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_prefill_2b_layer_shape(dtype, tol):
    """16 heads, dk = dv = 128, 160 tokens (a full chunk and a partial one), a nonzero initial state."""
    lengths = torch.tensor([160])
    check(*run_both(make(1, 16, 16, 128, 128, 160, dtype, seed=1), lengths), lengths, tol)


@pytest.mark.parametrize("T,lengths", [(1, [1, 1]), (5, [5, 2]), (128, [128, 127])])
def test_short_and_exact_chunk_prompts(T, lengths):
    """One token, a few tokens (one partial chunk), exactly one chunk: fp32 within 1e-4."""
    lengths = torch.tensor(lengths)
    check(*run_both(make(2, 2, 4, 16, 16, T, torch.float32, seed=7), lengths), lengths, 1e-4)


@pytest.mark.parametrize("operands", ["tf32", "fp32"])
def test_other_operands_bf16(operands):
    """tf32 and fp32 TensorE operands (options for bf16 activations) with bf16 inputs: within the bf16 tolerance,
    mixed lengths."""
    lengths = torch.tensor([200, 57])
    check(*run_both(make(2, 2, 4, 32, 32, 200, torch.bfloat16, seed=6), lengths, operands=operands), lengths, 2e-2)


def test_operand_policy():
    """One rule for both kernels: the activation dtype picks the default (bf16 -> bf16, fp32 -> fp32); tf32 and bf16
    need bf16 activations."""
    from optimum_qwen35.kernels.gated_delta_rule.operands import matmul_dtype
    from optimum_qwen35.kernels.nki_import import nl

    assert matmul_dtype("auto", nl.bfloat16) == nl.bfloat16 and matmul_dtype("auto", nl.float32) == nl.float32
    assert matmul_dtype("fp32", nl.bfloat16) == nl.float32 and matmul_dtype("tf32", nl.bfloat16) == nl.tfloat32
    for operands in ("bf16", "tf32"):
        with pytest.raises(ValueError, match="bf16 activations"):
            matmul_dtype(operands, nl.float32)
    with pytest.raises(ValueError, match="expected one of"):
        matmul_dtype("fp16", nl.bfloat16)


@pytest.mark.parametrize("shape", [(2, 4, 32, 32), (16, 16, 128, 128)], ids=["nk2-nv4-dk32", "2b-layer"])
def test_default_operands_bf16(shape):
    """The default for bf16 activations (bf16 TensorE operands, the cost target's mode): within the bf16 tolerance,
    mixed lengths, nonzero initial states, about 5e-3 on outputs and 8e-3 on states at the 2B layer shape."""
    nk, nv, dk, dv = shape
    lengths = torch.tensor([200, 57])
    check(*run_both(make(2, nk, nv, dk, dv, 200, torch.bfloat16, seed=8), lengths), lengths, 2e-2)


def test_padding_changes_no_state():
    """Rows padded to 64 tokens (10 and 1 valid, one fresh): the padded prompt's final state equals the unpadded
    prompt's."""
    inputs = make(3, 2, 4, 16, 16, 64, torch.float32, seed=2, zero_rows=(1,))
    lengths = torch.tensor([10, 64, 1])
    ref, nki = run_both(inputs, lengths)
    check(ref, nki, lengths, 1e-4)
    solo = {k: v[0:1].clone() if k not in ("A_log", "dt_bias") else v.clone() for k, v in inputs.items()}
    for key in ("q", "k", "v"):
        solo[key] = solo[key][:, :, :10].contiguous()
    for key in ("a", "b"):
        solo[key] = solo[key][:, :10].contiguous()
    _, solo_state = fused.deltanet_prefill_nki(**solo, lengths=torch.tensor([10]))
    assert rel(solo_state[0], nki[1][0]) <= 1e-5


@pytest.mark.slow
def test_adversarial_2048_tokens_finite():
    """No decay (A_log = -30), beta near 1, every key identical: 2048 tokens in 16 chunks stay finite and match the
    token-by-token recurrence."""
    T, dk, dv = 2048, 32, 32
    g = torch.Generator().manual_seed(4)
    key = torch.randn(1, 1, 1, dk, generator=g).expand(1, 1, T, dk).contiguous()
    inputs = dict(
        q=torch.randn(1, 1, T, dk, generator=g), k=key, v=torch.randn(1, 1, T, dv, generator=g),
        a=torch.full((1, T, 1), -20.0), b=torch.full((1, T, 1), 12.0),
        A_log=torch.full((1,), -30.0), dt_bias=torch.zeros(1), initial_recurrent=torch.zeros(1, 1, dk, dv),
    )
    o, state = fused.deltanet_prefill_nki(**inputs, lengths=torch.tensor([T]))
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    # ground truth: the float64 recurrence on the same normalised inputs and gates
    q = fused.l2norm(inputs["q"].double()) * dk**-0.5
    k = fused.l2norm(inputs["k"].double())
    gg, beta = fused.gates(inputs["a"].double(), inputs["b"].double(), inputs["A_log"].double(),
                           inputs["dt_bias"].double())
    o64, s64 = recurrent_gated_delta_rule(q, k, inputs["v"].double(), gg.transpose(1, 2), beta.transpose(1, 2),
                                          torch.zeros(1, 1, dk, dv, dtype=torch.float64))
    assert rel(o, o64) <= 1e-3
    assert rel(state, s64) <= 1e-3


def test_kernel_returns_the_state_and_writes_no_input():
    """The kernel returns o and each row's final state (no in-place writes): its inputs are read-only arrays here (a
    write raises) and stay bit for bit as they were (a fresh row with a zero initial state among them)."""
    inputs = make(3, 2, 4, 16, 32, 150, torch.float32, seed=9, zero_rows=(2,))
    given = {k: v.clone() for k, v in inputs.items()}
    lengths = torch.tensor([150, 150, 40])
    o_ref, state_ref = fused.deltanet_prefill_reference(**{k: v.clone() for k, v in inputs.items()}, lengths=lengths)
    o, state = fused.deltanet_prefill_nki(**inputs, lengths=lengths)
    assert all(torch.equal(inputs[k], given[k]) for k in inputs)
    assert state is not inputs["initial_recurrent"]
    assert rel(state, state_ref) <= 1e-4
    assert rel(o[:2], o_ref[:2]) <= 1e-4 and rel(o[2, :, :40], o_ref[2, :, :40]) <= 1e-4


def test_the_lnc_degree_is_the_callers(monkeypatch):
    """The launch takes the LNC degree its caller passes (the Neuron layer factory's, from the compiled target): 1
    and 2 (the heads split over two programs) give the same numbers; without one, the emulator takes its target's;
    on a device (the real NKI) a launch without one is refused instead of guessing."""
    from optimum_qwen35.kernels import nki_import

    inputs = make(1, 2, 4, 16, 16, 40, torch.float32, seed=3)
    lengths = torch.tensor([40])
    launched = []
    real = fused._launch
    monkeypatch.setattr(fused, "_launch", lambda kernel, *args: launched.append(kernel.grid) or real(kernel, *args))
    results = [fused.deltanet_prefill_nki(**inputs, lengths=lengths, lnc=n) for n in (1, 2, None)]
    assert launched == [(1,), (2,), (2,)]  # None: trn2's (tests/kernels/conftest.py names the target)
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(other, results[0]))
    monkeypatch.setattr(nki_import, "USING_EMULATOR", False)
    with pytest.raises(ValueError, match="LNC degree"):
        fused.deltanet_prefill_nki(**inputs, lengths=lengths)
