"""The multi-token-prediction (MTP) head every Qwen3.5 checkpoint ships (`mtp.*`), a draft model for speculative decoding.

At position i the head reads the main model's final hidden state h_i (after the final norm: what lm_head reads)
and the embedding of the next token t_{i+1}, and predicts the token after it, t_{i+2}:

    x_i    = fc( [ pre_fc_norm_embedding(embed(t_{i+1})) | pre_fc_norm_hidden(h_i) ] )     fc: [H, 2H], no bias
    y_i    = the head's full-attention decoder layer `mtp.layers.0` over x_0 .. x_i (rotary position i; its own KV
             cache; a sparse MoE block in MoE checkpoints)
    out_i  = mtp.norm(y_i);   logits_i = lm_head(out_i)   (embedding and lm_head shared with the main model)

The concatenation order (embedding first, hidden second), the zero-centred RMSNorms (1 + w) and the hidden state
after the final norm are those of vLLM's Qwen3.5 MTP model (vllm/model_executor/models/qwen3_5_mtp.py,
`Qwen3_5MultiTokenPredictor.forward`, vllm-project/vllm at 01d99805, read for the equations; nothing copied), whose
proposer passes the target model's returned (final-normed) hidden states and, for the next draft, the head's own
`out_i`. Drafting k tokens re-runs the one layer: draft s + 1 reads (out of draft s, draft s) at the next position.

A draft vocabulary (`MTPHead.set_draft_vocab`, runtime/draft_vocab.py): the head's logits over V_d chosen token ids
only, from a [V_d, H] copy of those lm_head rows (`draft_head`), so that a draft reads V_d rows instead of the whole
head; verification keeps the main model's full lm_head, so speculation stays exact (docs/speculative_decoding.md).
In a cpu export (graphs.json "mtp" "draft_ids") the rows are an input of the head's programs, taken from lm_head's at
load (runtime/exported.py `load_mtp_program_weights`).

The head lives in the one model definition (`Qwen35Decoder(..., mtp=True)`, modeling/decoder.py runs it: it needs
the shared embedding, rotary tables and lm_head); this module holds its parameters and its state specs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen35Config
from ..errors import UnsupportedModelError
from .layers import RMSNorm
from .parallel import ShardedDims, VocabParallelHead
from .state import StateSpec


DRAFT_HEAD_WEIGHT = "mtp.draft_head.weight"  # the draft vocabulary's rows, among the decoder's weights (`set_draft_vocab`)


class MTPHead(nn.Module):
    """The head's parameters, named as the checkpoint names them under `mtp.`; `layers` are the decoder's own layer
    class, built by the caller (full attention; MoE blocks in MoE checkpoints)."""

    def __init__(self, config: Qwen35Config, layers: list[nn.Module], factory):
        super().__init__()
        if len(layers) != 1:
            raise UnsupportedModelError(
                f"mtp_num_hidden_layers={len(layers)}: only the one-layer multi-token-prediction head of the published "
                "Qwen3.5 checkpoints is supported"
            )
        h = config.hidden_size
        # fc is replicated: its output is the head's residual stream, which every rank holds whole (as the main
        # model's). At tp_degree 1 the factory's column linear is that; above it a column-parallel linear would shard
        # the output (neuronx-distributed's does), so the factory's replicated linear holds the whole [H, 2H] weight on
        # every rank.
        # The layer is the decoder's own, sharded as the main model's attention layers and MLP / MoE blocks.
        self.fc = factory.column_linear(2 * h, h) if factory.tp_degree == 1 else factory.replicated_linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_head = None  # the draft vocabulary's rows of lm_head (`set_draft_vocab`); None: the whole lm_head

    def set_draft_vocab(self, lm_head: nn.Module, ids: torch.Tensor | None) -> None:
        """Score drafts over the token ids `ids` [V_d] only (None: the whole vocabulary again): the head's logits
        become [B, V_d], logit j being that of token ids[j], computed as lm_head computes its own (the same precision
        policy, fp32 out) from a contiguous copy of those rows. One rank only: at tp_degree > 1 lm_head holds a vocabulary
        block per rank."""
        if ids is None:
            self.draft_head = None
            return
        if getattr(lm_head, "tp_degree", 1) > 1:
            raise UnsupportedModelError(
                "a draft vocabulary runs at tp_degree 1 only for now (lm_head is split by vocabulary across ranks): "
                "load the model with tp_degree=1, or speculate over the whole vocabulary"
            )
        weight = lm_head.weight.detach()
        weight = weight.to_dense() if weight.is_mkldnn else weight
        ids = torch.as_tensor(ids, dtype=torch.int64)
        head = VocabParallelHead(weight.shape[1], len(ids), len(ids), precision=lm_head.precision)
        head.weight = nn.Parameter(weight.index_select(0, ids.to(weight.device)).contiguous(), requires_grad=False)
        self.draft_head = head

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [B, T, H] (fp32) -> the layer's input [B, T, H] in fp32 (the residual stream's dtype)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        return self.fc(x.to(self.norm.weight.dtype)).to(embeds.dtype)  # the model dtype into the linear


def mtp_state_specs(config: Qwen35Config, dims: ShardedDims, slots: int, max_length: int, dtype: torch.dtype):
    """The head's KV cache, one K and one V per layer, shaped as the decoder's attention caches."""
    shape = (slots, dims.num_kv_heads, max_length, config.head_dim)
    return [StateSpec(f"mtp.layers.{i}.{kind}", shape, dtype)
            for i in range(config.mtp_num_hidden_layers) for kind in ("key_cache", "value_cache")]
