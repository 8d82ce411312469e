"""The NKI decode kernel (kernels/gated_delta_rule/tkg.py) on the emulator against the fused PyTorch reference.

fp32 inputs within 1e-4 relative (outputs and states), bf16 inputs within 2e-2 relative (default bf16 operands, and
the fp32 / tf32 options); GQA (nv = 1x, 2x, 3x nk); the 2B layer shape (16 heads, dk = dv = 128); inactive rows
(seq_id -1) leave every state untouched; the kernel returns the states and writes none of its inputs; the state moves
in runs of at least 4 KiB per partition.
"""

import pytest
import torch

from optimum_qwen35.kernels.gated_delta_rule import fused
from optimum_qwen35.modeling.state import Slots


def make(B, slots, nk, nv, dk, dv, dtype, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        mixed_qkv=r(B, C).to(dtype), a=r(B, nv).to(dtype), b=r(B, nv).to(dtype),
        A_log=r(nv) * 0.5, dt_bias=r(nv) * 0.5, conv_weight=(r(C, K) * 0.5).to(dtype),
        conv_state=r(slots, C, K - 1).to(dtype), recurrent_state=r(slots, nv, dk, dv) * 0.3,
    )


def rel(x, y):
    return ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item()


def run_both(inputs, seq_ids):
    ref = {k: v.clone() for k, v in inputs.items()}
    nki = {k: v.clone() for k, v in inputs.items()}
    o_ref = fused.deltanet_decode_reference(**ref, slots=Slots(seq_ids))[0]
    o_nki = fused.deltanet_decode_nki(**nki, slots=Slots(seq_ids))[0]
    return o_ref, o_nki, ref, nki


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
    B, slots = (2, 3) if dk < 128 else (1, 2)
    inputs = make(B, slots, nk, nv, dk, dv, dtype)
    seq_ids = torch.tensor([slots - 1, 0][:B])
    o_ref, o_nki, ref, nki = run_both(inputs, seq_ids)
    for row, slot in enumerate(seq_ids.tolist()):
        assert rel(o_nki[row], o_ref[row]) <= tol
        assert rel(nki["recurrent_state"][slot], ref["recurrent_state"][slot]) <= tol
        assert torch.equal(nki["conv_state"][slot], ref["conv_state"][slot])


@pytest.mark.parametrize("operands", ["tf32", "fp32"])
def test_other_operands_bf16_2b_shape(operands):
    """tf32 and fp32 TensorE operands (options for bf16 activations; the default is bf16) at the 2B layer shape:
    within the bf16 tolerance."""
    inputs = make(1, 2, 16, 16, 128, 128, torch.bfloat16, seed=5)
    seq_ids = torch.tensor([1])
    ref = {k: v.clone() for k, v in inputs.items()}
    nki = {k: v.clone() for k, v in inputs.items()}
    o_ref = fused.deltanet_decode_reference(**ref, slots=Slots(seq_ids))[0]
    o_nki = fused.deltanet_decode_nki(**nki, slots=Slots(seq_ids), operands=operands)[0]
    assert rel(o_nki, o_ref) <= 2e-2
    assert rel(nki["recurrent_state"][1], ref["recurrent_state"][1]) <= 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_rows_beyond_one_selection_group(dtype, tol):
    """The q/k selection into the state layout runs for groups of rows (8 at this shape: one PSUM bank); 11 rows,
    so two groups, one row inactive, slots in shuffled order."""
    inputs = make(11, 12, 2, 2, 32, 32, dtype, seed=4)
    seq_ids = torch.tensor([5, 0, 11, -1, 3, 7, 1, 10, 2, 9, 4])
    o_ref, o_nki, ref, nki = run_both(inputs, seq_ids)
    for row, slot in enumerate(seq_ids.tolist()):
        if slot < 0:
            continue
        assert rel(o_nki[row], o_ref[row]) <= tol
        assert rel(nki["recurrent_state"][slot], ref["recurrent_state"][slot]) <= tol
        assert torch.equal(nki["conv_state"][slot], ref["conv_state"][slot])
    assert torch.equal(nki["recurrent_state"][6], inputs["recurrent_state"][6])  # no row names slot 6
    assert torch.equal(nki["conv_state"][8], inputs["conv_state"][8])


def test_inactive_rows_touch_nothing():
    inputs = make(3, 4, 2, 4, 16, 16, torch.float32, seed=1)
    seq_ids = torch.tensor([3, -1, 1])
    o_ref, o_nki, ref, nki = run_both(inputs, seq_ids)
    for slot in (0, 2):  # slots no active row names: unchanged, bit for bit
        assert torch.equal(nki["recurrent_state"][slot], inputs["recurrent_state"][slot])
        assert torch.equal(nki["conv_state"][slot], inputs["conv_state"][slot])
    for row, slot in ((0, 3), (2, 1)):
        assert rel(o_nki[row], o_ref[row]) <= 1e-4
        assert rel(nki["recurrent_state"][slot], ref["recurrent_state"][slot]) <= 1e-4
    assert torch.isfinite(o_nki[[0, 2]]).all()


