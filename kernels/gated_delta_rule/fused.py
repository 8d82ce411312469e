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

The NKI versions take `operands` (operands.py): "auto" (default) gives bf16 TensorE operands for bf16 activations and
fp32 ones for fp32 activations (fp32 accumulation and an fp32 state either way); "fp32" (exact) and "tf32" stay
available for bf16 activations. The prefill kernel is launched with the target's LNC degree (2 on trn2: the heads
split over the two physical NeuronCores of the logical core).

Each seam has a PyTorch reference (`*_reference`, the math of the unfused model, op for op, calling the unfused entry
points through the dispatch so that a backend overriding one of them still takes effect) and an NKI version
(`*_nki`) that runs the kernels of `tkg.py` / `cte.py`. The kernels write none of their inputs: they read each row's
initial states from its slot (`initial_slots`: the slot `Slots.gather_initial` reads, -1 for a fresh row's zero
states) and return the new states per row ([B, ...]), as NxDI's DeltaNet kernels return their final state; the seam
puts them into the slots with `Slots.write`, as the reference does (in place on CPU, functional in the Neuron graphs,
where the scatter's result is the output aliased to the state input). With the real NKI (`nki_import.USING_EMULATOR`
False) the seams launch the `nki.jit` kernels on the torch tensors as they come (torch-xla tensors inside a traced
Neuron graph: each launch becomes one custom call of the graph, whose outputs are o and the states, compiled with it
by neuronx-cc); on the emulator they hand them read-only NumPy views of the same memory (a kernel writing an input
would raise).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch



def _upcast(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """torch's softplus (beta 1, threshold 20: x itself above the threshold, log(1 + exp(x)) below), written with
    exp, add, subtract, log, divide and select, which neuronx-cc's XLA operator list holds (torch-xla lowers
    F.softplus to log-plus-one, which it does not). log1p(u), u = exp(x) <= e^20, as log(1 + u) * u / ((1 + u) - 1),
    within a few ulp of log1p (the rounding of 1 + u cancels), and u itself where 1 + u rounds to 1."""
    # No Python scalar meets x in a compare or a select (torch-xla would make it an f64 or s64 constant).
    capped = x.clamp(max=threshold)  # keeps the branch the select drops finite
    u = torch.exp(capped)
    w = 1 + u
    d = w - 1
    rounded = d == torch.zeros_like(d)  # 1 + u == 1
    log1p = torch.where(rounded, u, torch.log(w) * (u / torch.where(rounded, torch.ones_like(d), d)))
    return torch.where(capped < x, x, log1p)  # capped < x: x above the threshold


def gates(a, b, A_log, dt_bias):
    """Raw projections -> (g, beta), as the model computes them: beta = sigmoid(b) in b's dtype; g in fp32."""
    beta = torch.sigmoid(b)
    g = -_upcast(A_log).exp() * softplus(_upcast(a) + dt_bias)
    return g, beta


# ------------------------------------------------------------------------------------------------------ references
def deltanet_decode_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots):
    from .. import _implementation, causal_conv1d_step  # the dispatched entry points
    from .reference import recurrent_gated_delta_rule_step as reference_step, recurrent_gated_delta_rule_step_

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
    step = _implementation("recurrent_gated_delta_rule_step", None)
    if slots.in_place and step is reference_step:
        # The CPU fast path: state_rows is this call's own copy of the slots' states (`gather_initial`), so the
        # reference step decays and updates it in place, the same numbers without another state-sized tensor (an
        # allocation per layer and step, page-faulted afresh: issue 31). The functional (Neuron) path is unchanged.
        step = recurrent_gated_delta_rule_step_
    o, new_state = step(q, k, v, g[:, :, None], beta[:, :, None], state_rows)
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
    """A read-only NumPy array sharing x's memory (bf16 through an int16 view): the kernels take their inputs as they
    are, and a kernel writing one would fail here instead of changing the caller's tensor."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        array = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = x.numpy()
    array.flags.writeable = False
    return array


def _torch(x) -> torch.Tensor:
    """A kernel output on the emulator (NumPy, bf16 as ml_dtypes) -> a torch tensor."""
    x = np.ascontiguousarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _on_emulator() -> bool:
    """True when `nki` is this project's CPU emulator (the seams hand it NumPy views of the tensors); False when it
    is the real NKI, whose `nki.jit` kernels take the torch tensors themselves (torch-xla tensors in a Neuron graph).
    """
    from ..nki_import import USING_EMULATOR

    return USING_EMULATOR


def _int32_row(x: torch.Tensor) -> torch.Tensor:
    """seq_ids / lengths [B] -> the kernels' [1, B] int32 layout."""
    return x.to(torch.int32).reshape(1, -1).contiguous()


def _initial_slots(slots) -> torch.Tensor:
    """[1, B] int32: the slot each row's initial states come from, as `Slots.gather_initial` reads them: the row's
    slot (slot 0 for an inactive row, whose results no slot keeps), or -1 for zero states (a fresh row)."""
    ids = slots.read
    if slots.fresh is not None:
        ids = torch.where(slots.fresh, torch.full_like(ids, -1), ids)
    return _int32_row(ids)


def _launch(kernel, *args):
    """Run an NKI kernel: on the torch tensors themselves with the real NKI (torch-xla tensors in a traced graph,
    where the launch is one custom call whose outputs are its results); on the emulator, on read-only NumPy views of
    the tensors' memory. Tensor arguments are made contiguous; other arguments pass as they are."""
    args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    if not _on_emulator():
        return kernel(*args)
    outputs = kernel(*[_numpy(a) if isinstance(a, torch.Tensor) else a for a in args])
    return tuple(_torch(o) for o in outputs)


def deltanet_decode_nki(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots,
                        operands="auto"):
    from .tkg import gated_delta_rule_tkg

    # The kernel reads each row's initial states from its slot and returns the new ones per row [B, ...] (it writes
    # none of its inputs); they go into the slots as the reference's do (`Slots.write`: in place or functional).
    o, new_conv, new_state = _launch(
        gated_delta_rule_tkg, mixed_qkv, a, b, A_log.float(), dt_bias.float(), conv_weight, conv_state,
        recurrent_state, _initial_slots(slots), operands,
    )
    return o, slots.write(conv_state, new_conv), slots.write(recurrent_state, new_state)


def _lnc() -> int:
    """The LNC degree the kernels are launched with: 2 on trn2 (neuronx-cc's default there; the prefill kernel splits
    the heads over the two physical NeuronCores), 1 on trn1/inf2."""
    from ..emulator.rules import get_target
    from ..emulator.runtime import _default_target_name

    return get_target(_default_target_name()).max_lnc


def deltanet_prefill_nki(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths, operands="auto"):
    from .cte import gated_delta_rule_cte, solve_masks

    if lengths is None:
        lengths = torch.full((q.shape[0],), q.shape[2], dtype=torch.int32, device=q.device)
    kernel = gated_delta_rule_cte[_lnc()]  # LNC=2 on trn2: half the heads on each physical core
    masks = torch.from_numpy(solve_masks()).to(q.device)  # a constant input
    o, final = _launch(
        kernel, q, k, v, a, b, A_log.float(), dt_bias.float(), recurrent_state, _initial_slots(slots),
        _int32_row(lengths), masks, operands,
    )
    return o, slots.write(recurrent_state, final)
