"""`generate` as transformers and optimum-neuron users call it, on top of the runtime's slot-based loop.

The runtime (`runtime.host_loop.Qwen35Runtime.generate`) takes token lists and returns each prompt's new tokens; this
module turns a padded `input_ids`/`attention_mask` batch and a `GenerationConfig` (plus keyword
overrides) into that call, picks tokens on the host (greedy, or sampling through transformers' own
temperature / top-k / top-p warpers and `torch.multinomial`, so that `torch.manual_seed` makes it
reproducible), feeds a streamer, and returns `[batch, prompt + new]` like `transformers.generate`.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from optimum_qwen35.errors import UsageError

logger = logging.getLogger(__name__)
# Images given to an export without vision graphs (the cpu and the Neuron targets).
TEXT_ONLY_EXPORT = (
    "this export is text-only (no vision graphs): it takes no pixel_values / image_grid_thw; "
    "export the model with vision=True to give it images"
)
# What only sampling reads (reset to transformers' defaults for a greedy call).
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens (left or right padding both accepted)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise UsageError("input_ids must be a 2-D integer tensor [batch, length] (e.g. tokenizer(..., return_tensors='pt'))")
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
    if any(not p for p in prompts):
        raise UsageError("a row of attention_mask is all zeros: every prompt needs at least one token")
    return prompts


def _warpers(config) -> LogitsProcessorList:
    """transformers' temperature / top-k / top-p warpers of the generation config (sampling)."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        if config.temperature <= 0:
            raise UsageError(f"temperature must be > 0 when sampling, got {config.temperature}")
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k > 0:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    return warpers


def _distribution(config):
    """The sampling distribution from the generation config: logits [n, vocab] -> probabilities of the warped
    logits; None for greedy."""
    if not config.do_sample:
        return None
    warpers = _warpers(config)
    no_ids = torch.empty(0, dtype=torch.long)
    return lambda logits: torch.softmax(warpers(no_ids, logits.float()), dim=-1)


