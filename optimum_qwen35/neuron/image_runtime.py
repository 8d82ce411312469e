"""Prompts holding images on a Neuron export: the host loop over the traced model's graphs.

The cpu runtime's host code is the one definition of what happens around the graphs (`runtime.cpu.Qwen35ForCausalLM`:
slots, prefill, decode, generate; `runtime.vision.ImageInputs`: the checks, one vision graph call per image, the
placement of its tokens and the 3-D positions). `NxDImageRuntime` gives it the Neuron graphs instead of the cpu
ones. Each call goes to `traced_model`, which routes it to the graph whose inputs have its shapes (as
neuronx-distributed's runtime does):

- `vision_<N>`: (patches, pos_index, pos_weight, rotary_pos, segment) of an image in its bucket -> merged tokens;
- `image_context_encoding`: one right-padded row (optimum-neuron's convention: padding at position 1) with its 3-D
  positions, image embeddings and mask -> the last token's logits, the row's slot of the held state written;
- `context_encoding` / `token_generation` / `image_token_generation`: as optimum-neuron calls them, the last with
  the rotary positions (cache position + the slot's rope delta).

The state stays in the traced model (the graphs alias it); this object keeps each slot's encoded length and rope
delta. Prompts run in one context-encoding call each, so a prompt holding images must fit the compiled context
length.
"""

from __future__ import annotations

import torch

from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM
from optimum_qwen35.runtime.vision import ImageInputs
from optimum_qwen35.neuron import glue


class NxDImageRuntime(ImageInputs, Qwen35ForCausalLM):
    def __init__(self, traced_model, config, vision_config, neuron_config, image_buckets):
        # No decoder here: the graphs hold the weights and the state. Only the shapes of the cpu runtime.
        self.context_length = neuron_config.max_context_length
        self._set_shapes(config, neuron_config.batch_size, neuron_config.sequence_length, [self.context_length])
        self.key_buckets = [neuron_config.sequence_length]
        self.vision_config = vision_config
        self._set_image_buckets(image_buckets)
        self.traced_model, self.dtype = traced_model, neuron_config.torch_dtype
        self.pad_token_id = config.pad_token_id or 0

    def _check_length(self, length: int) -> None:
        super()._check_length(length)
        if length > self.context_length:
            raise UsageError(
                f"a prompt of {length} tokens is longer than the compiled context length ({self.context_length}): "
                "a prompt holding images runs in one context-encoding call; shorten it or export with a longer one"
            )

    def _call(self, *inputs):
        out = self.traced_model(*inputs)
        return out[0] if isinstance(out, (list, tuple)) else out

    @staticmethod
    def _sampling(rows: int) -> torch.Tensor:
        """optimum-neuron's sampling parameters input (unused: tokens are chosen on the host from the logits)."""
        from optimum.neuron.models.inference.backend.modules.generation.sampling import (  # noqa: PLC0415
            prepare_sampling_params,
        )

        return prepare_sampling_params(rows)

    def _run_vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        patches, *rest = inputs
        return self._call(patches.to(self.dtype), *glue.int32_indices(rest))

    def _context(self, ids, mask, positions, seq_ids, image=None) -> torch.Tensor:
        """One context-encoding call per active row (the graph's batch is one row); the last token's logits."""
        logits = torch.zeros(self.batch_size, self.config.vocab_size)
        for i in (int(i) for i in torch.nonzero(seq_ids >= 0)):
            n = int(mask[i].sum())
            row_ids, row_positions = glue.pad_context_inputs(
                ids[i : i + 1, :n], positions[i : i + 1, :n], self.context_length, self.pad_token_id
            )
            extra = ()
            if image is not None:  # rope [B, 3, T], embeds [B, T, hidden], mask [B, T]: the row, padded as its ids
                rope, embeds, image_mask = image
                pad = self.context_length - n
                extra = (
                    torch.nn.functional.pad(rope[i : i + 1, :, :n], (0, pad), value=1).to(torch.int32),
                    torch.nn.functional.pad(embeds[i : i + 1, :n], (0, 0, 0, pad)).to(self.dtype),
                    torch.nn.functional.pad(image_mask[i : i + 1, :n], (0, pad)).to(torch.int32),
                )
            out = self._call(row_ids, row_positions, seq_ids[i : i + 1], self._sampling(1), *extra)
            logits[i] = out.reshape(-1, self.config.vocab_size)[-1].float()
        return logits

    def _run_context(self, length, all_logits, key_length, ids, mask, positions, seq_ids):
        if all_logits:
            raise UsageError("per-position logits of prompts run through forward() on a Neuron export (text only)")
        return self._context(ids, mask, positions, seq_ids)

    def _run_image_context(self, length, all_logits, key_length, ids, mask, positions, seq_ids, *image):
        if all_logits:
            raise UsageError("per-position logits of prompts holding images are not available on a Neuron export")
        return self._context(ids, mask, positions, seq_ids, image)

    def _run_token(self, key_length, ids, positions, seq_ids) -> torch.Tensor:
        return self._call(ids, positions, seq_ids, self._sampling(self.batch_size)).reshape(self.batch_size, -1).float()

    def _run_image_token(self, key_length, ids, positions, seq_ids, rope) -> torch.Tensor:
        out = self._call(ids, positions, seq_ids, self._sampling(self.batch_size), rope)
        return out.reshape(self.batch_size, -1).float()