def test_decode_steps_chain_in_place():
    """Ten steps on the same slots: the in-place states carry from one launch to the next."""
    inputs = make(2, 2, 2, 4, 16, 32, torch.float32, seed=2)
    ref = {k: v.clone() for k, v in inputs.items()}
    nki = {k: v.clone() for k, v in inputs.items()}
    seq_ids = torch.tensor([1, 0])
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        for key in ("mixed_qkv", "a", "b"):
            ref[key] = nki[key] = torch.randn(ref[key].shape, generator=g)
        o_ref = fused.deltanet_decode_reference(**ref, slots=Slots(seq_ids))[0]
        o_nki = fused.deltanet_decode_nki(**nki, slots=Slots(seq_ids))[0]
        assert rel(o_nki, o_ref) <= 1e-4
    assert rel(nki["recurrent_state"], ref["recurrent_state"]) <= 1e-4


def test_kernel_returns_the_states_and_writes_no_input():
    """The kernel returns o and each row's new conv and recurrent states (no in-place writes): its inputs are
    read-only arrays here (a write raises) and stay bit for bit as they were. The seam puts the rows' states into
    the slots functionally, as the reference does (a fresh row starts from zero states, an inactive row changes
    nothing)."""
    from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

    inputs = make(3, 4, 2, 4, 16, 32, torch.float32, seed=4)
    given = {k: v.clone() for k, v in inputs.items()}
    seq_ids, fresh = torch.tensor([3, -1, 1]), torch.tensor([False, False, True])
    ref = {k: v.clone() for k, v in inputs.items()}
    o_ref, conv_ref, state_ref = fused.deltanet_decode_reference(**ref, slots=Slots(seq_ids, fresh, in_place=False))
    o, conv, state = fused.deltanet_decode_nki(**inputs, slots=Slots(seq_ids, fresh, in_place=False))
    assert all(torch.equal(inputs[k], given[k]) for k in inputs)
    assert conv is not inputs["conv_state"] and state is not inputs["recurrent_state"]
    assert torch.equal(conv, conv_ref)
    assert rel(state, state_ref) <= 1e-4
    assert rel(o[[0, 2]], o_ref[[0, 2]]) <= 1e-4

    # The kernel itself: per-row outputs [B, ...] from read-only inputs.
    arrays = {k: fused._numpy(v) for k, v in inputs.items()}
    initial = fused._numpy(torch.tensor([[3, 0, -1]], dtype=torch.int32))
    o_k, conv_k, state_k = gated_delta_rule_tkg(**arrays, initial_slots=initial)
    assert conv_k.shape == (3, *inputs["conv_state"].shape[1:]) and state_k.shape == (3, 4, 16, 32)
    assert torch.equal(torch.from_numpy(conv_k[2]), conv_ref[1])  # the fresh row's state went to slot 1
    assert rel(torch.from_numpy(state_k[0]), state_ref[3]) <= 1e-4


@pytest.mark.parametrize("batch", [1, 8])
def test_state_traffic_in_runs_of_4_kib(batch):
    """At the 2B layer shape every transfer of the recurrent state (each slot's read, each row's new state written)
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
            z((C, K), bf16), z((batch, C, K - 1), bf16), z((batch, nv, dk, dv), np.float32),
            np.arange(batch, dtype=np.int32).reshape(1, batch))
    estimate(gated_delta_rule_tkg, *args, target="trn2", compute=False)
    state_bytes = nv * dk * dv * 4
    big = [r for r in gated_delta_rule_tkg.last_trace.records if r.engine == "dma" and r.nbytes >= 256 * 1024]
    assert sum(r.nbytes for r in big) == 2 * batch * state_bytes
    assert all(r.nbytes / r.chunks >= 4096 for r in big)


def test_pieces_of_fewer_heads_give_the_same_result():
    """`heads_per_piece` (how many heads' states move and update together) changes the schedule, not the numbers."""
    from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

    inputs = make(2, 3, 2, 8, 32, 32, torch.float32, seed=6)
    arrays = {k: fused._numpy(v) for k, v in inputs.items()}
    initial = fused._numpy(torch.tensor([[2, -1]], dtype=torch.int32))
    whole = gated_delta_rule_tkg(**arrays, initial_slots=initial)
    pieces = gated_delta_rule_tkg(**arrays, initial_slots=initial, heads_per_piece=2)
    for a, b in zip(whole, pieces):
        assert rel(torch.from_numpy(b), torch.from_numpy(a)) <= 1e-6
