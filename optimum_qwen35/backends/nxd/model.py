"""Qwen3.5 on optimum-neuron 0.4.5's NxD backend (needs the Neuron SDK; imported lazily by the Neuron targets).

- `Qwen35NxDDecoderModel`, the traced module: the one model definition (`modeling.decoder.Qwen35Decoder`) built
  over `NxDLayers`, holding the decoder state as parameters in optimum-neuron's order (K/V of the attention layers,
  then the DeltaNet states), its forward `adapter.step` with optimum-neuron's signature
  `(input_ids, position_ids, seq_ids, sampling_params) -> [logits, *state]`;
- `Qwen35DecoderModelInstance`: builds it, re-casts the state to its dtypes after optimum-neuron's load-time cast
  (the recurrent state back to fp32), and aliases every held state to its output;
- `Qwen35NxDModelForCausalLM`, the `NxDModelForCausalLM` subclass: the graphs (context encoding, token
  generation, and the per-position logits graph of `forward()`; optimum-neuron's own speculation is off), compiler
  flags, and weights split per rank by this project's layout (`state_dict`) instead of neuronx-distributed's
  splitter, which does not split plain parameters (A_log, dt_bias, conv_weight);
- an export made with mtp=True (`state_dict.mtp_export`: its config says so) also holds the checkpoint's
  multi-token-prediction head and the graphs of speculative decoding with it (`speculative_graph_builders`:
  context encoding returning the hidden states, verify of K + 1 positions, commit, the head over 1, K + 1 and a
  prompt's positions), which `generate(..., num_speculative_tokens=k)` runs through the host loop (runner.py).

`optimum_qwen35.optimum_neuron.Qwen35NeuronModelForCausalLM` hands its Neuron targets to `Qwen35NxDModelForCausalLM`.
None of this has run: see docs/neuron_backend.md.
"""

from __future__ import annotations

import os

import torch
from neuronx_distributed.trace.model_builder import BaseModelInstance
from optimum.neuron.models.inference.backend.graph_builder import NxDGraphBuilder
from optimum.neuron.models.inference.backend.modules.decoder.decoder_builders import (
    DecoderModelInstanceForCausalLM,
    NxDDecoderBuilderForCausalLM,
)
from optimum.neuron.models.inference.backend.modules.decoder.decoder_wrappers import (
    CONTEXT_ENCODING_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    NxDDecoderWrapperForCausalLM,
)
from optimum.neuron.models.inference.backend.modules.decoder.modeling_decoder import NxDModelForCausalLM
from optimum.neuron.models.inference.backend.pretrained_model import get_shards_path
from safetensors.torch import save_file
from torch import nn

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

from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.backends.nxd.layers import NxDLayers
from optimum_qwen35.backends.nxd.runner import nxd_runtime
from optimum_qwen35.errors import UsageError
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.precision import accumulation_dtype
from optimum_qwen35.modeling.vision import VisionEncoder, image_bucket_inputs
from optimum_qwen35.optimum_neuron import generation
from optimum_qwen35.optimum_neuron.neuron_config import nxd_neuron_config
from optimum_qwen35.optimum_neuron.scoring import causal_lm_forward
from optimum_qwen35.processing import copy_processor_files


def shard_file(checkpoint_dir: str, rank: int) -> str:
    """Where optimum-neuron 0.4.5 looks for rank `rank`'s pre-split weights (`pretrained_model.py` L194)."""
    return os.path.join(get_shards_path(checkpoint_dir), f"tp{rank}_sharded_checkpoint.safetensors")


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


class Qwen35DecoderModelInstance(DecoderModelInstanceForCausalLM):
    def load_module(self):
        super().load_module()  # builds the module, then casts every floating tensor to the model dtype
        adapter.restore_state_dtypes(self.module.past_key_values, self.module.held_specs)
        adapter.restore_fp32_parameters(self.module)

    def get(self, bucket_rank, **kwargs):
        if bucket_rank != 0:
            raise ValueError(f"one bucket per graph, got bucket_rank={bucket_rank}")
        # Held state j is the output after the graph's own ones (the logits; two or one for a speculative graph).
        first = SPECULATIVE_OUTPUTS.get(self.module.graph, adapter.STATE_OUTPUT_OFFSET)
        self.input_output_aliases = {held: first + j for j, held in enumerate(self.module.past_key_values)}
        return self.module, self.input_output_aliases


