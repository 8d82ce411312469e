"""What the Neuron graphs need around the model, as plain torch (no Neuron SDK): every function here runs on CPU.

optimum-neuron 0.4.5's traced decoder (`NxDDecoderModelForCausalLM.forward`) takes
`(input_ids, position_ids, seq_ids, sampling_params)` and returns `[tokens or logits, *cache tensors]`, each cache
tensor a module parameter aliased to its output (`DecoderModelInstanceForCausalLM.get`), so that the runtime
updates it in place and never returns it. This module fixes, for Qwen3.5:

- the order of the held state: the K/V of the attention layers first (what optimum-neuron calls the KV cache),
  then the DeltaNet conv and recurrent states (`StateLayout`), and the alias map held state j -> output 1 + j;
- the traced forward itself (`step`): context encoding when more than one token comes in, token generation for one;
- optimum-neuron's input conventions: prompts right-padded to the context length with position 1
  (`decoder_wrappers.py` L115-124), hence `context_attention_mask`; a 1-token prompt served by the
  token-generation graph at position 0 (`modeling_decoder.py` L380), which the decoder reads as a fresh row;
- `restore_state_dtypes`, `restore_fp32_parameters`: optimum-neuron casts every floating tensor of the module to the
  model dtype when it builds it (`decoder_builders.py` L106-117), the recurrent state and the gate parameters
  (`A_log`, `dt_bias`) included; they must be fp32 again before tracing (the rotary
  frequencies survive that cast by themselves: `RotaryEmbedding._apply` rebuilds them);
- `compiler_args` and `check_neuron_config` (speculation, on-device sampling and extra logits outputs off);
- `set_local_world_size`: the `LOCAL_WORLD_SIZE` neuronx-distributed's parallel state reads on trn1 / inf2 at TP 4;
- `kernel_backend`: which kernel backend the traced DeltaNet layers call, by target (the PyTorch references; the NKI
  kernels on request, on trn2 and later with the real NKI package).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from optimum_qwen35.checkpoint.fp8 import E4M3FN_AS_E4M3_FLAG
from optimum_qwen35.kernels.backends import FOR_NEURON
from optimum_qwen35.modeling.precision import FP32_PARAMETERS
from optimum_qwen35.modeling.state import StateSpec

# Graph outputs: [logits, *held state]: the held state j is output STATE_OUTPUT_OFFSET + j.
STATE_OUTPUT_OFFSET = 1
KV_STATE_SUFFIXES = (".key_cache", ".value_cache")


class StateLayout:
    """The decoder's state list (layer by layer, `Qwen35Decoder.state_specs`) and the order the graph holds it in.

    Held (and output) order: the K and V of every attention layer in layer order, then the conv and recurrent
    states of every DeltaNet layer in layer order. `output_order[j]` is the decoder index of held state j.
    """

    def __init__(self, specs: Sequence[StateSpec]):
        self.specs = list(specs)
        kv = [i for i, s in enumerate(self.specs) if s.name.endswith(KV_STATE_SUFFIXES)]
        recurrent = [i for i, s in enumerate(self.specs) if not s.name.endswith(KV_STATE_SUFFIXES)]
        self.output_order = kv + recurrent
        self.num_kv = len(kv)
        self._held_index = {decoder_index: j for j, decoder_index in enumerate(self.output_order)}

    @property
    def held_specs(self) -> list[StateSpec]:
        return [self.specs[i] for i in self.output_order]

    def is_kv(self, held_index: int) -> bool:
        return held_index < self.num_kv

    def to_held(self, state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Decoder order -> held (output) order."""
        return [state[i] for i in self.output_order]

    def to_decoder(self, held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Held (output) order -> decoder order."""
        return [held[self._held_index[i]] for i in range(len(self.specs))]

    def alias_map(self) -> dict[int, int]:
        """Held state index -> the graph output that updates it in place."""
        return {j: STATE_OUTPUT_OFFSET + j for j in range(len(self.specs))}


def context_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Real tokens per row of a context-encoding input in optimum-neuron's convention: positions p0 .. p0 + n - 1,
    then padding at position 1, so n = max(position) - p0 + 1 (p0 = 0 for a new prompt).

    A 1-token prompt padded to a wider batch ([0, 1, 1, ...]) reads as 2 tokens, the pad included: optimum-neuron
    then continues that row at position max + 1 = 2 (`increase_position_ids`), which is consistent with it.
    """
    return position_ids.amax(-1) - position_ids[:, 0] + 1


def context_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] 1 for the real tokens of right-padded rows (see `context_lengths`), 0 for the padding."""
    columns = torch.arange(position_ids.shape[-1], device=position_ids.device, dtype=position_ids.dtype)[None, :]
    return (columns < context_lengths(position_ids)[:, None]).to(position_ids.dtype)


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """optimum-neuron's position ids for a right-padded batch (`generation_utils.py` L46-49): 0, 1, ... on real
    tokens, 1 on padding."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def pad_context_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, length: int, pad_token_id: int):
    """Right-pad a context-encoding batch to the compiled context length as optimum-neuron's wrapper does
    (`decoder_wrappers.py` L115-124): ids with the pad token, positions with 1."""
    extra = length - input_ids.shape[-1]
    return (
        torch.nn.functional.pad(input_ids, (0, extra), value=pad_token_id),
        torch.nn.functional.pad(position_ids, (0, extra), value=1),
    )


