"""Prompts holding images on a Neuron export: the host loop over the traced model's graphs.

The host loop is the one definition of what happens around the graphs (runtime/host_loop.py `Qwen35Runtime`: slots,
prefill, decode, generate; runtime/images.py `ImageInputs`: the checks, one vision graph call per image, the placement
of its tokens and the 3-D positions). `NxDGraphs` is its graph runner over the Neuron graphs instead of the cpu ones.
Each call goes to `traced_model`, which routes it to the graph whose inputs have its shapes (as neuronx-distributed's
runtime does):

- `vision_<N>`: (patches, pos_index, pos_weight, rotary_pos, segment) of an image in its bucket -> merged tokens;
- `image_context_encoding`: one right-padded row (optimum-neuron's convention: padding at position 1) with its 3-D
  positions, image embeddings and mask -> the last token's logits, the row's slot of the held state written;
- `context_encoding` / `token_generation` / `image_token_generation`: as optimum-neuron calls them, the last with
  the rotary positions (cache position + the slot's rope delta).

The state stays in the traced model (the graphs alias it); the host loop keeps each slot's encoded length and rope
delta. Prompts run in one context-encoding call each, so a prompt holding images must fit the compiled context
length.
"""

from __future__ import annotations

import torch

from optimum.neuron.models.inference.backend.modules.generation.sampling import prepare_sampling_params

from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime.host_loop import Qwen35Runtime


def nxd_image_runtime(traced_model, config, vision_config, neuron_config, image_buckets) -> Qwen35Runtime:
    """The host loop over a Neuron vision export's traced graphs: one context bucket (the compiled context length),
    one cache bucket (the sequence length)."""
    graphs = NxDGraphs(traced_model, config, neuron_config)
    return Qwen35Runtime(graphs, config, neuron_config.batch_size, neuron_config.sequence_length,
                         [neuron_config.max_context_length], [neuron_config.sequence_length], vision_config, image_buckets)


class NxDGraphs:
    """The graph runner of a traced Neuron model (no decoder here: the graphs hold the weights and the state)."""

    def __init__(self, traced_model, config, neuron_config):
        # A prompt holding images runs in one context-encoding call: the host loop refuses longer ones up front.
        self.max_context_length = neuron_config.max_context_length
        self.batch_size, self.vocab_size = neuron_config.batch_size, config.vocab_size
        self.traced_model, self.dtype = traced_model, neuron_config.torch_dtype
        self.pad_token_id = config.pad_token_id or 0

    def _call(self, *inputs):
        out = self.traced_model(*inputs)
        return out[0] if isinstance(out, (list, tuple)) else out

    @staticmethod
    def _sampling(rows: int) -> torch.Tensor:
        """optimum-neuron's sampling parameters input (unused: tokens are chosen on the host from the logits)."""
        return prepare_sampling_params(rows)

    def vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        patches, *rest = inputs
        return self._call(patches.to(self.dtype), *adapter.int32_indices(rest))

    def _context(self, ids, mask, positions, seq_ids, image=None) -> torch.Tensor:
        """One context-encoding call per active row (the graph's batch is one row); the last token's logits."""
        logits = torch.zeros(self.batch_size, self.vocab_size)
        for i in (int(i) for i in torch.nonzero(seq_ids >= 0)):
            n = int(mask[i].sum())
            row_ids, row_positions = adapter.pad_context_inputs(
                ids[i : i + 1, :n], positions[i : i + 1, :n], self.max_context_length, self.pad_token_id
            )
            extra = ()
            if image is not None:  # rope [B, 3, T], embeds [B, T, hidden], mask [B, T]: the row, padded as its ids
                rope, embeds, image_mask = image
                pad = self.max_context_length - n
                extra = (
                    torch.nn.functional.pad(rope[i : i + 1, :, :n], (0, pad), value=1).to(torch.int32),
                    torch.nn.functional.pad(embeds[i : i + 1, :n], (0, 0, 0, pad)).to(self.dtype),
                    torch.nn.functional.pad(image_mask[i : i + 1, :n], (0, pad)).to(torch.int32),
                )
            out = self._call(row_ids, row_positions, seq_ids[i : i + 1], self._sampling(1), *extra)
            logits[i] = out.reshape(-1, self.vocab_size)[-1].float()
        return logits

    def context(self, length, all_logits, key_length, ids, mask, positions, seq_ids):
        if all_logits:
            raise UsageError("per-position logits of prompts run through forward() on a Neuron export (text only)")
        return self._context(ids, mask, positions, seq_ids)

    def image_context(self, length, all_logits, key_length, ids, mask, positions, seq_ids, *image):
        if all_logits:
            raise UsageError("per-position logits of prompts holding images are not available on a Neuron export")
        return self._context(ids, mask, positions, seq_ids, image)

    def token(self, key_length, ids, positions, seq_ids) -> torch.Tensor:
        return self._call(ids, positions, seq_ids, self._sampling(self.batch_size)).reshape(self.batch_size, -1).float()

    def image_token(self, key_length, ids, positions, seq_ids, rope) -> torch.Tensor:
        out = self._call(ids, positions, seq_ids, self._sampling(self.batch_size), rope)
        return out.reshape(self.batch_size, -1).float()

    def close(self) -> None:
        """Nothing to stop: the traced model belongs to the NxD model class."""