class Qwen35LogitsModelInstance(Qwen35DecoderModelInstance):
    def get(self, bucket_rank, **kwargs):
        if bucket_rank != 0:
            raise ValueError(f"one bucket per graph, got bucket_rank={bucket_rank}")
        self.input_output_aliases = {}  # reads and writes no held state (adapter.score)
        return self.module, self.input_output_aliases


class Qwen35DecoderBuilder(NxDDecoderBuilderForCausalLM):
    def get_model_instance(self):
        return Qwen35DecoderModelInstance(
            model_cls=self.model_cls, config=self.config, neuron_config=self.neuron_config, n_positions=self.max_tokens
        )


class Qwen35LogitsBuilder(Qwen35DecoderBuilder):
    """The per-position logits graph: (input_ids, position_ids) [1, max_context_length] -> logits of every position.

    Two inputs, not the context-encoding graph's four: neuronx-distributed routes a call to a graph by the shapes of
    its inputs, so the two graphs must differ there."""

    def input_generator(self):
        (input_ids, position_ids, _seq_ids, _sampling_params), = super().input_generator()
        return [(input_ids, position_ids)]

    def get_model_instance(self):
        return Qwen35LogitsModelInstance(
            model_cls=self.model_cls, config=self.config, neuron_config=self.neuron_config, n_positions=self.max_tokens
        )


class Qwen35ImageContextBuilder(Qwen35DecoderBuilder):
    """Context encoding of prompts holding images: the context-encoding graph's four inputs, then the 3-D rotary
    positions [B, 3, T], the image embeddings [B, T, hidden] (model dtype) and their mask [B, T] (seven inputs: its
    own shape key for neuronx-distributed's routing). Holds and aliases the same state as the text graphs."""

    def input_generator(self):
        (input_ids, position_ids, seq_ids, sampling_params), = super().input_generator()
        batch, length = input_ids.shape
        rope_position_ids = position_ids[:, None, :].expand(batch, 3, length).contiguous()
        image_embeds = torch.zeros(batch, length, self.config.hidden_size, dtype=self.neuron_config.torch_dtype)
        image_mask = torch.zeros(batch, length, dtype=torch.int32)
        return [(input_ids, position_ids, seq_ids, sampling_params, rope_position_ids, image_embeds, image_mask)]


class Qwen35ImageTokenBuilder(Qwen35DecoderBuilder):
    """Token generation after a prompt holding images: the token-generation graph's four inputs, then the rotary
    position [B, 1] (cache position + rope delta): five inputs."""

    def input_generator(self):
        (input_ids, position_ids, seq_ids, sampling_params), = super().input_generator()
        return [(input_ids, position_ids, seq_ids, sampling_params, position_ids.clone())]


class Qwen35SpeculativeModelInstance(Qwen35DecoderModelInstance):
    """The traced module of one speculative-decoding graph: the decoder with the head, told which graph it is."""

    def __init__(self, model_cls, config, neuron_config, n_positions: int, graph: str):
        super().__init__(model_cls=model_cls, config=config, neuron_config=neuron_config, n_positions=n_positions)
        self.graph = graph

    def load_module(self):
        super().load_module()
        self.module.graph = self.graph