def step(decoder, layout: StateLayout, held: Sequence[torch.Tensor], input_ids, position_ids, seq_ids) -> list[torch.Tensor]:
    """The traced forward: `[logits [B, 1, vocab] fp32, *held state updated]`.

    More than one token: context encoding of right-padded rows (the attention mask comes from the positions);
    one token: token generation (a row at position 0 starts its sequence from zero DeltaNet states: optimum-neuron
    serves a 1-token prompt this way). Which branch is traced is fixed by the example input's shape (one graph
    each), as in optimum-neuron's `_is_context_encoding`. The held state is returned updated (functionally under
    `NxDLayers`, so that every state output is a new value aliased to its input).
    """
    input_ids, position_ids = input_ids.to(torch.int32), position_ids.to(torch.int32)  # int32 as NxD's models
    if input_ids.shape[-1] > 1:
        mask = context_attention_mask(position_ids)
        out = decoder.context_encoding(input_ids, mask, position_ids, seq_ids, *layout.to_decoder(held))
    else:
        out = decoder.token_generation(input_ids, position_ids, seq_ids, *layout.to_decoder(held))
    logits, state = out[0], list(out[1:])
    return [logits.float()[:, None, :], *layout.to_held(state)]


def image_step(decoder, layout: StateLayout, held: Sequence[torch.Tensor], input_ids, position_ids, seq_ids,
               rope_position_ids, image_embeds=None, image_mask=None) -> list[torch.Tensor]:
    """The image graphs' traced forward (`step` for prompts holding images; a vision export).

    Context encoding (more than one token): `rope_position_ids` [B, 3, T] are the 3-D rotary positions of
    transformers' `get_rope_index` (`modeling.vision.rope_index`), `image_embeds` [B, T, hidden] the vision tower's
    merged tokens placed at the image tokens, which `image_mask` [B, T] marks. Token generation (one token):
    `rope_position_ids` [B, 1] is the cache position plus the prompt's rope delta (the three components are equal
    for text). `position_ids` places the tokens in the cache and marks the padding, as in `step`."""
    input_ids, position_ids = input_ids.to(torch.int32), position_ids.to(torch.int32)  # int32 as NxD's models
    rope_position_ids = rope_position_ids.to(torch.int32)
    if input_ids.shape[-1] > 1:
        mask = context_attention_mask(position_ids)
        image = (rope_position_ids, image_embeds, image_mask)
        out = decoder.context_encoding(input_ids, mask, position_ids, seq_ids, *layout.to_decoder(held), image=image)
    else:
        out = decoder.token_generation(
            input_ids, position_ids, seq_ids, *layout.to_decoder(held), rope_position_ids=rope_position_ids
        )
    logits, state = out[0], list(out[1:])
    return [logits.float()[:, None, :], *layout.to_held(state)]


