"""The graph builders of the NxD export (needs the Neuron SDK), as optimum-neuron's `decoder_builders.py`: for each
graph, the example inputs it is traced with and the model instance that builds its traced module (traced.py) and
aliases its held state (`Qwen35DecoderModelInstance` re-casts the state to its dtypes after optimum-neuron's load-time
cast, the recurrent state back to fp32, and aliases every held state to its output).

- the text graphs: context encoding and token generation (`Qwen35DecoderBuilder`), and the per-position logits graph
  of `forward()` (`Qwen35LogitsBuilder`);
- a vision export's (`vision_graph_builders`): `vision_<N>` per image bucket, image context encoding and image token
  generation;
- an export made with mtp=True (`speculative_graph_builders`): context encoding returning the hidden states, verify of
  K + 1 positions, commit, the head over 1, K + 1 and a prompt's positions.

neuronx-distributed routes a call to the graph whose example inputs have its shapes: `check_shape_keys`.
"""

from __future__ import annotations

import torch
from neuronx_distributed.trace.model_builder import BaseModelInstance
from optimum.neuron.models.inference.backend.graph_builder import NxDGraphBuilder
from optimum.neuron.models.inference.backend.modules.decoder.decoder_builders import (
    DecoderModelInstanceForCausalLM,
    NxDDecoderBuilderForCausalLM,
)
from optimum.neuron.models.inference.backend.modules.decoder.modeling_decoder import NxDModelForCausalLM

from optimum_qwen35.backends.nxd import adapter, fp8
from optimum_qwen35.backends.nxd.traced import (
    COMMIT_MODEL_TAG,
    CONTEXT_HIDDEN_MODEL_TAG,
    IMAGE_CONTEXT_MODEL_TAG,
    IMAGE_TOKEN_MODEL_TAG,
    MTP_CATCH_UP_MODEL_TAG,
    MTP_DRAFT_MODEL_TAG,
    MTP_PROMPT_MODEL_TAG,
    SPECULATIVE_OUTPUTS,
    VERIFY_MODEL_TAG,
    Qwen35NxDVisionModel,
)
from optimum_qwen35.modeling.precision import accumulation_dtype
from optimum_qwen35.modeling.vision import image_bucket_inputs


class Qwen35DecoderModelInstance(DecoderModelInstanceForCausalLM):
    def load_module(self):
        super().load_module()  # builds the module, then casts every floating tensor to the model dtype
        adapter.restore_state_dtypes(self.module.past_key_values, self.module.held_specs)
        adapter.restore_fp32_parameters(self.module)
        fp8.restore_fp8_scales(self.module)

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
