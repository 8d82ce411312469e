"""The fused DeltaNet seams: raw projections and each row's initial states in; the output and each row's final states
out. Tensors in, tensors out: which slot a row's states live in is the caller's business (the mixer gathers them with
`Slots.gather_initial`, zeros for a fresh row, and writes the final ones back with `Slots.write`).

    deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, lnc, donate_initial)
            -> (o, final_conv, final_recurrent)
        mixed_qkv [B, C] (in_proj_qkv output before the conv), a, b [B, nv] raw, A_log, dt_bias [nv],
        conv_weight [C, K], initial_conv [B, C, K - 1] (activation dtype), initial_recurrent [B, nv, dk, dv] fp32.
        Returns o [B, nv, dv] fp32 (before the gated RMSNorm), final_conv [B, C, K - 1] and final_recurrent
        [B, nv, dk, dv] fp32: the states after the row's token.

    deltanet_verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, lnc)
            -> (o, convs, recurrents)
        T consecutive decode steps per row (speculative verification of k + 1 = T tokens), each position's states
        kept: mixed_qkv [B, T, C], a, b [B, T, nv], the rest as `deltanet_decode` (the states before position 0).
        Returns o [B, nv, T, dv] fp32, convs [B, T, C, K - 1] and recurrents [B, T * nv, dk, dv] fp32 (the states
        after each position, position-major within a row: rank 4, which the Neuron compiler requires). Position t
        computes exactly what `deltanet_decode` computes from position t - 1's states.

    deltanet_prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, *, lnc) -> (o, final_recurrent)
        q, k [B, nk, T, dk] and v [B, nv, T, dv] after the conv and SiLU, before normalisation (activation dtype);
        a, b [B, T, nv] raw; initial_recurrent [B, nv, dk, dv] fp32; lengths [B] or None (tokens past lengths[b]
        are padding and change no state). Returns o [B, nv, T, dv] fp32 and final_recurrent [B, nv, dk, dv] fp32,
        the state after position lengths[b] - 1.

`lnc`: the logical NeuronCore degree the graph is compiled for (2 on trn2: the prefill kernel splits the heads over
the two physical cores of the logical core; 1 on trn1/inf2), which the caller knows (the Neuron layer factory's
`kernel_lnc`); None only on the CPU emulator, which then takes the degree of the target it emulates. The references
ignore it.

`donate_initial` (decode): the caller gives up the initial-state tensors (its own copies, as `Slots.gather_initial`
makes them), so an implementation may compute the final states in their memory. The CPU reference does (the in-place
decode step: no new state-sized tensor per layer and step, issue 31); the NKI kernels write none of their inputs. The
custom ops (custom_ops.py) never donate.

Prefix caching's prefill from cached states takes them as `initial_recurrent` (and the conv state as
`causal_conv1d`'s initial state, as the mixer does) and would return the states at block boundaries next to the final
one. Neither needs a slot in the seam.

The NKI versions take `operands` (operands.py): "auto" (default) gives bf16 TensorE operands for bf16 activations and
fp32 ones for fp32 activations (fp32 accumulation and an fp32 state either way); "fp32" (exact) and "tf32" stay
available for bf16 activations.

Each seam has a PyTorch reference (`*_reference`, the math of the unfused model, op for op, over the unfused
functions it is given: the dispatch hands a backend's own unfused entry points to the reference seams it does not
replace) and an NKI version (`*_nki`) that runs the kernels of `tkg.py` / `cte.py`, which write none of their inputs
and return the final states per row, as NxDI's DeltaNet kernels return their final state. With the real NKI
(`nki_import.USING_EMULATOR` False) the seams launch the `nki.jit` kernels on the torch tensors as they come (torch-xla
tensors inside a traced Neuron graph: each launch becomes one custom call of the graph, whose outputs are o and the
states, compiled with it by neuronx-cc); on the emulator they hand them read-only NumPy views of the same memory (a
kernel writing an input would raise).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

from ..conv1d.reference import causal_conv1d_step
from .reference import chunk_gated_delta_rule, recurrent_gated_delta_rule_step, recurrent_gated_delta_rule_step_

# The NKI versions import nki_import, the kernel modules and the emulator's target when first called (deferred
# imports below): importing them imports NKI (the real package where installed, else the emulator), which a model on
# the torch backend never needs, and `nki_import.use_emulator()` (tests) must be able to run before the kernel modules
# bind their `nki` names.


def _upcast(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """torch's softplus (beta 1, threshold 20: x itself above the threshold, log(1 + exp(x)) below), written with
    exp, add, subtract, log, divide and select, which neuronx-cc's XLA operator list holds (torch-xla lowers
    F.softplus to log-plus-one, which it does not). log1p(u), u = exp(x) <= e^20, as log(1 + u) * u / ((1 + u) - 1),
    within a few ulp of log1p (the rounding of 1 + u cancels), and u itself where 1 + u rounds to 1.

    Only the graphs that go to a Neuron compiler take this form (the "torch_for_neuron" kernel backend, which the NxD
    and TorchNeuron layer factories name): its few ulp, through a fast-decaying head's state, doubled the fp32 error
    of a model against float64 on an nv = 3 nk layout (issue 50). Everywhere else the gates take `rounded_softplus`."""
    # No Python scalar meets x in a compare or a select (torch-xla would make it an f64 or s64 constant).
    capped = x.clamp(max=threshold)  # keeps the branch the select drops finite
    u = torch.exp(capped)
    w = 1 + u
    d = w - 1
    rounded = d == torch.zeros_like(d)  # 1 + u == 1
    log1p = torch.where(rounded, u, torch.log(w) * (u / torch.where(rounded, torch.ones_like(d), d)))
    return torch.where(capped < x, x, log1p)  # capped < x: x above the threshold


def rounded_softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus computed in float64 and rounded once to x's dtype: within half an ulp of the exact softplus
    (F.softplus in fp32 is within about 1.5 ulp, this module's `softplus` within about 3). The gate's softplus on CPU:
    [rows, tokens, value heads] values, a negligible cost next to the projections (issue 50)."""
    if x.dtype == torch.float64:
        return F.softplus(x)
    return F.softplus(x.double()).to(x.dtype)


