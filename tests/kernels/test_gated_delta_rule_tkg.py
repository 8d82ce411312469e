"""The NKI decode kernel (kernels/gated_delta_rule/tkg.py) on the emulator against the fused PyTorch reference.

fp32 inputs within 1e-4 relative (outputs and states), bf16 inputs within 2e-2 relative (default bf16 operands, and
the fp32 / tf32 options); GQA (nv = 1x, 2x, 3x nk); the 2B layer shape (16 heads, dk = dv = 128); rows with zero
initial states (fresh sequences) beside others; the kernel returns the states and writes none of its inputs; the
state moves in runs of at least 4 KiB per partition.
"""

import pytest
import torch

from optimum_qwen35.kernels.gated_delta_rule import fused


def make(B, nk, nv, dk, dv, dtype, K=4, seed=0, zero_rows=()):
    """The seam's inputs, each row's initial states [B, ...] (zeros in `zero_rows`: fresh sequences)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = dict(
        mixed_qkv=r(B, C).to(dtype), a=r(B, nv).to(dtype), b=r(B, nv).to(dtype),
        A_log=r(nv) * 0.5, dt_bias=r(nv) * 0.5, conv_weight=(r(C, K) * 0.5).to(dtype),
        initial_conv=r(B, C, K - 1).to(dtype), initial_recurrent=r(B, nv, dk, dv) * 0.3,
    )
    for row in zero_rows:
        inputs["initial_conv"][row] = 0
        inputs["initial_recurrent"][row] = 0
    return inputs


def rel(x, y):
    return ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item()


def run_both(inputs, **options):
    """(o, final_conv, final_recurrent) of the reference and of the NKI seam, each on its own copy of the inputs."""
    ref = fused.deltanet_decode_reference(**{k: v.clone() for k, v in inputs.items()})
    nki = fused.deltanet_decode_nki(**{k: v.clone() for k, v in inputs.items()}, **options)
    return ref, nki


SHAPES = [  # (nk, nv, dk, dv)
    (2, 2, 32, 32),
    (4, 8, 16, 16),
    (2, 6, 16, 32),
    (16, 16, 128, 128),  # the 2B layer on one rank
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "nk%d-nv%d-dk%d-dv%d" % s)
def test_decode_matches_reference(shape, dtype, tol):
    nk, nv, dk, dv = shape
    B = 2 if dk < 128 else 1
    (o_ref, conv_ref, state_ref), (o_nki, conv_nki, state_nki) = run_both(make(B, nk, nv, dk, dv, dtype))
    for row in range(B):
        assert rel(o_nki[row], o_ref[row]) <= tol
        assert rel(state_nki[row], state_ref[row]) <= tol
    assert torch.equal(conv_nki, conv_ref)


@pytest.mark.parametrize("operands", ["tf32", "fp32"])
def test_other_operands_bf16_2b_shape(operands):
    """tf32 and fp32 TensorE operands (options for bf16 activations; the default is bf16) at the 2B layer shape:
    within the bf16 tolerance."""
    (o_ref, _, state_ref), (o_nki, _, state_nki) = run_both(make(1, 16, 16, 128, 128, torch.bfloat16, seed=5),
                                                            operands=operands)
    assert rel(o_nki, o_ref) <= 2e-2
    assert rel(state_nki, state_ref) <= 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_rows_beyond_one_selection_group(dtype, tol):
    """The q/k selection into the state layout runs for groups of rows (8 at this shape: one PSUM bank); 11 rows,
    so two groups, two of them with zero initial states (fresh sequences)."""
    (o_ref, conv_ref, state_ref), (o_nki, conv_nki, state_nki) = run_both(
        make(11, 2, 2, 32, 32, dtype, seed=4, zero_rows=(3, 8)))
    for row in range(11):
        assert rel(o_nki[row], o_ref[row]) <= tol
        assert rel(state_nki[row], state_ref[row]) <= tol
    assert torch.equal(conv_nki, conv_ref)


def test_decode_steps_chain_in_place():
    """Ten steps, each from the states the step before returned: the states carry from one launch to the next."""
    inputs = make(2, 2, 4, 16, 32, torch.float32, seed=2)
    ref = {k: v.clone() for k, v in inputs.items()}
    nki = {k: v.clone() for k, v in inputs.items()}
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        for key in ("mixed_qkv", "a", "b"):
            ref[key] = nki[key] = torch.randn(ref[key].shape, generator=g)
        o_ref, ref["initial_conv"], ref["initial_recurrent"] = fused.deltanet_decode_reference(**ref)
        o_nki, nki["initial_conv"], nki["initial_recurrent"] = fused.deltanet_decode_nki(**nki)
        assert rel(o_nki, o_ref) <= 1e-4
    assert rel(nki["initial_recurrent"], ref["initial_recurrent"]) <= 1e-4


def test_kernel_returns_the_states_and_writes_no_input():
    """The kernel returns o and each row's final conv and recurrent states (no in-place writes): its inputs are
    read-only arrays here (a write raises) and stay bit for bit as they were, donated or not."""
    from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

    inputs = make(3, 2, 4, 16, 32, torch.float32, seed=4, zero_rows=(2,))
    given = {k: v.clone() for k, v in inputs.items()}
    o_ref, conv_ref, state_ref = fused.deltanet_decode_reference(**{k: v.clone() for k, v in inputs.items()})
    o, conv, state = fused.deltanet_decode_nki(**inputs, donate_initial=True)
    assert all(torch.equal(inputs[k], given[k]) for k in inputs)
    assert torch.equal(conv, conv_ref)
    assert rel(state, state_ref) <= 1e-4 and rel(o, o_ref) <= 1e-4

    # The kernel itself: per-row outputs [B, ...] from read-only inputs.
    arrays = {k: fused._numpy(v) for k, v in inputs.items()}
    o_k, conv_k, state_k = gated_delta_rule_tkg(**arrays)
    assert conv_k.shape == inputs["initial_conv"].shape and state_k.shape == (3, 4, 16, 32)
    assert torch.equal(torch.from_numpy(conv_k), conv_ref)
    assert rel(torch.from_numpy(state_k), state_ref) <= 1e-4


@pytest.mark.parametrize("batch", [1, 8])
def test_state_traffic_in_runs_of_4_kib(batch):
    """At the 2B layer shape every transfer of the recurrent state (each row's state read, its new state written)
    moves runs of at least 4 KiB per partition, and they add up to the state read and written once per row."""
    import ml_dtypes
    import numpy as np

    from optimum_qwen35.kernels.emulator import estimate
    from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

    nk = nv = 16
    dk = dv = 128
    C, K = 2 * nk * dk + nv * dv, 4
    z, bf16 = np.zeros, ml_dtypes.bfloat16
    args = (z((batch, C), bf16), z((batch, nv), bf16), z((batch, nv), bf16), z(nv, np.float32), z(nv, np.float32),
            z((C, K), bf16), z((batch, C, K - 1), bf16), z((batch, nv, dk, dv), np.float32))
    estimate(gated_delta_rule_tkg, *args, target="trn2", compute=False)
    state_bytes = nv * dk * dv * 4
    big = [r for r in gated_delta_rule_tkg.last_trace.records if r.engine == "dma" and r.nbytes >= 256 * 1024]
    assert sum(r.nbytes for r in big) == 2 * batch * state_bytes
    assert all(r.nbytes / r.chunks >= 4096 for r in big)


def test_pieces_of_fewer_heads_give_the_same_result():
    """`heads_per_piece` (how many heads' states move and update together) changes the schedule, not the numbers."""
    from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

    inputs = make(2, 2, 8, 32, 32, torch.float32, seed=6, zero_rows=(1,))
    arrays = {k: fused._numpy(v) for k, v in inputs.items()}
    whole = gated_delta_rule_tkg(**arrays)
    pieces = gated_delta_rule_tkg(**arrays, heads_per_piece=2)
    for a, b in zip(whole, pieces):
        assert rel(torch.from_numpy(b), torch.from_numpy(a)) <= 1e-6