class Qwen35SpeculativeBuilder(NxDGraphBuilder):
    """One graph of speculative decoding with the MTP head (`graph`: one of the tags above), over `width` positions
    per row. Its inputs (int32 indices, the hidden states in the accumulation dtype), each graph a shape key of its
    own for neuronx-distributed's routing (`speculative_graph_builders` checks it):

    - context_hidden: (input_ids, position_ids [B, T], seq_ids [B]), right-padded as context encoding's (three
      inputs, not its four) -> (logits [B, 1, vocab], hidden [B, T, H]);
    - verify: (input_ids, position_ids [B, K + 1], lengths [B], seq_ids [B]) -> (logits [B, K + 1, vocab], hidden);
    - commit: (seq_ids [B], accepted [B]) -> (accepted);
    - mtp_draft / mtp_catch_up / mtp_prompt: (input_ids [B, T], hidden [B, T, H], position_ids [B, T], lengths [B],
      seq_ids [B]) over 1, K + 1 or the context length positions -> (logits [B, vocab], out [B, H]).
    """

    def __init__(self, config, neuron_config, graph: str, width: int, model_cls):
        super().__init__(priority_model_idx=None)
        self.config, self.neuron_config, self.model_cls = config, neuron_config, model_cls
        self.graph, self.width = graph, width

    def input_generator(self):
        batch, width = self.neuron_config.batch_size, self.width
        ids = torch.zeros(batch, width, dtype=torch.int32)
        positions = torch.arange(width, dtype=torch.int32).expand(batch, width).contiguous()
        lengths = torch.full((batch,), width, dtype=torch.int32)
        seq_ids = torch.arange(batch, dtype=torch.int32)
        if self.graph == CONTEXT_HIDDEN_MODEL_TAG:
            return [(ids, positions, seq_ids)]
        if self.graph == VERIFY_MODEL_TAG:
            return [(ids, positions, lengths, seq_ids)]
        if self.graph == COMMIT_MODEL_TAG:
            return [(seq_ids, torch.zeros(batch, dtype=torch.int32))]
        dtype = accumulation_dtype(self.neuron_config.torch_dtype)  # the hidden states come as the graphs return them
        hidden = torch.zeros(batch, width, self.config.hidden_size, dtype=dtype)
        return [(ids, hidden, positions, lengths, seq_ids)]

    def get_model_instance(self):
        return Qwen35SpeculativeModelInstance(self.model_cls, self.config, self.neuron_config, self.width, self.graph)


def speculative_graph_builders(config, neuron_config, max_speculative_tokens: int, model_cls) -> dict:
    """The graphs an export made with mtp=True adds: context encoding with the hidden states and the head over a
    prompt (one row, the context length, as context encoding), verify and commit of K + 1 positions and the head
    over 1 (a draft) and K + 1 (the catch-up) positions (the batch, as token generation)."""
    ctx = NxDModelForCausalLM._create_context_encoding_config(neuron_config)
    tkg = NxDModelForCausalLM._create_token_generation_config(neuron_config)
    if tkg.batch_size != neuron_config.max_batch_size:
        raise ValueError(f"mtp=True needs the token-generation batch ({tkg.batch_size}) to be the number of slots "
                         f"({neuron_config.max_batch_size}): verify's per-position states are held one row per slot")
    width = max_speculative_tokens + 1
    graphs = {
        CONTEXT_HIDDEN_MODEL_TAG: (ctx, ctx.max_context_length), MTP_PROMPT_MODEL_TAG: (ctx, ctx.max_context_length),
        VERIFY_MODEL_TAG: (tkg, width), COMMIT_MODEL_TAG: (tkg, width),
        MTP_DRAFT_MODEL_TAG: (tkg, 1), MTP_CATCH_UP_MODEL_TAG: (tkg, width),
    }
    return {tag: Qwen35SpeculativeBuilder(config, nc, tag, n, model_cls) for tag, (nc, n) in graphs.items()}


def check_shape_keys(builders: dict) -> None:
    """neuronx-distributed routes a call to the graph whose example inputs have the call's shapes
    (`NxDModel.router`): no two graphs may share them."""
    seen = {}
    for tag, builder in builders.items():
        key = str([tuple(t.shape) for t in builder.input_generator()[0]])
        if key in seen:
            raise ValueError(f"graphs {seen[key]!r} and {tag!r} take inputs of the same shapes {key}: a call could not "
                             "be routed to one of them; export with a longer sequence_length")
        seen[key] = tag


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


class Qwen35VisionModelInstance(BaseModelInstance):
    """Builds the vision module in the model dtype (as optimum-neuron builds its decoders: every floating tensor
    cast); no state, no aliases."""

    def __init__(self, vision_config, neuron_config):
        self.vision_config, self.neuron_config = vision_config, neuron_config
        self.module, self.input_output_aliases = None, None

    def load_module(self):
        module = Qwen35NxDVisionModel(self.vision_config, self.neuron_config).eval()
        dtype = self.neuron_config.torch_dtype
        self.module = module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)

    def get(self, bucket_rank, **kwargs):
        if bucket_rank != 0:
            raise ValueError(f"one bucket per graph, got bucket_rank={bucket_rank}")
        self.input_output_aliases = {}
        return self.module, self.input_output_aliases