def gates(a, b, A_log, dt_bias, softplus=rounded_softplus):
    """Raw projections -> (g, beta), as the model computes them: beta = sigmoid(b) in b's dtype; g in fp32.
    `softplus`: `rounded_softplus` (the CPU models), or this module's `softplus` in a graph for a Neuron compiler
    (no float64 there)."""
    beta = torch.sigmoid(b)
    g = -_upcast(A_log).exp() * softplus(_upcast(a) + dt_bias)
    return g, beta


# ------------------------------------------------------------------------------------------------------ references
def deltanet_decode_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *,
                              lnc=None, donate_initial=False, conv_step=causal_conv1d_step,
                              rule_step=recurrent_gated_delta_rule_step, softplus=rounded_softplus):
    """The decode seam over the unfused `conv_step` / `rule_step` (the dispatch passes its backend's)."""
    B, C = mixed_qkv.shape
    _, nv, dk, dv = initial_recurrent.shape
    nk = (C - nv * dv) // (2 * dk)
    mixed, final_conv = conv_step(mixed_qkv, conv_weight, initial_conv)
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2norm(_upcast(q.reshape(B, nk, 1, dk))) * dk**-0.5
    k = l2norm(_upcast(k.reshape(B, nk, 1, dk)))
    v = _upcast(v.reshape(B, nv, 1, dv))
    g, beta = gates(a, b, A_log, dt_bias, softplus)  # [B, nv]
    if donate_initial and rule_step is recurrent_gated_delta_rule_step:
        # The CPU fast path: initial_recurrent is the caller's own copy (`Slots.gather_initial`), so the reference
        # step decays and updates it in place, the same numbers without another state-sized tensor (an allocation
        # per layer and step, page-faulted afresh: issue 31).
        rule_step = recurrent_gated_delta_rule_step_
    o, final_recurrent = rule_step(q, k, v, g[:, :, None], beta[:, :, None], initial_recurrent)
    return o[:, :, 0], final_conv.to(initial_conv.dtype), final_recurrent


def deltanet_verify_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *,
                              lnc=None, decode=deltanet_decode_reference):
    """The verify seam as T calls of the decode seam `decode` (the dispatch passes its backend's), each from the
    states the call before returned (new tensors: no donation, the caller keeps every position's states)."""
    T = mixed_qkv.shape[1]
    conv, recurrent = initial_conv, initial_recurrent
    outputs, convs, recurrents = [], [], []
    for t in range(T):
        o, conv, recurrent = decode(mixed_qkv[:, t].contiguous(), a[:, t].contiguous(), b[:, t].contiguous(), A_log,
                                    dt_bias, conv_weight, conv, recurrent, lnc=lnc, donate_initial=False)
        outputs.append(o)
        convs.append(conv)
        recurrents.append(recurrent)
    return torch.stack(outputs, dim=2), torch.stack(convs, 1), torch.cat(recurrents, 1)


