"""`model(input_ids, attention_mask, labels)` as transformers answers it, for every target.

A target supplies one function: the logits of every position of each row's real tokens (`rows_logits`, a list of
token lists in, one [len, vocab] fp32 tensor per row out). This module checks the arguments and builds transformers'
`CausalLMOutput`: logits [batch, length, vocab] (zeros where `attention_mask` is 0; left or right padding), and with
`labels` the mean next-token cross-entropy `loss` (labels shifted inside, -100 ignored, as transformers does).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_outputs import CausalLMOutput

from optimum_qwen35.errors import UsageError
from optimum_qwen35.optimum_neuron.generation import token_lists

# What forward() accepts without using: transformers' pipelines and harnesses pass them.
IGNORED = ("use_cache", "position_ids", "token_type_ids")


def causal_lm_forward(
    rows_logits: Callable[[list[list[int]]], list[torch.Tensor]],
    vocab_size: int,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    return_dict: bool | None = None,
    **kwargs,
):
    refused = sorted(k for k, v in kwargs.items() if k not in IGNORED and v is not None and v is not False)
    if refused:
        raise UsageError(
            f"forward() does not take {refused}: it returns the logits of every position of input_ids "
            "(use generate(), or prefill()/decode() for a cache)"
        )
    if input_ids is None:
        raise UsageError("forward() needs input_ids, a 2-D integer tensor [batch, length]")
    prompts = token_lists(input_ids, attention_mask)
    if kwargs.get("position_ids") is not None:
        positions = kwargs["position_ids"]
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        expected = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask.long()
        if positions.shape != input_ids.shape or not torch.equal(positions.long() * mask.long(), expected):
            raise UsageError("position_ids must count each row's real tokens from 0 (forward() scores whole sequences)")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
        raise UsageError(f"labels must be a tensor shaped like input_ids {tuple(input_ids.shape)}")
    rows = rows_logits(prompts)
    logits = torch.zeros(*input_ids.shape, rows[0].shape[-1] if rows else vocab_size)
    for row, values in enumerate(rows):
        if attention_mask is None:
            logits[row, : values.shape[0]] = values
        else:
            logits[row, attention_mask[row].bool()] = values
    loss = None
    if labels is not None:
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).long(), ignore_index=-100
        )
    if return_dict is False:
        return (logits,) if loss is None else (loss, logits)
    return CausalLMOutput(loss=loss, logits=logits)
