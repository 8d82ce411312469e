"""Generation over the host loop's two steps (`prefill`, `decode`): `generate`, greedy or sampled, one token per step,
or speculative with the checkpoint's multi-token-prediction head (runtime/speculative.py `generate_wave`), wave by
wave when there are more prompts than slots.

`GenerationMixin` is one of `Qwen35Runtime`'s bases (runtime/host_loop.py): it uses the runtime's `prefill`,
`decode`, `_check_length`, `_image_prompts`, `graphs`, `config`, `batch_size` and `max_length`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from optimum_qwen35 import validation
from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime.min_new_tokens import suppress_eos
from optimum_qwen35.runtime.speculative import SpeculationStats, check_runner, generate_wave

logger = logging.getLogger(__name__)


class GenerationMixin:
    """`generate`: plain decoding (`generate` itself) and speculative decoding (`_generate_speculative`)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] = 32,
        eos_token_id: int | Sequence[int] | None = None,
        streamer=None,
        sampler=None,
        pixel_values=None,
        image_grid_thw=None,
        stop=None,
        min_new_tokens: int = 0,
        num_speculative_tokens: int = 0,
        distribution=None,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Greedy decoding (or `sampler(logits [n, vocab]) -> tokens [n]`); returns up to `max_new_tokens`
        (>= 1) new tokens of each prompt, stopping after an EOS token; `max_new_tokens` may also be one limit per
        prompt (each row stops at its own, the others run on). `min_new_tokens` (default 0): no EOS token is chosen
        before that many new tokens (transformers' `min_new_tokens`). Prompts beyond `batch_size` run in successive
        waves (logged once per model). `streamer(step, tokens)` is called once per step with the tokens of the wave's
        rows; `stop(first_row, new_tokens, logits) -> one bool per wave row` (optional) after each step, with the
        index of the wave's first prompt, each wave row's new tokens so far and the logits the step's tokens were
        chosen from: a row it flags finishes there, as after an EOS. Prompts holding images take the processor's
        `pixel_values` [patches, patch_dim] and `image_grid_thw` [images, 3], the images in prompt order. Every
        argument is checked before the first graph runs.

        `num_speculative_tokens=k` (0: off, the default) decodes speculatively with the checkpoint's own
        multi-token-prediction head (loaded with `from_pretrained(..., mtp=True)`; runtime/speculative.py): k drafts
        per step, verified in one graph. Greedy, it returns exactly what greedy decoding returns; sampled, pass
        `distribution(logits [n, vocab]) -> probabilities [n, vocab]` (instead of `sampler`) and optionally a
        `generator`: the standard rejection rule keeps plain sampling's distribution. Per-row `max_new_tokens` and
        `min_new_tokens` and `stop` as above (called once per step as plain decoding calls it, its rows' tokens the
        same); text prompts only; a `streamer` with one prompt only (called once per new token,
        `streamer(index, [token])`). `self.speculation` holds the last call's counts (acceptance length)."""
        num_speculative_tokens = validation.positive_int(num_speculative_tokens, "num_speculative_tokens", minimum=0)
        if num_speculative_tokens:
            return self._generate_speculative(prompts, max_new_tokens, eos_token_id, num_speculative_tokens, distribution,
                                              generator, streamer, sampler, pixel_values, image_grid_thw, stop,
                                              min_new_tokens)
        if distribution is not None or generator is not None:
            raise UsageError("distribution and generator go with num_speculative_tokens > 0 (plain sampling takes sampler)")
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        limits = self._new_token_limits(prompts, max_new_tokens)
        min_new_tokens = validation.positive_int(min_new_tokens, "min_new_tokens", minimum=0)
        eos = validation.eos_ids(eos_token_id)
        for name, fn in (("streamer", streamer), ("sampler", sampler), ("stop", stop)):
            if fn is not None and not callable(fn):
                raise UsageError(f"{name} must be a callable or None, got {type(fn).__name__}")
        choose = sampler or (lambda logits: logits.argmax(-1))

        def pick(logits: torch.Tensor, step: int) -> torch.Tensor:
            return choose(suppress_eos(logits, eos, step, min_new_tokens))

        images = self._image_prompts(prompts, pixel_values, image_grid_thw)  # the vision tower runs after the checks
        if len(prompts) > self.batch_size and not self._waves_logged:
            self._waves_logged = True
            logger.warning(
                "generate: %d prompts on a model of batch size %d run in %d successive waves of at most %d rows "
                "(logged once); build or export the model with a larger batch size to run them together",
                len(prompts), self.batch_size, -(-len(prompts) // self.batch_size), self.batch_size,
            )
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            group = prompts[start : start + self.batch_size]
            group_limits = limits[start : start + self.batch_size]
            slots = list(range(len(group)))
            group_images = None if images is None else images[start : start + self.batch_size]
            logits = self.prefill(group, slots, images=group_images)
            next_tokens = pick(logits, 0).tolist()
            positions = [len(p) for p in group]
            outputs = [[] for _ in group]
            done = [False] * len(group)
            steps = max(group_limits)
            for step in range(steps):
                for i in range(len(group)):
                    if not done[i]:
                        outputs[i].append(next_tokens[i])
                        done[i] = next_tokens[i] in eos or len(outputs[i]) >= group_limits[i]
                if streamer is not None:
                    streamer(step, next_tokens[: len(group)])
                if stop is not None:
                    done = [d or bool(f) for d, f in zip(done, stop(start, outputs, logits[: len(group)]))]
                if all(done) or step == steps - 1:
                    break
                # A row past its own limit is finished: it still rides along (its slot, its garbage tokens), held at
                # the last cache position so that it never runs past max_length.
                logits = self.decode(next_tokens, [min(p, self.max_length - 1) for p in positions], slots)
                next_tokens = pick(logits, step + 1).tolist()
                positions = [p + 1 for p in positions]
            results += outputs
        return results

    def _new_token_limits(self, prompts: Sequence[Sequence[int]], max_new_tokens) -> list[int]:
        """`max_new_tokens` (one int, or one per prompt) checked against each prompt: one limit per prompt."""
        if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
            if len(max_new_tokens) != len(prompts):
                raise UsageError(
                    f"max_new_tokens has {len(max_new_tokens)} limits for {len(prompts)} prompts: give one int or one per prompt"
                )
            limits = [validation.positive_int(n, "max_new_tokens") for n in max_new_tokens]
        else:
            limits = [validation.positive_int(max_new_tokens, "max_new_tokens")] * len(prompts)
        for row, (p, limit) in enumerate(zip(prompts, limits)):
            self._check_length(len(p))  # a prompt longer than max_length gets that error first
            if len(p) + limit > self.max_length:
                raise UsageError(
                    f"row {row}: prompt ({len(p)} tokens) + max_new_tokens ({limit}) exceeds max_length "
                    f"{self.max_length} (room for {self.max_length - len(p)} new tokens); lower max_new_tokens or "
                    "build (export) the model with a larger max_length"
                )
        return limits

    # Without no_grad the head, verify and commit calls (runtime/speculative.py calls the graphs directly, not through
    # prefill / decode) recorded autograd graphs over the decoder's parameters: CPU time spent for nothing, and at
    # TP > 1 the gathered logits' in-place write failed under grad mode.
    @torch.no_grad()
    def _generate_speculative(self, prompts, max_new_tokens, eos_token_id, k, distribution, generator, streamer,
                              sampler, pixel_values, image_grid_thw, stop, min_new_tokens) -> list[list[int]]:
        """`generate(..., num_speculative_tokens=k)`: runtime/speculative.py, wave by wave."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        eos = validation.eos_ids(eos_token_id)
        min_new_tokens = validation.positive_int(min_new_tokens, "min_new_tokens", minimum=0)
        if any(x is not None for x in (sampler, pixel_values, image_grid_thw)):
            raise UsageError(
                "speculative decoding takes text prompts, greedy or `distribution` sampling: no sampler or images "
                "(pass num_speculative_tokens=0 with them)"
            )
        for name, fn in (("distribution", distribution), ("streamer", streamer), ("stop", stop)):
            if fn is not None and not callable(fn):
                raise UsageError(f"{name} must be a callable or None, got {type(fn).__name__}")
        if streamer is not None and len(prompts) != 1:
            raise UsageError(f"a streamer with speculative decoding takes one prompt, got {len(prompts)}: pass one prompt "
                             "per call, or num_speculative_tokens=0 to stream a batch")
        check_runner(self.graphs, k)
        limits = self._new_token_limits(prompts, max_new_tokens)
        self.speculation = SpeculationStats()
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            group = prompts[start : start + self.batch_size]
            results += generate_wave(self, group, list(range(len(group))), limits[start : start + self.batch_size], eos,
                                     k, distribution, generator, self.speculation, min_new_tokens, streamer, stop,
                                     first_row=start)
        return results
