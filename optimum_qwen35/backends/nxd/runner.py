"""Prompts holding images and speculative decoding on a Neuron export: the host loop over the traced model's graphs.

The host loop is the one definition of what happens around the graphs (runtime/host_loop.py `Qwen35Runtime`: slots,
prefill, decode, generate; runtime/images.py `ImageInputs`: the checks, one vision graph call per image, the placement
of its tokens and the 3-D positions). `NxDGraphs` is its graph runner over the Neuron graphs instead of the cpu ones.
Each call goes to `traced_model`, which routes it to the graph whose inputs have its shapes (as neuronx-distributed's
runtime does):

- `vision_<N>`: (patches, pos_index, pos_weight, rotary_pos, segment) of an image in its bucket -> merged tokens;
- `image_context_encoding`: one right-padded row (optimum-neuron's convention: padding at position 1) with its 3-D
  positions, image embeddings and mask -> the last token's logits, the row's slot of the held state written;
- `context_encoding` / `token_generation` / `image_token_generation`: as optimum-neuron calls them, the last with
  the rotary positions (cache position + the slot's rope delta);
- an export made with mtp=True (runtime/speculative.py's calls, the contract of runtime/exported.py
  `SpeculativePrograms`): `context_hidden` (one right-padded row -> the last token's logits and every position's
  hidden state), `verify` (K + 1 positions of the batch; a round of fewer drafts padded past each row's length),
  `commit`, and the head's `mtp_draft` (1 position), `mtp_catch_up` (K + 1) and `mtp_prompt` (one row of the
  context length). Verify's per-position DeltaNet states stay in the traced model (held scratch state) for commit.

The state stays in the traced model (the graphs alias it); the host loop keeps each slot's encoded length and rope
delta. Prompts run in one context-encoding call each, so a prompt must fit the compiled context length.
"""

from __future__ import annotations

import torch

from optimum.neuron.models.inference.backend.modules.generation.sampling import prepare_sampling_params

from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.backends.nxd.state_dict import mtp_export
from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.runtime.exported import pad_positions
from optimum_qwen35.runtime.host_loop import Qwen35Runtime


def nxd_runtime(traced_model, config, neuron_config, vision=None) -> Qwen35Runtime:
    """The host loop over a Neuron export's traced graphs: one context bucket (the compiled context length), one
    cache bucket (the sequence length). `vision`: (VisionConfig, image buckets) of a vision export."""
    graphs = NxDGraphs(traced_model, config, neuron_config)
    vision_config, image_buckets = vision if vision is not None else (None, None)
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
        self.hidden_size = config.hidden_size
        # Speculative decoding (an export made with mtp=True): K, the most drafts a round verifies.
        self.max_speculative_tokens = mtp_export(config)
        self._verified = False  # verify ran, its commit has not

    @property
    def has_mtp(self) -> bool:
        return self.max_speculative_tokens > 0

    def _outputs(self, *inputs) -> list:
        out = self.traced_model(*inputs)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def _call(self, *inputs):
        return self._outputs(*inputs)[0]

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

    # ------------------------------------------------------------------ speculative decoding (runtime/speculative.py)
    def _active_rows(self, seq_ids) -> list[int]:
        return [int(i) for i in torch.nonzero(seq_ids >= 0)]

    def context_hidden(self, length, key_length, ids, mask, positions, seq_ids):
        """(logits of each row's last token [B, vocab], hidden [B, T, H]) of fresh prompts, one row per call."""
        if key_length not in (None, length):
            raise IncompatibleExportError("a Neuron export encodes a prompt in one context-encoding call: shorten it")
        logits = torch.zeros(self.batch_size, self.vocab_size)
        hidden = torch.zeros(self.batch_size, length, self.hidden_size)
        for i in self._active_rows(seq_ids):
            n = int(mask[i].sum())
            row_ids, row_positions = adapter.pad_context_inputs(
                ids[i : i + 1, :n], positions[i : i + 1, :n], self.max_context_length, self.pad_token_id
            )
            row_logits, row_hidden = self._outputs(row_ids, row_positions, seq_ids[i : i + 1].to(torch.int32))[:2]
            logits[i] = row_logits.reshape(-1, self.vocab_size)[-1].float()
            hidden[i, :n] = row_hidden[0, :n].float()
        return logits, hidden

    def verify(self, key_length, ids, positions, lengths, seq_ids):
        """(logits [B, T, vocab], hidden [B, T, H]) of T verified tokens per row, through the K + 1 graph (a round of
        fewer drafts padded); the per-position DeltaNet states stay in the traced model until `commit`."""
        T = ids.shape[1]
        ids, positions = pad_positions(ids, positions, self.max_speculative_tokens + 1)
        logits, hidden = self._outputs(ids.to(torch.int32), positions.to(torch.int32), lengths.to(torch.int32),
                                       seq_ids.to(torch.int32))[:2]
        self._verified = True
        return logits[:, :T].float(), hidden[:, :T].float()

    def commit(self, seq_ids, accepted) -> None:
        """Each active row's DeltaNet states become those after its verified position accepted[b]."""
        if not self._verified:
            raise UsageError("commit without a verify before it")
        self._outputs(seq_ids.to(torch.int32), accepted.to(torch.int32))
        self._verified = False

    def mtp(self, key_length, ids, hidden, positions, lengths, seq_ids):
        """The MTP head over T positions per row: (logits [B, vocab], out [B, H]) at each row's last real one. One
        position: the draft graph; up to K + 1: the catch-up graph (padded); a prompt (the context length): one row
        per call."""
        T, width = ids.shape[1], self.max_speculative_tokens + 1
        hidden = hidden.float()  # the graphs take it in the accumulation dtype (fp32)
        if T > width:
            return self._mtp_prompt(ids, hidden, positions, lengths, seq_ids)
        if T > 1:
            hidden, _ = pad_positions(hidden, positions, width)
            ids, positions = pad_positions(ids, positions, width)
        logits, out = self._outputs(ids.to(torch.int32), hidden, positions.to(torch.int32), lengths.to(torch.int32),
                                    seq_ids.to(torch.int32))[:2]
        return logits.float(), out.float()

    def _mtp_prompt(self, ids, hidden, positions, lengths, seq_ids):
        if ids.shape[1] != self.max_context_length:
            raise IncompatibleExportError(
                f"the MTP head runs over prompts in the compiled context length ({self.max_context_length})"
            )
        logits = torch.zeros(self.batch_size, self.vocab_size)
        out = torch.zeros(self.batch_size, self.hidden_size)
        for i in self._active_rows(seq_ids):
            row = (ids[i : i + 1].to(torch.int32), hidden[i : i + 1], positions[i : i + 1].to(torch.int32),
                   lengths[i : i + 1].to(torch.int32), seq_ids[i : i + 1].to(torch.int32))
            row_logits, row_out = self._outputs(*row)[:2]
            logits[i], out[i] = row_logits[0].float(), row_out[0].float()
        return logits, out

    def close(self) -> None:
        """Nothing to stop: the traced model belongs to the NxD model class."""
