"""Qwen3.5 on optimum-neuron 0.4.5's NxD backend (needs the Neuron SDK; imported lazily by the Neuron targets).

`Qwen35NxDModelForCausalLM`, the `NxDModelForCausalLM` subclass: the graphs (context encoding, token generation, and
the per-position logits graph of `forward()`; optimum-neuron's own speculation is off; builders.py builds them over
the traced modules of traced.py), compiler flags, and weights split per rank by this project's layout (`state_dict`)
instead of neuronx-distributed's splitter, which does not split plain parameters (A_log, dt_bias, conv_weight). An
export made with mtp=True (`state_dict.mtp_export`: its config says so) also holds the checkpoint's
multi-token-prediction head and the graphs of speculative decoding with it (builders.py
`speculative_graph_builders`), which `generate(..., num_speculative_tokens=k)` runs through the host loop
(runner.py). `Qwen35DecoderWrapper`: optimum-neuron's decoder wrapper, with padding rows that name no slot.

`optimum_qwen35.optimum_neuron.Qwen35NeuronModelForCausalLM` hands its Neuron targets to `Qwen35NxDModelForCausalLM`.
None of this has run: see docs/neuron_backend.md.
"""

from __future__ import annotations

import os

import torch
from optimum.neuron.models.inference.backend.modules.decoder.decoder_wrappers import (
    CONTEXT_ENCODING_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    NxDDecoderWrapperForCausalLM,
)
from optimum.neuron.models.inference.backend.modules.decoder.modeling_decoder import NxDModelForCausalLM
from optimum.neuron.models.inference.backend.pretrained_model import get_shards_path
from safetensors.torch import save_file

from optimum_qwen35.backends.nxd import adapter, fp8
from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.backends.nxd.builders import (
    Qwen35DecoderBuilder,
    Qwen35LogitsBuilder,
    check_shape_keys,
    speculative_graph_builders,
    vision_graph_builders,
)
from optimum_qwen35.backends.nxd.runner import nxd_runtime
from optimum_qwen35.backends.nxd.traced import LOGITS_MODEL_TAG, Qwen35NxDDecoderModel
from optimum_qwen35.errors import UsageError
from optimum_qwen35.optimum_neuron import generation
from optimum_qwen35.optimum_neuron.neuron_config import nxd_neuron_config
from optimum_qwen35.optimum_neuron.scoring import causal_lm_forward
from optimum_qwen35.processing import copy_processor_files


def shard_file(checkpoint_dir: str, rank: int) -> str:
    """Where optimum-neuron 0.4.5 looks for rank `rank`'s pre-split weights (`pretrained_model.py` L194)."""
    return os.path.join(get_shards_path(checkpoint_dir), f"tp{rank}_sharded_checkpoint.safetensors")


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
        nc = self.neuron_config
        if fp8.fp8_export(self.config):  # float8 weights split and fitted per rank (backends/nxd/fp8.py)
            ranks = [fp8.fp8_rank_state_dict(checkpoint_path, self.config, nc.tp_degree, r, nc.torch_dtype)
                     for r in self._ranks()]
        else:
            whole = self.get_state_dict(checkpoint_path, self.config, self.neuron_config)
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


class Qwen35NxDFp8ModelForCausalLM(Qwen35NxDModelForCausalLM):
    """An export with FP8 weights (backends/nxd/fp8.py): its graphs compile with neuronx-cc reading their
    float8_e4m3fn weights as the targets' float8_e4m3 (exact: the weights are within its range)."""

    @classmethod
    def get_compiler_args(cls, neuron_config) -> str:
        return adapter.compiler_args(neuron_config.target, neuron_config.logical_nc_config, fp8_weights=True)