def deltanet_prefill_reference(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, *, lnc=None,
                               chunk_rule=chunk_gated_delta_rule, softplus=rounded_softplus):
    """The prefill seam over the unfused `chunk_rule` (the dispatch passes its backend's). With the reference rule and
    bf16 activations, the rule's products named in `reference.BF16_PRODUCTS` take bf16 operands (fp32 accumulation);
    the norms, gates, state and the rest stay fp32. Another backend's rule gets the seven tensors only."""
    B, nk, T, dk = q.shape
    bf16 = chunk_rule is chunk_gated_delta_rule and q.dtype == torch.bfloat16
    low = {"matmul_dtype": torch.bfloat16} if bf16 else {}
    q = l2norm(_upcast(q)) * dk**-0.5
    k = l2norm(_upcast(k))
    v = _upcast(v)
    g, beta = gates(a, b, A_log, dt_bias, softplus)  # [B, T, nv]
    return chunk_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), initial_recurrent, lengths, **low)


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
    from .. import nki_import  # deferred: see the imports above; read at each call (`use_emulator` switches it)

    return nki_import.USING_EMULATOR


def _int32_row(x: torch.Tensor) -> torch.Tensor:
    """lengths [B] -> the kernels' [1, B] int32 layout."""
    return x.to(torch.int32).reshape(1, -1).contiguous()


def _launch(kernel, *args):
    """Run an NKI kernel: on the torch tensors themselves with the real NKI (torch-xla tensors in a traced graph,
    where the launch is one custom call whose outputs are its results); on the emulator, on read-only NumPy views of
    the tensors' memory. Tensor arguments are made contiguous; other arguments pass as they are."""
    args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    if not _on_emulator():
        return kernel(*args)
    outputs = kernel(*[_numpy(a) if isinstance(a, torch.Tensor) else a for a in args])
    return tuple(_torch(o) for o in outputs)


def _lnc(lnc: int | None) -> int:
    """The LNC degree a launch takes: the caller's (the Neuron layer factory's, from the compiled target: 2 on trn2,
    1 on trn1/inf2); where none is given, on the emulator only, that of the target the emulator emulates."""
    if lnc is not None:
        return lnc
    if not _on_emulator():
        raise ValueError("an NKI launch on a device needs the LNC degree its graph is compiled with (`lnc=`)")
    from ..emulator.rules import get_target  # deferred: see the imports above
    from ..emulator.runtime import default_target_name  # deferred: see the imports above

    return get_target(default_target_name()).max_lnc


def deltanet_decode_nki(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, lnc=None,
                        donate_initial=False, operands="auto"):
    from .tkg import gated_delta_rule_tkg  # deferred: see the imports above

    # One launch, one program (the decode kernel has no LNC split); the kernel writes none of its inputs, so
    # `donate_initial` changes nothing here.
    return _launch(gated_delta_rule_tkg, mixed_qkv, a, b, A_log.float(), dt_bias.float(), conv_weight, initial_conv,
                   initial_recurrent, operands)


def deltanet_prefill_nki(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, *, lnc=None, operands="auto"):
    from .cte import gated_delta_rule_cte, solve_masks  # deferred: see the imports above

    if lengths is None:
        lengths = torch.full((q.shape[0],), q.shape[2], dtype=torch.int32, device=q.device)
    kernel = gated_delta_rule_cte[_lnc(lnc)]  # LNC=2 on trn2: half the heads on each physical core
    masks = torch.from_numpy(solve_masks()).to(q.device)  # a constant input
    return _launch(kernel, q, k, v, a, b, A_log.float(), dt_bias.float(), initial_recurrent, _int32_row(lengths),
                   masks, operands)


def deltanet_verify_nki(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, lnc=None,
                        operands="auto"):
    from .tkg import gated_delta_rule_verify  # deferred: see the imports above

    # One launch for every row and position (the decode kernel's steps, each position's states stored as it goes).
    o, convs, recurrents = _launch(gated_delta_rule_verify, mixed_qkv, a, b, A_log.float(), dt_bias.float(),
                                   conv_weight, initial_conv, initial_recurrent, operands)
    return o.transpose(1, 2), convs, recurrents  # o [B, T, nv, dv] -> [B, nv, T, dv], as the reference's