def score(decoder, input_ids, position_ids) -> list[torch.Tensor]:
    """The per-position logits graph's forward (`forward()` of a Neuron export): `[logits [B, T, vocab] fp32]` of
    right-padded rows that start at position 0.

    Pure: each row runs in its own slot of a zero state made inside the graph (a fresh sequence reads nothing
    cached), and the updated state is dropped, so the held state of running sequences is neither read nor written
    (the graph has no aliases)."""
    input_ids, position_ids = input_ids.to(torch.int32), position_ids.to(torch.int32)  # int32 as NxD's models
    batch, length = input_ids.shape
    zeros = [torch.zeros(s.shape, dtype=s.dtype, device=input_ids.device) for s in decoder.state_specs(batch, length)]
    seq_ids = torch.arange(batch, device=input_ids.device, dtype=torch.int32)
    out = decoder.context_encoding(
        input_ids, context_attention_mask(position_ids), position_ids, seq_ids, *zeros, all_logits=True
    )
    return [out[0].float()]


# ------------------------------------------------------------------------------------------ speculative decoding
# An export made with mtp=True (backends/nxd/model.py) holds two more kinds of state after the decoder's:
# `verified_state_specs`, verify's DeltaNet states after each position (scratch that verify writes and commit reads:
# it stays on the device between the two calls), then the MTP head's K/V cache. Every graph holding state takes and
# returns all of it, in that order (decoder state, verified states, head cache), after its own outputs; what a graph
# does not write it returns as it came.


def verified_state_specs(specs: Sequence[StateSpec], batch: int, width: int) -> list[StateSpec]:
    """verify's per-position DeltaNet states of `batch` rows over `width` positions, in the order
    `Qwen35Decoder.verify` returns them (per DeltaNet layer: conv [B, T, C, K - 1], recurrent [B, T * nv, dk, dv])."""
    out = []
    for spec in specs:
        layer, kind = spec.name.rsplit(".", 1)
        if kind == "conv_state":
            out.append(StateSpec(f"{layer}.verified_conv_state", (batch, width, *spec.shape[1:]), spec.dtype))
        elif kind == "recurrent_state":
            nv, dk, dv = spec.shape[1:]
            out.append(StateSpec(f"{layer}.verified_recurrent_state", (batch, width * nv, dk, dv), spec.dtype))
    return out


def context_hidden_step(decoder, layout: StateLayout, held, input_ids, position_ids, seq_ids) -> list[torch.Tensor]:
    """Context encoding of right-padded rows (as `step`) that also returns every position's final-normed hidden
    state (what the MTP head reads after a prompt): `[logits [B, 1, vocab] fp32, hidden [B, T, H], *held state]`."""
    input_ids, position_ids = input_ids.to(torch.int32), position_ids.to(torch.int32)
    mask = context_attention_mask(position_ids)
    out = decoder.context_encoding(input_ids, mask, position_ids, seq_ids, *layout.to_decoder(held), hidden=True)
    return [out[0].float()[:, None, :], out[1], *layout.to_held(out[2:])]


def verify_step(decoder, layout: StateLayout, held, verified, input_ids, position_ids, lengths, seq_ids):
    """Speculative verification (`Qwen35Decoder.verify`) over the whole cache: `[logits [B, T, vocab] fp32,
    hidden [B, T, H], *held state, *verified]`, the per-position DeltaNet states written into `verified`.

    Written as a scatter of every row into the held scratch tensors rather than returned as new tensors: a graph
    output that does not read its held input leaves that input out of the graph, and its alias could not be made."""
    input_ids, position_ids = input_ids.to(torch.int32), position_ids.to(torch.int32)
    out = decoder.verify(input_ids, position_ids, lengths, seq_ids, *layout.to_decoder(held))
    n = len(verified)
    per_position, state = out[2 : 2 + n], out[2 + n :]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device, dtype=torch.int32)
    written = [v.index_put((rows,), p.to(v.dtype)) for v, p in zip(verified, per_position)]
    return [out[0].float(), out[1], *layout.to_held(state), *written]


def commit_step(decoder, layout: StateLayout, held, verified, seq_ids, accepted) -> list[torch.Tensor]:
    """Each active row's DeltaNet states become those verify held after its position accepted[b]
    (`Qwen35Decoder.commit`): `[accepted, *held state, *verified]` (the first output only so that the graph has one
    that is not aliased)."""
    state = decoder.commit(seq_ids, accepted, *verified, *layout.to_decoder(held))
    return [accepted, *layout.to_held(state), *verified]


