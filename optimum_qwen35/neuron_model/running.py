"""Running an export, the same on both stacks: its host loop (`runtime`), prefix caching, `generate`, continuous
batching (`prefill` / `decode`), teacher-forced `forward` and optimum-neuron's runner call (`serving_step`).

`ExportRunning` is a mixin of `neuron_model/base.py`'s `Qwen35ExportedModel`: it reads `self.folder`, `self.backend`,
`self.config`, `self.generation_config` and `self._run_options`, set there.
"""

from __future__ import annotations

import logging

import torch

from optimum_qwen35.backends.torchneuron.runner import load_runtime as load_torchneuron_runtime
from optimum_qwen35 import validation
from optimum_qwen35.errors import UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.optimum_neuron.generation import generate, token_lists
from optimum_qwen35.optimum_neuron.scoring import causal_lm_forward
from optimum_qwen35.runtime.host_loop import Qwen35Runtime
from optimum_qwen35.runtime.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class ExportRunning:
    """What runs an export's graphs (see the module docstring)."""

    _runtime = None
    _prefix_cache = "auto"
    _prefix_cache_budget = None  # "auto"'s budget in bytes (None: PrefixCache's default, 4 GiB)

    @property
    def runtime(self) -> Qwen35Runtime:
        """The host loop over the export's compiled programs (`runtime.host_loop.Qwen35Runtime.from_export`), started
        on first use; a TorchNeuron export's graphs are compiled by their first call (`compile_backend` and `device`
        of from_pretrained: "neuron" by default)."""
        if self._runtime is None:
            if self.backend == layout.TORCHNEURON_BACKEND:
                self._runtime = load_torchneuron_runtime(self.folder, **self._run_options)
            else:
                self._runtime = Qwen35Runtime.from_export(self.folder)
            self._apply_prefix_cache()
        return self._runtime

    def set_prefix_cache(self, cache: PrefixCache | str | None = "auto", *, budget_bytes: int | None = None) -> None:
        """Prefix caching for `generate` and the continuous-batching `prefill` / `decode` (runtime/prefix_cache.py,
        docs/prefix_caching.md): a prompt starting with the tokens of an earlier one resumes context encoding from
        its cached block states, with the same logits as without a hit.

        "auto" (the default): on, with a `PrefixCache` of the export's block size (4 GiB budget), where the export
        holds context programs that continue a sequence (cpu exports made by this version); off, with one log line,
        for older exports, whose context programs start fresh sequences only.
        A `PrefixCache`: on with that cache (its block size must be the export's), refused (IncompatibleExportError)
        where the graphs cannot resume. None: off. `budget_bytes`: "auto"'s budget (the most its block snapshots
        hold; the oldest are evicted past it)."""
        if not (cache is None or cache == "auto" or isinstance(cache, PrefixCache)):
            raise UsageError(f'prefix_cache must be "auto", a PrefixCache or None, got {cache!r}')
        if budget_bytes is not None and cache != "auto":
            raise UsageError('budget_bytes is the budget of prefix_cache="auto" (a PrefixCache has its own)')
        if budget_bytes is not None:
            validation.positive_int(budget_bytes, "budget_bytes")
        self._prefix_cache, self._prefix_cache_budget = cache, budget_bytes
        if self._runtime is not None:
            self._apply_prefix_cache()

    def _apply_prefix_cache(self) -> None:
        cache = self._prefix_cache
        if cache == "auto":
            graphs = self._runtime.graphs
            if getattr(graphs, "prefix_cache_owner", None) is None:
                logger.info("prefix caching off: %s's context programs start fresh sequences only (an export made "
                            "before continuing programs existed); export it again to turn it on", self.folder)
                self._runtime.set_prefix_cache(None)
                return
            budget = {} if self._prefix_cache_budget is None else {"budget_bytes": self._prefix_cache_budget}
            cache = PrefixCache(block_size=graphs.prefix_block_size, **budget)
        self._runtime.set_prefix_cache(cache)

    def can_generate(self) -> bool:
        return True

    def generate(self, input_ids, attention_mask=None, generation_config=None, stopping_criteria=None, streamer=None,
                 **kwargs):
        """transformers-style generation (optimum-neuron's `generate` signature): greedy or sampled (do_sample,
        temperature, top_k, top_p), EOS stopping, transformers `stopping_criteria` (called after every step with
        the ids and the step's logits; rows it flags finish), a streamer; returns [batch, prompt + new tokens].
        Batches larger than the compiled batch size run in waves. `token_type_ids` is accepted and ignored. A vision
        export also takes the processor's `pixel_values` and `image_grid_thw` (`mm_token_type_ids` is accepted:
        the image tokens are read from input_ids).

        `num_speculative_tokens=k` (0, the default: off) decodes speculatively with the checkpoint's own
        multi-token-prediction head, k drafts per round, on an export made with mtp=True: greedy, the same tokens as
        plain greedy decoding; sampled, the same distribution (the standard rejection rule). It takes no streamer,
        stopping_criteria, min_new_tokens or images (docs/speculative_decoding.md)."""
        return generate(self.runtime, self.generation_config, input_ids, attention_mask, generation_config, streamer,
                        stopping_criteria=stopping_criteria, **kwargs)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seq_ids) -> torch.Tensor:
        """Continuous batching: start each row's prompt in slot `seq_ids[row]`; next-token logits [n, vocab]."""
        return self.runtime.prefill(token_lists(input_ids, attention_mask), [int(s) for s in seq_ids])

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_ids) -> torch.Tensor:
        """Continuous batching: one token per slot in `seq_ids`, at `position_ids`; logits [n, vocab]."""
        tokens, positions = input_ids.reshape(-1).tolist(), position_ids.reshape(-1).tolist()
        return self.runtime.decode(tokens, positions, [int(s) for s in seq_ids])

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Two callers. optimum-neuron's runners (its vLLM worker) pass `seq_ids` (and `position_ids`,
        `sampling_params`): `serving_step` answers them as its NxD models do. Otherwise:

        Teacher-forced logits at every position, as transformers' `model(input_ids, attention_mask).logits`.

        Returns a transformers `CausalLMOutput`: `logits` [batch, length, vocab] fp32 (zeros where
        `attention_mask` is 0; left or right padding), and with `labels` the mean next-token cross-entropy `loss`
        (labels shifted inside, -100 ignored, as transformers does). Runs the per-position logits graphs of the
        export, in waves of the compiled batch size, each row fresh from position 0 (no cache is read); the
        slots it borrows get their state back, so sequences running through prefill()/decode() are not disturbed.
        Inputs longer than the compiled sequence length are refused."""
        if kwargs.get("seq_ids") is not None:
            if attention_mask is not None or labels is not None:
                raise UsageError("a call with seq_ids (optimum-neuron's runner call) takes no attention_mask or labels")
            return self.serving_step(input_ids, **kwargs)
        return causal_lm_forward(
            self.runtime.logits, self.config.vocab_size, input_ids, attention_mask, labels, return_dict, **kwargs
        )

    def serving_step(self, input_ids, position_ids=None, seq_ids=None, sampling_params=None) -> torch.Tensor:
        """optimum-neuron's runner call `model(input_ids, position_ids=, seq_ids=, sampling_params=)`, answered as
        its NxD models answer it (`NxDModelForCausalLM.forward`): a prefill when the call has more than one column
        and a row starts at position 0 (rows right-padded, each row's length its largest position + 1), otherwise
        one decode step per row at its position (a row at position 0 starts a fresh one-token sequence). Row i
        uses slot `seq_ids[i]`. Returns fp32 logits [rows, 1, vocab] (the export samples on the host:
        `on_device_sampling` is off, so `sampling_params` is not read)."""
        if input_ids is None or position_ids is None or input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise UsageError("the runner call needs input_ids and position_ids, both [rows, tokens]")
        if seq_ids.dim() != 1 or seq_ids.shape[0] != input_ids.shape[0]:
            raise UsageError(f"seq_ids must name one slot per row: {tuple(seq_ids.shape)} for {input_ids.shape[0]} rows")
        slots = [int(s) for s in seq_ids]
        if input_ids.shape[-1] > 1 and int(position_ids.min()) == 0:
            lengths = (position_ids.max(dim=1).values + 1).tolist()
            prompts = [row[:n].tolist() for row, n in zip(input_ids, lengths)]
            logits = self.runtime.prefill(prompts, slots)
        else:
            tokens, positions = input_ids[:, -1].tolist(), position_ids[:, -1].tolist()
            logits = torch.empty(len(slots), self.config.vocab_size)
            fresh = [i for i, p in enumerate(positions) if p == 0]
            going = [i for i, p in enumerate(positions) if p != 0]
            if fresh:
                logits[fresh] = self.runtime.prefill([[tokens[i]] for i in fresh], [slots[i] for i in fresh]).float()
            if going:
                logits[going] = self.runtime.decode(
                    [tokens[i] for i in going], [positions[i] for i in going], [slots[i] for i in going]
                ).float()
        return logits.float()[:, None, :]

    def reset(self) -> None:
        """Nothing to clear: a prefill replaces its slots' state whole."""

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (if any)."""
        if self._runtime is not None and hasattr(self._runtime, "close"):
            self._runtime.close()
        self._runtime = None
