"""The fused DeltaNet seams: raw projections in, the output and the slots' updated conv and recurrent states out.

    deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots)
            -> (o, conv_state, recurrent_state)
        mixed_qkv [B, C] (in_proj_qkv output before the conv), a, b [B, nv] raw, A_log, dt_bias [nv],
        conv_weight [C, K], conv_state [slots, C, K - 1], recurrent_state [slots, nv, dk, dv] fp32, slots
        (`modeling.state.Slots`: seq_ids [B], -1 an inactive row; fresh rows start from zero states; in place or
        functional). Returns o [B, nv, dv] fp32 (before the gated RMSNorm) and the two states, in which the slots of
        active rows are updated and nothing else.

    deltanet_prefill(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths) -> (o, recurrent_state)
        q, k [B, nk, T, dk] and v [B, nv, T, dv] after the conv and SiLU, before normalisation (activation dtype);
        a, b [B, T, nv] raw; lengths [B] (tokens past lengths[b] are padding and change no state). The initial state
        is recurrent_state[seq_ids[b]] (zero for a fresh row), the final one is written to that slot, in fp32.
        Returns o [B, nv, T, dv] fp32 and the state.

Whether the states come back written in place or as updated copies is `slots.in_place` (the layer factory's choice:
in place on CPU, functional in the Neuron graphs, whose aliased outputs must be new values; see modeling/state.py).

The NKI versions take `tf32_matmul` (default False): tf32 TensorE operands for bf16 activations, at the bf16 TensorE
rate, instead of fp32 ones (exact; what the `nki` backend runs, so that it gives the reference's greedy tokens).
`run_prefill_kernel` also offers bf16 operands (`bf16_matmul=True`, bf16 activations: the fastest prefill, within
the bf16 tolerance; the mode of the cost target in docs/kernels.md). The prefill kernel is launched with the
target's LNC degree (2 on trn2: the heads split over the two physical NeuronCores of the logical core).

Each seam has a PyTorch reference (`*_reference`, the math of the unfused model, op for op, calling the unfused entry
points through the dispatch so that a backend overriding one of them still takes effect) and an NKI version
(`*_nki`) that runs the kernels of `tkg.py` / `cte.py`: with the real NKI (`nki_import.USING_EMULATOR` False) it
launches the `nki.jit` kernels on the torch tensors as they come (torch-xla tensors inside a traced Neuron graph:
each launch becomes one custom call of the graph, compiled with it by neuronx-cc); on the emulator it hands them
NumPy views of the same memory, so that the kernels' in-place state writes land in the torch tensors (copies of them
first, when the slots ask for functional updates). The NKI kernels write the states they are given in place and
return only o, which a custom call inside a traced graph cannot do (its outputs are its only effects): the real-NKI
branch refuses functional updates, and the Neuron graphs do not choose these kernels (`neuron.glue.kernel_backend`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F



def _upcast(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gates(a, b, A_log, dt_bias):
    """Raw projections -> (g, beta), as the model computes them: beta = sigmoid(b) in b's dtype; g in fp32."""
    beta = torch.sigmoid(b)
    g = -_upcast(A_log).exp() * F.softplus(_upcast(a) + dt_bias)
    return g, beta


# ------------------------------------------------------------------------------------------------------ references
def deltanet_decode_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots):
    from .. import causal_conv1d_step, recurrent_gated_delta_rule_step  # the dispatched entry points

    B, C = mixed_qkv.shape
    _, nv, dk, dv = recurrent_state.shape
    nk = (C - nv * dv) // (2 * dk)
    conv_rows, state_rows = slots.gather_initial(conv_state), slots.gather_initial(recurrent_state)
    mixed, new_conv = causal_conv1d_step(mixed_qkv, conv_weight, conv_rows)
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2norm(_upcast(q.reshape(B, nk, 1, dk))) * dk**-0.5
    k = l2norm(_upcast(k.reshape(B, nk, 1, dk)))
    v = _upcast(v.reshape(B, nv, 1, dv))
    g, beta = gates(a, b, A_log, dt_bias)  # [B, nv]
    o, new_state = recurrent_gated_delta_rule_step(q, k, v, g[:, :, None], beta[:, :, None], state_rows)
    return o[:, :, 0], slots.write(conv_state, new_conv, conv_rows), slots.write(recurrent_state, new_state, state_rows)


def deltanet_prefill_reference(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths):
    from .. import chunk_gated_delta_rule  # the dispatched entry point

    B, nk, T, dk = q.shape
    q = l2norm(_upcast(q)) * dk**-0.5
    k = l2norm(_upcast(k))
    v = _upcast(v)
    g, beta = gates(a, b, A_log, dt_bias)  # [B, T, nv]
    initial = slots.gather_initial(recurrent_state)
    o, final = chunk_gated_delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), initial, lengths)
    return o, slots.write(recurrent_state, final, initial)