class Qwen35VisionBuilder(NxDGraphBuilder):
    """The vision graph of one image bucket (`bucket` patch rows): an image runs alone in the smallest bucket that
    holds it (`runtime.images.ImageInputs`)."""

    def __init__(self, vision_config, neuron_config, bucket: int):
        super().__init__(priority_model_idx=None)
        self.vision_config, self.neuron_config, self.bucket = vision_config, neuron_config, bucket

    def input_generator(self):
        v = self.vision_config
        patches = torch.zeros(self.bucket, v.patch_dim, dtype=self.neuron_config.torch_dtype)
        grid = (1, v.spatial_merge_size, self.bucket // v.spatial_merge_size)  # any grid of the bucket's size
        return [tuple(adapter.int32_indices(image_bucket_inputs(v, patches, grid, self.bucket)))]

    def get_model_instance(self):
        return Qwen35VisionModelInstance(self.vision_config, self.neuron_config)


def vision_graph_builders(config, vision_config, image_buckets, neuron_config, model_cls) -> dict:
    """The graphs a vision export adds: `vision_<N>` per image bucket, image context encoding, image token
    generation (`NxDImageRuntime` runs them)."""
    ctx = NxDModelForCausalLM._create_context_encoding_config(neuron_config)
    tkg = NxDModelForCausalLM._create_token_generation_config(neuron_config)
    builders = {f"vision_{bucket}": Qwen35VisionBuilder(vision_config, neuron_config, bucket) for bucket in image_buckets}
    builders[IMAGE_CONTEXT_MODEL_TAG] = Qwen35ImageContextBuilder(
        config, ctx, max_tokens=ctx.max_context_length, active_tokens=ctx.max_context_length, model_cls=model_cls
    )
    builders[IMAGE_TOKEN_MODEL_TAG] = Qwen35ImageTokenBuilder(
        config, tkg, max_tokens=tkg.sequence_length, active_tokens=1, model_cls=model_cls
    )
    return builders


class Qwen35DecoderWrapper(NxDDecoderWrapperForCausalLM):
    """optimum-neuron's decoder wrapper, with the rows it adds to fill the compiled batch naming no slot.

    optimum-neuron pads a partial batch with copies of row 0 whose seq_ids are the slots no row names
    (`decoder_wrappers.py` L66-79), which its KV cache can afford: such a row rewrites one cache position, which the
    slot's sequence rewrites again before reading it. A DeltaNet state is the whole history of its sequence: a padding
    row would replace it. Here padding rows get seq_id -1, which the graphs read as inactive (they write nothing);
    and the rows are not sorted by slot, since the graphs read and write each row's own slot.
    """

    def _forward_with_pad(self, input_ids, position_ids, seq_ids, sampling_params):
        rows, batch = seq_ids.shape[0], self.neuron_config.batch_size

        def pad(tensor):  # copies of row 0: valid token ids and positions, never read back
            return torch.cat([tensor, tensor[:1].expand(batch - rows, *tensor.shape[1:])])

        seq_ids = torch.cat([seq_ids, seq_ids.new_full((batch - rows,), -1)])
        return self._forward(pad(input_ids), pad(position_ids), seq_ids, pad(sampling_params))[:rows]

    def _forward(self, input_ids, position_ids, seq_ids, sampling_params):
        return self.model(input_ids, position_ids, seq_ids, sampling_params)


class Qwen35NxDModelForCausalLM(NxDModelForCausalLM):
    """Qwen3.5 on Neuron: what `Qwen35NeuronModelForCausalLM` returns for the trn1/inf2/trn2 targets."""

    _model_cls = Qwen35NxDDecoderModel
    _STATE_DICT_MODEL_PREFIX = weights.STATE_DICT_MODEL_PREFIX
    # optimum-neuron main's chunked prefill would cut a prompt into context-encoding calls at positions > 0.
    _supports_chunked_prefill = False

    def __init__(self, config, neuron_config, traced_model, graph_builders):
        super().__init__(config, neuron_config, traced_model, graph_builders)
        # Padding rows that name no slot (Qwen35DecoderWrapper), in both graphs' wrappers.
        for name, tag in (("context_encoding_model", CONTEXT_ENCODING_MODEL_TAG), ("token_generation_model", TOKEN_GENERATION_MODEL_TAG)):
            wrapper = getattr(self, name)
            setattr(self, name, Qwen35DecoderWrapper(config, wrapper.neuron_config, traced_model, tag))

    def forward(self, input_ids=None, position_ids=None, seq_ids=None, sampling_params=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, attention_mask=None, labels=None, **kwargs):
        """Two callers. optimum-neuron's generation loop passes `seq_ids` and `sampling_params`: its own forward runs
        (context encoding or token generation of the slots named). transformers' `model(input_ids, attention_mask,
        labels)` passes neither: a `CausalLMOutput` with the logits of every position (`optimum.scoring`), each row
        through the per-position logits graph, which reads and writes no slot."""
        if seq_ids is not None or sampling_params is not None:
            return super().forward(
                input_ids, position_ids, seq_ids, sampling_params, output_attentions, output_hidden_states, return_dict
            )
        return causal_lm_forward(
            self._rows_logits, self.config.vocab_size, input_ids, attention_mask, labels, return_dict,
            position_ids=position_ids, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            **kwargs,
        )

    def generate(self, input_ids, attention_mask=None, generation_config=None, stopping_criteria=None,
                 pixel_values=None, image_grid_thw=None, num_speculative_tokens=0, **kwargs):
        """optimum-neuron's `generate`; with `pixel_values` / `image_grid_thw` (a vision export) or
        `num_speculative_tokens=k` > 0 (an export made with mtp=True: speculative decoding with the MTP head), the host
        loop over the traced graphs (`NxDGraphs`: the cpu runtime's loop, image handling and speculative rounds, the
        same `generate` options as the cpu target's)."""
        kwargs.pop("token_type_ids", None)  # tokenizers' output, passed on by harnesses: Qwen3.5 has no token types
        if pixel_values is None and image_grid_thw is None and not num_speculative_tokens:
            kwargs.pop("mm_token_type_ids", None)
            if stopping_criteria is not None:  # optimum-neuron's loop (NxDGenerationMixin) takes it as a keyword
                kwargs["stopping_criteria"] = stopping_criteria
            return super().generate(input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs)
        images = pixel_values is not None or image_grid_thw is not None
        runtime = self._runtime_for_images() if images else self._host_runtime()
        return generation.generate(
            runtime, self.generation_config, input_ids, attention_mask, generation_config,
            stopping_criteria=stopping_criteria, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            num_speculative_tokens=num_speculative_tokens, **kwargs,
        )

    def _host_runtime(self):
        """The host loop over the traced graphs (`runner.NxDGraphs`), built on first use."""
        if getattr(self, "_host_loop", None) is None:
            vision = weights.vision_export(self.config)
            self._host_loop = nxd_runtime(self._traced_model, self.config, self.neuron_config, vision)
        return self._host_loop

    def _runtime_for_images(self):
        if weights.vision_export(self.config) is None:
            raise UsageError(generation.TEXT_ONLY_EXPORT)
        return self._host_runtime()

    def _rows_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        length = self.neuron_config.max_context_length
        longest = max(map(len, prompts), default=0)
        if longest > length:
            raise UsageError(
                f"an input of {longest} tokens is longer than the compiled context length ({length}): shorten it, or "
                "score it in windows of at most that many tokens"
            )
        rows = []
        for prompt in prompts:  # the graph is compiled for one row, as context encoding
            ids = torch.tensor([prompt], dtype=torch.int32)
            ids, positions = adapter.pad_context_inputs(
                ids, torch.arange(len(prompt), dtype=torch.int32)[None], length, self.config.pad_token_id or 0
            )
            logits = self._traced_model(ids, positions)  # routed to the logits graph by its two inputs
            logits = logits[0] if isinstance(logits, (list, tuple)) else logits
            rows.append(logits[0, : len(prompt)].float())
        return rows

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config, neuron_config) -> dict:
        return weights.convert_hf_to_neuron_state_dict(state_dict, config, neuron_config)

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict: dict) -> None:
        weights.tie_lm_head(state_dict)

    @classmethod
    def _get_neuron_config(cls, checkpoint_id, checkpoint_revision, instance_type, batch_size, sequence_length, tensor_parallel_size, dtype, **kwargs):
        return nxd_neuron_config(
            checkpoint_id, checkpoint_revision, instance_type, batch_size, sequence_length, tensor_parallel_size, dtype
        )

    @classmethod
    def create_graph_builders(cls, config, neuron_config):
        """The text graphs, and a vision export's graphs (`vision_graph_builders`) when its config says so."""
        adapter.check_neuron_config(neuron_config)
        adapter.set_local_world_size(neuron_config)  # before the export's trace and the load build any parallel state
        ctx = NxDModelForCausalLM._create_context_encoding_config(neuron_config)
        tkg = NxDModelForCausalLM._create_token_generation_config(neuron_config)
        builders = {
            "context_encoding": Qwen35DecoderBuilder(
                config, ctx, max_tokens=ctx.max_context_length, active_tokens=ctx.max_context_length, model_cls=cls._model_cls
            ),
            "token_generation": Qwen35DecoderBuilder(
                config, tkg, max_tokens=tkg.sequence_length, active_tokens=1, model_cls=cls._model_cls, priority_model_idx=0
            ),
            LOGITS_MODEL_TAG: Qwen35LogitsBuilder(
                config, ctx, max_tokens=ctx.max_context_length, active_tokens=ctx.max_context_length, model_cls=cls._model_cls
            ),
        }
        vision = weights.vision_export(config)
        if vision is not None:
            builders.update(vision_graph_builders(config, *vision, neuron_config, cls._model_cls))
        max_speculative_tokens = weights.mtp_export(config)
        if max_speculative_tokens:
            builders.update(speculative_graph_builders(config, neuron_config, max_speculative_tokens, cls._model_cls))
        check_shape_keys(builders)
        return builders

    @classmethod
    def get_compiler_args(cls, neuron_config) -> str:
        return adapter.compiler_args(neuron_config.target, neuron_config.logical_nc_config)

    # ------------------------------------------------------------------ weights, split by this project's layout
    def _ranks(self) -> range:
        nc = self.neuron_config
        return range(nc.start_rank_id, nc.start_rank_id + nc.local_ranks_size)

    def _rank_state_dicts(self, checkpoint_path) -> list[dict[str, torch.Tensor]]:
        """Each local rank's tensors from a Hugging Face checkpoint folder (optimum-neuron's `get_state_dict`:
        every safetensors file, prefix stripped, `convert_hf_to_neuron_state_dict`, the tied lm_head)."""
        whole = self.get_state_dict(checkpoint_path, self.config, self.neuron_config)
        nc = self.neuron_config
        ranks = [weights.rank_state_dict(whole, nc.tp_degree, r, nc.torch_dtype, self.config) for r in self._ranks()]
        vision = weights.vision_export(self.config)
        if vision is not None:  # the vision graphs' weights, beside the decoder's in each rank's file
            for rank, tensors in zip(self._ranks(), ranks):
                tensors.update(weights.vision_rank_state_dict(checkpoint_path, vision[0], nc.tp_degree, rank, nc.torch_dtype))
        if weights.mtp_export(self.config):  # the MTP head's, sharded as the CPU runtime shards it
            for rank, tensors in zip(self._ranks(), ranks):
                tensors.update(weights.mtp_rank_state_dict(checkpoint_path, self.config, nc.tp_degree, rank, nc.torch_dtype))
        return ranks

    def _load_weights_from_path(self, weights_path):
        if os.path.exists(shard_file(weights_path, self.neuron_config.start_rank_id)):
            return super()._load_weights_from_path(weights_path)  # the pre-split files `shard_checkpoint` writes
        if self._traced_model is None:
            raise ValueError("Model is not loaded")
        rank_tensors = self._rank_state_dicts(weights_path)
        start_rank = torch.tensor([self.neuron_config.start_rank_id], dtype=torch.int32, device="cpu")
        self._traced_model.nxd_model.initialize(rank_tensors, start_rank)

    def _save_pretrained(self, save_directory, **kwargs):
        """optimum-neuron's save; a vision export also gets its checkpoint's processor files (written, not run here:
        saving needs the compiled graphs)."""
        super()._save_pretrained(save_directory, **kwargs)
        if weights.vision_export(self.config) is not None:
            copy_processor_files(self.config._name_or_path, save_directory)

    def shard_checkpoint(self, src_path, dest_path, debug: bool = False):
        """Write each rank's tensors where `_load_weights_from_path` finds them (called by `save_pretrained` for
        a model exported from a local folder)."""
        os.makedirs(get_shards_path(dest_path), exist_ok=True)
        for rank, tensors in zip(self._ranks(), self._rank_state_dicts(src_path)):
            save_file(tensors, shard_file(dest_path, rank))
