"""The traced modules of the NxD export (needs the Neuron SDK): what each graph runs.

- `Qwen35NxDDecoderModel`: the one model definition (`modeling.decoder.Qwen35Decoder`) built over `NxDLayers`,
  holding the decoder state as parameters in optimum-neuron's order (K/V of the attention layers, then the DeltaNet
  states), its forward `adapter.step` with optimum-neuron's signature
  `(input_ids, position_ids, seq_ids, sampling_params) -> [logits, *state]`; the image graphs, the per-position
  logits graph and (an export made with mtp=True) the speculative-decoding graphs run the same module;
- `Qwen35NxDVisionModel`: the vision tower of one image bucket.

The graphs' tags are here too; builders.py builds a graph of each, model.py's `Qwen35NxDModelForCausalLM` runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from optimum_qwen35.backends.nxd import adapter, fp8
from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.backends.nxd.layers import NxDLayers, gather_float8_rows
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.vision import VisionEncoder

# The third graph's tag: logits of every position, for forward() (Qwen35LogitsBuilder).
LOGITS_MODEL_TAG = "context_logits_model"
# The image graphs of a vision export (`vision_graph_builders`), beside one `vision_<N>` graph per image bucket.
IMAGE_CONTEXT_MODEL_TAG, IMAGE_TOKEN_MODEL_TAG = "image_context_encoding", "image_token_generation"
# The speculative-decoding graphs of an export made with mtp=True (`speculative_graph_builders`), and how many
# outputs each has before the held state.
CONTEXT_HIDDEN_MODEL_TAG, VERIFY_MODEL_TAG, COMMIT_MODEL_TAG = "context_hidden", "verify", "commit"
MTP_DRAFT_MODEL_TAG, MTP_CATCH_UP_MODEL_TAG, MTP_PROMPT_MODEL_TAG = "mtp_draft", "mtp_catch_up", "mtp_prompt"
SPECULATIVE_OUTPUTS = {CONTEXT_HIDDEN_MODEL_TAG: 2, VERIFY_MODEL_TAG: 2, COMMIT_MODEL_TAG: 1, MTP_DRAFT_MODEL_TAG: 2,
                       MTP_CATCH_UP_MODEL_TAG: 2, MTP_PROMPT_MODEL_TAG: 2}


class Qwen35NxDDecoderModel(Qwen35Decoder):
    """The traced module: the decoder over neuronx-distributed's layers, with its state held as parameters."""

    # The DeltaNet layers' kernels (`adapter.kernel_backend`, by target): None or "torch" traces the PyTorch references;
    # "nki" calls the NKI kernels on trn2 and later with the real NKI package (refused elsewhere). Carried by this
    # model's layer factory, so that it does not change the process-wide backend of other models.
    kernel_backend: str | None = None
    # The speculative-decoding graph this module is traced as (Qwen35SpeculativeModelInstance sets it), None for the
    # decoding graphs, which their inputs tell apart.
    graph: str | None = None

    def __init__(self, config, neuron_config):
        adapter.check_neuron_config(neuron_config)
        qwen_config = weights.qwen_config(config)
        backend = adapter.kernel_backend(self.kernel_backend, neuron_config.target)
        layers = NxDLayers(neuron_config.tp_degree, neuron_config.torch_dtype, backend,
                           adapter.kernel_lnc(neuron_config.target, getattr(neuron_config, "logical_nc_config", None)))
        max_speculative_tokens = weights.mtp_export(config)
        super().__init__(qwen_config, neuron_config.tp_degree, layers, mtp=max_speculative_tokens > 0)
        if qwen_config.tie_word_embeddings:
            # Its own lm_head weight, filled from the embedding at load (`state_dict.tie_lm_head`), as
            # optimum-neuron's tied models do: a weight shared by two layers is not something its tracing handles.
            self.lm_head.weight = nn.Parameter(torch.empty_like(self.embed_tokens.weight))
        fp8_weights = fp8.fp8_export(config)
        if fp8_weights:  # an export with FP8 weights (backends/nxd/fp8.py)
            for name in fp8_weights:
                if fp8.is_nxd_expert(name):
                    gather_float8_rows(self.get_submodule(name))
            fp8.hold_weights(self, fp8_weights, qwen_config, neuron_config.tp_degree, neuron_config.torch_dtype)
        self.neuron_config = neuron_config
        self.kv_mgr = None  # read by optimum-neuron's model instance; this module holds all its state itself
        slots, length = neuron_config.max_batch_size, neuron_config.sequence_length
        specs = self.state_specs(slots, length)
        self.state_layout = adapter.StateLayout(specs)
        # With the head (mtp=True), every graph also holds verify's per-position DeltaNet states and the head's K/V
        # cache, after the decoder's state (adapter.py, "speculative decoding"): the runtime allocates the state the
        # first graph holds (neuronx-distributed's `build_state_initializer`), so that graph must hold all of it.
        self.verified_specs = []
        if self.mtp is not None:
            self.verified_specs = adapter.verified_state_specs(specs, slots, max_speculative_tokens + 1)
        self.held_specs = self.state_layout.held_specs + self.verified_specs + self.mtp_state_specs(slots, length)
        self.past_key_values = nn.ParameterList(
            nn.Parameter(torch.zeros(s.shape, dtype=s.dtype), requires_grad=False) for s in self.held_specs
        )

    def forward(self, input_ids, position_ids, *rest):
        held = list(self.past_key_values)
        n, v = len(self.state_layout.specs), len(self.verified_specs)
        state, verified, cache = held[:n], held[n : n + v], held[n + v :]
        if self.graph is not None:
            return self._speculative(state, verified, cache, input_ids, position_ids, *rest)
        if not rest:  # the per-position logits graph (two inputs: Qwen35LogitsBuilder): no held state
            return adapter.score(self, input_ids, position_ids)
        seq_ids, _sampling_params, *image = rest
        if image:  # the image graphs (Qwen35ImageContextBuilder, Qwen35ImageTokenBuilder): rotary positions first
            out = adapter.image_step(self, self.state_layout, state, input_ids, position_ids, seq_ids, *image)
        else:
            out = adapter.step(self, self.state_layout, state, input_ids, position_ids, seq_ids)
        return out + verified + cache  # (with the head: returned as they came)

    def _speculative(self, state, verified, cache, *inputs):
        """The speculative-decoding graph `self.graph` (inputs: `Qwen35SpeculativeBuilder.input_generator`)."""
        layout = self.state_layout
        if self.graph == CONTEXT_HIDDEN_MODEL_TAG:
            return adapter.context_hidden_step(self, layout, state, *inputs) + verified + cache
        if self.graph == VERIFY_MODEL_TAG:
            return adapter.verify_step(self, layout, state, verified, *inputs) + cache
        if self.graph == COMMIT_MODEL_TAG:
            return adapter.commit_step(self, layout, state, verified, *inputs) + cache
        # The head: over a prompt it attends to the prompt's block (a fresh row), else to the whole cache.
        key_length = inputs[0].shape[1] if self.graph == MTP_PROMPT_MODEL_TAG else None
        logits, out, *cache = adapter.mtp_step(self, cache, *inputs, key_length=key_length)
        return [logits, out, *state, *verified, *cache]


class Qwen35NxDVisionModel(nn.Module):
    """The traced vision module of one image bucket: the one vision tower definition (`modeling.vision`) over
    neuronx-distributed's layers, under `visual.` so that its weights and the decoder's share one checkpoint's
    names. Inputs: `modeling.vision.image_bucket_inputs` (integers in int32: `adapter.int32_indices`); output: the
    merged tokens [bucket / 4, hidden]."""

    def __init__(self, vision_config, neuron_config):
        super().__init__()
        layers = NxDLayers(neuron_config.tp_degree, neuron_config.torch_dtype)
        self.visual = VisionEncoder(vision_config, neuron_config.tp_degree, layers)

    def forward(self, patches, pos_index, pos_weight, rotary_pos, segment):
        return [self.visual(patches, pos_index, pos_weight, rotary_pos, segment)]