# ------------------------------------------------------------------------------------------------------ NKI versions
def _numpy(x: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing x's memory (bf16 through an int16 view), so that a kernel writing it writes x."""
    if not x.is_contiguous():
        raise ValueError("the NKI seams update states in place and need contiguous tensors")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _on_emulator() -> bool:
    """True when `nki` is this project's CPU emulator (the seams hand it NumPy views of the tensors); False when it
    is the real NKI, whose `nki.jit` kernels take the torch tensors themselves (torch-xla tensors in a Neuron graph).
    """
    from ..nki_import import USING_EMULATOR

    return USING_EMULATOR


def _int32_row(x: torch.Tensor) -> torch.Tensor:
    """seq_ids / lengths [B] -> the kernels' [1, B] int32 layout."""
    return x.to(torch.int32).reshape(1, -1).contiguous()


def _states_for_kernel(slots, *states):
    """The state tensors an in-place kernel may write: the given ones, or copies for functional updates (and not on
    real NKI, where a kernel writing its inputs inside a traced graph would lose the writes); the fresh rows' slots
    reset to zero first, since the kernels read each row's initial state from its slot."""
    if not slots.in_place:
        if not _on_emulator():
            raise NotImplementedError(
                "the NKI DeltaNet kernels write their state inputs in place and return only o; a Neuron graph needs "
                "the updated states as outputs: use the 'torch' kernel backend there"
            )
        states = tuple(s.clone() for s in states)
    if slots.fresh is not None:
        states = tuple(slots.write(s, slots.gather_initial(s)) for s in states)
    return states


def deltanet_decode_nki(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots,
                        tf32_matmul=False):
    from .tkg import gated_delta_rule_tkg

    args = (mixed_qkv.contiguous(), a.contiguous(), b.contiguous(), A_log.float().contiguous(),
            dt_bias.float().contiguous(), conv_weight.contiguous())
    conv_state, recurrent_state = _states_for_kernel(slots, conv_state, recurrent_state)
    if not _on_emulator():
        # The real kernel, launched on the tensors as given: it writes the slots of conv_state and recurrent_state in
        # place and returns o, as on the emulator (in place only: see `_states_for_kernel`).
        o = gated_delta_rule_tkg(*args, conv_state, recurrent_state, _int32_row(slots.seq_ids), tf32_matmul)
        return o, conv_state, recurrent_state
    o = gated_delta_rule_tkg(
        *map(_numpy, args), _numpy(conv_state), _numpy(recurrent_state), _numpy(_int32_row(slots.seq_ids)),
        tf32_matmul,
    )
    return torch.from_numpy(np.asarray(o, dtype=np.float32)), conv_state, recurrent_state


def _lnc() -> int:
    """The LNC degree the kernels are launched with: 2 on trn2 (neuronx-cc's default there; the prefill kernel splits
    the heads over the two physical NeuronCores), 1 on trn1/inf2."""
    from ..emulator.rules import get_target
    from ..emulator.runtime import _default_target_name

    return get_target(_default_target_name()).max_lnc


def run_prefill_kernel(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths, tf32_matmul=False,
                       bf16_matmul=False):
    """`deltanet_prefill_nki` with the operand choice of the kernel: fp32 (default), tf32 or bf16 TensorE operands
    (the last two for bf16 activations only; see cte.py)."""
    from .cte import gated_delta_rule_cte, solve_masks

    if lengths is None:
        lengths = torch.full((q.shape[0],), q.shape[2], dtype=torch.int32, device=q.device)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(),
            A_log.float().contiguous(), dt_bias.float().contiguous())
    kernel = gated_delta_rule_cte[_lnc()]  # LNC=2 on trn2: half the heads on each physical core
    (recurrent_state,) = _states_for_kernel(slots, recurrent_state)
    seq_ids = _int32_row(slots.seq_ids)
    if not _on_emulator():
        # The real kernel on the tensors as given; the solve masks (a constant) go to the device with them. It writes
        # the slots' final states into recurrent_state in place and returns o.
        masks = torch.from_numpy(solve_masks()).to(q.device)
        o = kernel(*args, recurrent_state, seq_ids, _int32_row(lengths), masks, tf32_matmul, bf16_matmul)
        return o, recurrent_state
    o = kernel(
        *map(_numpy, args), _numpy(recurrent_state), _numpy(seq_ids), _numpy(_int32_row(lengths)),
        solve_masks(), tf32_matmul, bf16_matmul,
    )
    return torch.from_numpy(np.asarray(o, dtype=np.float32)), recurrent_state


def deltanet_prefill_nki(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths, tf32_matmul=False):
    return run_prefill_kernel(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths, tf32_matmul)