def mtp_step(decoder, cache, input_ids, hidden, position_ids, lengths, seq_ids, key_length=None) -> list[torch.Tensor]:
    """The MTP head over T positions per row (`Qwen35Decoder.mtp_forward`): `[logits [B, vocab] fp32, out [B, H],
    k_cache, v_cache]`."""
    logits, out, k_cache, v_cache = decoder.mtp_forward(
        input_ids.to(torch.int32), hidden, position_ids.to(torch.int32), lengths, seq_ids, *cache, key_length=key_length
    )
    return [logits.float(), out, k_cache, v_cache]


def restore_state_dtypes(held: Sequence[torch.nn.Parameter], specs: Sequence[StateSpec]) -> None:
    """Give each held state back its dtype (the recurrent state fp32), in place on the same Parameter objects
    (the alias map refers to them), after optimum-neuron's load-time cast of every floating tensor."""
    held, specs = list(held), list(specs)
    if len(held) != len(specs):
        raise ValueError(f"{len(held)} held state tensors for {len(specs)} state specs")
    for tensor, spec in zip(held, specs):
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"{spec.name}: held shape {tuple(tensor.shape)}, expected {tuple(spec.shape)}")
        if tensor.dtype != spec.dtype:
            tensor.data = tensor.data.to(spec.dtype)


def restore_fp32_parameters(module: torch.nn.Module) -> None:
    """The DeltaNet gate parameters (`precision.FP32_PARAMETERS`) back to fp32 after the same load-time cast, in place
    on the same Parameter objects, so that the traced graph takes them as the per-rank weights hold them (fp32)."""
    for name, param in module.named_parameters():
        if name.endswith(FP32_PARAMETERS) and param.dtype != torch.float32:
            param.data = param.data.float()


# F8E4M3FN operands read as F8E4M3 (checkpoint/fp8.py; exact for the weights backends/nxd/fp8.py fits to its range).
FP8_COMPILER_FLAG = E4M3FN_AS_E4M3_FLAG


def compiler_args(target: str | None, logical_nc_config: int, fp8_weights: bool = False) -> str:
    """neuronx-cc flags for both graphs.

    `--auto-cast=none` is the one this model cannot do without: the recurrent state, the gates, the norms and the
    logits are fp32 in the graph, and any auto-cast would round them to bf16. The rest are the flags optimum-neuron
    0.4.5 compiles its decoders with (`NxDModelForCausalLM.get_compiler_args`): transformer model type, -O2, the
    logical core count (2 on trn2) and the target. `fp8_weights` (an export with FP8 weights): F8E4M3FN operands read
    as F8E4M3, which trn1, inf2 and trn2 compute (backends/nxd/fp8.py: exact for weights fitted to its range).
    """
    tensorizer = "--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 --vectorize-strided-dma"
    flags = ["--auto-cast=none", "--model-type=transformer", f"--tensorizer-options='{tensorizer}'", "-O2", f"--lnc={logical_nc_config}"]
    if fp8_weights:
        flags.append(FP8_COMPILER_FLAG)
    if target:
        flags += ["--target", target]
    return " ".join(flags)


# The targets NKI 0.3+ (the API the kernels are written in) compiles for: trn2 and later. trn1 and inf2 (NeuronCore-v2)
# are not among them.
NKI_TARGETS = ("trn2", "trn3")