def _sampler(config):
    """Token choice from the generation config: argmax, or a sample from the warped distribution."""
    distribution = _distribution(config)
    if distribution is None:
        return None

    def sample(logits: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(distribution(logits), num_samples=1)[:, 0]

    return sample


def _stopping_criteria(criteria):
    """transformers' `stopping_criteria`: a `StoppingCriteriaList`, a list of criteria or one callable -> one callable
    (input_ids, scores) -> per-row flags, or None."""
    if criteria is None:
        return None
    if isinstance(criteria, (list, tuple)):
        if not all(callable(c) for c in criteria):
            raise UsageError("stopping_criteria must be a transformers StoppingCriteriaList (or a list of StoppingCriteria)")
        if not callable(criteria):  # a plain list: transformers' list (a StoppingCriteriaList is callable already)
            from transformers import StoppingCriteriaList  # noqa: PLC0415

            criteria = StoppingCriteriaList(criteria)
        return criteria
    if not callable(criteria):
        raise UsageError(f"stopping_criteria must be a transformers StoppingCriteriaList, got {type(criteria).__name__}")
    return criteria


def _stop_callback(criteria, input_ids: torch.Tensor, pad: int, vocab_size: int):
    """The runtime's `stop` hook calling transformers stopping criteria after every step, as transformers' loop does:
    with the whole batch's ids so far ([batch, prompt + new tokens], a finished row padded with `pad`) and the step's
    scores ([batch, vocab] fp32 logits). A criterion may flag rows (a bool tensor [batch], StoppingCriteriaList's
    answer) or the whole batch (one bool). With more rows than the compiled batch size (waves), the rows outside the
    running wave are shown as they stand (a finished wave's tokens, a waiting row's pad tokens, zero scores)."""
    batch = input_ids.shape[0]
    new_tokens: list[list[int]] = [[] for _ in range(batch)]

    def stop(first: int, outputs: list[list[int]], logits: torch.Tensor) -> list[bool]:
        rows = range(first, first + len(outputs))
        for row, tokens in zip(rows, outputs):
            new_tokens[row] = tokens
        width = max(len(t) for t in outputs)
        tail = torch.full((batch, width), pad, dtype=input_ids.dtype)
        for row, tokens in enumerate(new_tokens):
            tokens = tokens[:width]
            tail[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        scores = torch.zeros(batch, logits.shape[-1] if logits.dim() == 2 else vocab_size)
        scores[first : first + len(outputs)] = logits.float()
        flags = criteria(torch.cat([input_ids, tail], dim=1), scores)
        flags = torch.as_tensor(flags, dtype=torch.bool).reshape(-1)
        if flags.numel() == 1:
            flags = flags.expand(batch)
        if flags.numel() != batch:
            raise UsageError(f"stopping_criteria returned {flags.numel()} flags for a batch of {batch} rows: return one bool or one per row")
        return flags[first : first + len(outputs)].tolist()

    return stop


def row_limits(prompts: list[list[int]], max_length: int, max_new_tokens: int, config,
               stop_at_sequence_length: bool = False) -> tuple[list[int], int]:
    """Each row's limit of new tokens, and `min_new_tokens` (transformers' `min_new_tokens`, or `min_length` counted
    with the padded prompt). A row whose prompt + `max_new_tokens` does not fit the compiled sequence length is refused
    in one line naming the row, its room, the length and the fixes (issue 50: a silently shorter answer is scored as
    if complete); with `stop_at_sequence_length=True` (the caller's opt-in) such a row stops at the compiled length
    instead, with a warning naming the rows, while the others run on. Also refused in one line: a prompt that fills the
    compiled length, a minimum a row has no room for."""
    rooms = [max_length - len(p) for p in prompts]
    full = [row for row, room in enumerate(rooms) if room < 1]
    if full:
        row = full[0]
        raise UsageError(
            f"the prompt of row {row} ({len(prompts[row])} tokens) fills the compiled sequence length ({max_length}): "
            "no new token fits; shorten it or export the model with a larger sequence_length"
        )
    min_new_tokens = config.min_new_tokens or 0
    if not config.min_new_tokens and config.min_length:  # transformers: min_length counts the (padded) prompt
        min_new_tokens = max(0, config.min_length - max(len(p) for p in prompts))
    if min_new_tokens > max_new_tokens:
        raise UsageError(f"min_new_tokens ({min_new_tokens}) is more than max_new_tokens ({max_new_tokens}): lower it")
    short = [row for row, room in enumerate(rooms) if room < min_new_tokens]
    if short:
        row = short[0]
        raise UsageError(
            f"min_new_tokens ({min_new_tokens}) cannot be met: the prompt of row {row} ({len(prompts[row])} tokens) leaves "
            f"room for {rooms[row]} new tokens in the compiled sequence length ({max_length}); lower min_new_tokens, "
            "shorten the prompt or export the model with a larger sequence_length"
        )
    limits = [min(max_new_tokens, room) for room in rooms]
    cut = [row for row, limit in enumerate(limits) if limit < max_new_tokens]
    if cut and not stop_at_sequence_length:
        row = cut[0]
        raise UsageError(
            f"row {row} asks for {max_new_tokens} new tokens but its prompt ({len(prompts[row])} tokens) leaves room "
            f"for {rooms[row]} in the export's sequence length ({max_length}): export the model with a larger "
            f"sequence_length, ask for at most {rooms[row]} new tokens (max_new_tokens, or a max_length that fits), "
            "or pass stop_at_sequence_length=True to stop such rows there"
        )
    if cut:
        logger.warning(
            "rows %s stop before max_new_tokens (%d) at the compiled sequence length %d (at most %s new tokens, "
            "stop_at_sequence_length=True); the other rows run on",
            cut, max_new_tokens, max_length, [limits[row] for row in cut],
        )
    return limits, min_new_tokens


def generate(runtime, default_config, input_ids, attention_mask=None, generation_config=None, streamer=None,
             stopping_criteria=None, **kwargs):
    """Generate with `runtime` (a `Qwen35Runtime`); the caller's keyword arguments override the config.
    `stopping_criteria` (transformers') is called after every step (`_stop_callback`); `token_type_ids` is accepted
    and ignored (Qwen3.5 has no token types). A row asking for more new tokens than the compiled sequence length
    leaves it is refused, unless `stop_at_sequence_length=True` (then it stops there, with a warning: `row_limits`)."""
    config = copy.deepcopy(generation_config if generation_config is not None else default_config)
    criteria = _stopping_criteria(stopping_criteria)
    kwargs.pop("token_type_ids", None)
    # Speculative decoding with the MTP head (not a GenerationConfig field in transformers 4.57): 0 is off.
    speculative = kwargs.pop("num_speculative_tokens", 0)
    # The opt-in to rows stopping at the compiled length instead of a refusal (`row_limits`; not transformers').
    stop_at_sequence_length = kwargs.pop("stop_at_sequence_length", False)
    if not isinstance(stop_at_sequence_length, bool):
        raise UsageError(f"stop_at_sequence_length must be True or False, got {stop_at_sequence_length!r}")
    # Images (a vision export): the processor's outputs, passed to the runtime; mm_token_type_ids is implied by
    # the image tokens of input_ids.
    images = {k: kwargs.pop(k) for k in ("pixel_values", "image_grid_thw") if kwargs.get(k) is not None}
    kwargs.pop("mm_token_type_ids", None)
    if images and runtime.images is None:
        raise UsageError(TEXT_ONLY_EXPORT)
    unused = {}
    for key, value in kwargs.items():
        if hasattr(config, key):
            setattr(config, key, value)
        else:
            unused[key] = value
    if not config.do_sample:
        # Greedy: the sampling defaults of the saved config (Qwen3.5's temperature, top_k, top_p) do not apply, and
        # transformers would warn that they "are not valid and may be ignored"; the caller's own still do.
        defaults = type(config)()
        for key in SAMPLING_FLAGS:
            if key not in kwargs and hasattr(defaults, key):
                setattr(config, key, getattr(defaults, key))
    try:
        config.validate()
    except ValueError as error:  # GenerationConfig.validate: an invalid value
        raise UsageError(f"invalid generation option: {error}") from error
    unused = {k: v for k, v in unused.items() if v is not None and k not in ("use_cache", "output_attentions")}
    if unused:
        raise UsageError(f"generate() does not take {sorted(unused)}; see transformers.GenerationConfig for the options")
    if config.num_beams not in (None, 1):
        raise UsageError("beam search is not supported: use greedy decoding or sampling (num_beams=1)")
    prompts = token_lists(input_ids, attention_mask)
    max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - input_ids.shape[1]
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    limits, min_new_tokens = row_limits(prompts, runtime.max_length, max_new_tokens, config, stop_at_sequence_length)
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    # One runtime call for both ways of decoding: the streamer, the stopping criteria, the rows' limits and
    # min_new_tokens mean the same in each; plain decoding samples with the config's sampler (and takes images),
    # speculation with the config's distribution through the rejection rule.
    decoding = (_speculative_decoding(config, speculative, images) if speculative
                else {"sampler": _sampler(config), **images})
    on_token = _token_streamer(streamer, input_ids, prompts)
    stop = None if criteria is None else _stop_callback(criteria, input_ids, pad, runtime.config.vocab_size)
    new_tokens = runtime.generate(prompts, limits, eos_token_id=eos, streamer=on_token, stop=stop,
                                  min_new_tokens=min_new_tokens, **decoding)
    if streamer is not None:
        streamer.end()
    width = max(len(t) for t in new_tokens)
    tail = torch.full((len(prompts), width), pad, dtype=input_ids.dtype)
    for row, tokens in enumerate(new_tokens):
        tail[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)


def _token_streamer(streamer, input_ids, prompts):
    """A transformers streamer fed the prompt, then the runtime's new tokens one at a time; None without one."""
    if streamer is None:
        return None
    if len(prompts) != 1:
        raise UsageError("a streamer takes one prompt at a time (batch size 1), as in transformers")
    streamer.put(input_ids[:1].cpu())

    def on_token(step, tokens):
        streamer.put(torch.tensor(tokens[:1]))

    return on_token


def _speculative_decoding(config, k, images) -> dict:
    """The runtime's keywords for `generate(..., num_speculative_tokens=k)` (runtime/speculative.py): greedy, or
    sampled from `_distribution` (torch's global generator: `torch.manual_seed` makes it reproducible)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UsageError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
    if images:
        raise UsageError("num_speculative_tokens takes text prompts: pass num_speculative_tokens=0 with images")
    return {"num_speculative_tokens": k, "distribution": _distribution(config)}