def kernel_backend(requested: str | None = None, target: str | None = None, real_nki: bool | None = None) -> str:
    """The kernel backend (`optimum_qwen35.kernels`) the traced module's DeltaNet layers call on `target`.

    "torch_for_neuron" (the PyTorch references in the form neuronx-cc takes, traced op by op into the graph:
    `kernels.backends.FOR_NEURON`) unless "nki" is requested, which gives the NKI
    kernels (one custom call per launch; their state outputs go into the slots by the same functional scatter as the
    references', so the graph aliases them alike) on trn2 and later, and is refused:
    - on trn1 / inf2: NKI 0.3+, the API of the kernels, compiles for trn2 and later only, so they always run the
      torch form;
    - without the real NKI package (NKI >= 0.3, Neuron SDK 2.29+): the CPU emulator runs NumPy on host memory,
      which a traced graph cannot call.

    `real_nki`: whether the real `nki` package is importable; None asks `kernels.nki_import` (its probe's answer).
    """
    if requested not in (None, "nki", "torch"):
        raise ValueError(f"kernel backend {requested!r}: the Neuron graphs take 'nki' or 'torch'")
    if requested != "nki":
        return FOR_NEURON
    if target not in NKI_TARGETS:
        raise ValueError(
            f"kernel backend 'nki' on target {target!r}: the NKI kernels run on trn2 and later only "
            f"({', '.join(NKI_TARGETS)}); use 'torch'"
        )
    if real_nki is None:
        from optimum_qwen35.kernels.nki_import import USING_EMULATOR  # the NKI probe runs only when the NKI kernels are asked for

        real_nki = not USING_EMULATOR
    if not real_nki:
        raise ValueError(
            "kernel backend 'nki' in a Neuron graph needs the real NKI package (NKI >= 0.3, Neuron SDK 2.29+); "
            "`optimum_qwen35.kernels.nki_import` found only the CPU emulator"
        )
    return "nki"


# The logical NeuronCore degree each target's graphs compile with by default (neuronx-cc's --lnc): 2 on trn2 and trn3
# (a logical core of two physical ones), 1 on trn1 / inf2.
DEFAULT_LNC = {"trn2": 2, "trn3": 2}


def kernel_lnc(target: str | None, logical_nc_config: int | None = None) -> int:
    """The LNC degree the DeltaNet kernels are launched with in the graphs of `target`: the one the graphs compile
    with (the neuron config's `logical_nc_config`, `compiler_args`'s --lnc) where set, else the target's default."""
    if logical_nc_config:
        return int(logical_nc_config)
    return DEFAULT_LNC.get(target, 1)


def check_neuron_config(neuron_config) -> None:
    """What this backend supports of an NxDNeuronConfig: no speculation (a DeltaNet state cannot be rolled back
    after rejected draft tokens), logits out (tokens are chosen on the host from fp32 logits), no extra outputs."""
    problems = []
    if getattr(neuron_config, "speculation_length", 0):
        problems.append(f"speculation_length={neuron_config.speculation_length} (must be 0)")
    if getattr(neuron_config, "on_device_sampling", False):
        problems.append("on_device_sampling=True (must be False)")
    if getattr(neuron_config, "output_logits", False):
        problems.append("output_logits=True (must be False)")
    if problems:
        raise ValueError("Qwen3.5's Neuron graphs do not support " + ", ".join(problems))


def set_local_world_size(neuron_config) -> None:
    """neuronx-distributed 0.15's parallel state reads `os.environ["LOCAL_WORLD_SIZE"]` on trn1-family hardware (trn1,
    inf2) at TP 4 (`initialize_model_parallel`, parallel_state.py L600; `get_tensor_model_parallel_src_rank`, L927),
    which only `torchrun` sets: a plain export or load would stop on a KeyError before any graph is built. The ranks
    of an export are one node's (`ModelBuilder.trace` mocks a world of `world_size` ranks in this process): set it
    to that world size where it is unset (as optimum-neuron's exporter does for its `parallel_model_trace` path),
    and again at each export or load of the same process (a TP 1 export, then a TP 4 one); a value set by anyone
    else (a `torchrun` launch) is kept."""
    set_local_world_size_to(getattr(neuron_config, "world_size", None) or neuron_config.tp_degree)


def set_local_world_size_to(world_size: int) -> None:
    """`set_local_world_size` for a world of `world_size` ranks (the parallel state of `tracing.traced_parallel_state`,
    which sets it before it builds the state)."""
    global _LOCAL_WORLD_SIZE_SET
    world_size = str(world_size)
    if os.environ.get("LOCAL_WORLD_SIZE") in (None, _LOCAL_WORLD_SIZE_SET):
        os.environ["LOCAL_WORLD_SIZE"] = _LOCAL_WORLD_SIZE_SET = world_size


_LOCAL_WORLD_SIZE_SET: str | None = None  # the value set_local_world_size last set, if any


def int32_indices(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Integer tensors (the vision graph's position and segment inputs) in int32, as NxD's models take their
    indices (no s64 in the HLO); other tensors as they are."""
    return [t.to(torch.int32) if not t.is_floating_point() and t.dtype != torch.bool else t for t in tensors]
