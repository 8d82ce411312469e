"""Tensor parallelism on CPU: t gloo processes, each holding only its shard of the weights.

Every rank builds `Qwen35Decoder(config, t, TorchLayers(t, rank, group))` through `load_decoder` (from
a checkpoint folder, sharded on the fly, or from a `save_sharded` export) and runs the very graphs the
single-process runtime runs: context encoding, then greedy token generation. The row-parallel layers
and the embedding all-reduce, the lm_head all-gathers the vocabulary blocks, so every rank sees the
whole logits; rank 0's are returned.

    from tests.kit.tp import run_tensor_parallel
    result = run_tensor_parallel("path/to/checkpoint", tp_degree=4, prompts=[[1, 2, 3]], max_new_tokens=32)
    result.prefill_logits[0]   # [3, vocab]: teacher-forced logits of every prompt position
    result.decode_logits       # [31, n_prompts, vocab]: the logits of each decode step
    result.tokens              # [n_prompts, 32]: the greedy new tokens (1 from the prompt, 1 per decode step)

`max_new_tokens` means what it means in `Qwen35Runtime.generate`: the number of new tokens (here
always exactly that many: no EOS stop, so that runs compare step by step). `tp_degree=1` runs in the
calling process (no torch.distributed), which is the reference. Every argument is checked in the
calling process before any worker starts; a package error raised in a worker (e.g. NaN weights in its
shard) is raised again, with its own type, in the caller.
"""

from __future__ import annotations

import dataclasses

import os
import pickle
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from optimum_qwen35 import validation
from optimum_qwen35.errors import IncompatibleExportError, Qwen35Error, UsageError
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.buckets import default_buckets
from optimum_qwen35.runtime.eager import load_decoder


@dataclass
class TensorParallelResult:
    prefill_logits: list[torch.Tensor]  # one [len(prompt), vocab] tensor per prompt (fp32; fp64 for fp64 models)
    decode_logits: torch.Tensor  # [max_new_tokens - 1, n_prompts, vocab] (fp32; fp64 for fp64 models)
    tokens: torch.Tensor  # [n_prompts, max_new_tokens] int64, greedy: the new tokens


def _widen(logits: torch.Tensor) -> torch.Tensor:
    """Logits in fp32, or fp64 when the model runs in fp64."""
    return logits if logits.dtype == torch.float64 else logits.float()


def greedy_run(
    decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_length: int | None = None
) -> TensorParallelResult:
    """Prefill `prompts` (one slot each, every position's logits), then greedy steps up to `max_new_tokens`
    new tokens (the first comes from the prefill, so max_new_tokens - 1 decode steps)."""
    prompts = [list(p) for p in prompts]
    longest = max(len(p) for p in prompts)
    decode_steps = max_new_tokens - 1
    max_length = max_length or longest + max_new_tokens
    model = Qwen35Runtime.from_decoder(decoder, batch_size=len(prompts), max_length=max_length, buckets=default_buckets(max_length),
                              pack_weights=True)
    slots = list(range(len(prompts)))
    with torch.no_grad():
        all_logits = _widen(model.prefill(prompts, slots, all_logits=True))
        prefill_logits = [all_logits[i, : len(p)].clone() for i, p in enumerate(prompts)]
        tokens = [torch.stack([lg[-1] for lg in prefill_logits]).argmax(-1)]
        positions = [len(p) for p in prompts]
        decode_logits = []
        for _ in range(decode_steps):
            logits = _widen(model.decode(tokens[-1].tolist(), positions, slots))
            decode_logits.append(logits)
            tokens.append(logits.argmax(-1))
            positions = [p + 1 for p in positions]
    vocab = prefill_logits[0].shape[-1]
    return TensorParallelResult(
        prefill_logits=prefill_logits,
        decode_logits=torch.stack(decode_logits) if decode_logits else torch.empty(0, len(prompts), vocab),
        tokens=torch.stack(tokens, dim=1),
    )


@dataclass(frozen=True)
class Sampled:
    """One sampled speculative generate: k drafts, the `top` most likely tokens at `temperature` (top = 1: a point
    mass on the argmax), a generator seeded with `seed` (every rank seeds its own: they must draw the same numbers)."""

    k: int
    top: int
    temperature: float = 1.0
    seed: int = 0

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        values, index = logits.topk(self.top, -1)
        return torch.zeros_like(logits).scatter(-1, index, torch.softmax(values / self.temperature, -1))


@dataclass
class SpeculativeResult:
    tokens: dict[int, list[list[int]]]  # k -> the new tokens of each prompt (k = 0: plain greedy decoding)
    acceptance: dict[int, float]  # k -> mean tokens per verify round (k >= 1)
    head_logits: torch.Tensor  # [n_prompts, vocab]: the MTP head's logits at each prompt's last position (fp32/fp64)
    sampled: dict[Sampled, list[list[int]]] = dataclasses.field(default_factory=dict)  # each Sampled run's tokens
    sampled_acceptance: dict[Sampled, float] = dataclasses.field(default_factory=dict)
    # max |head logits of rank r - rank 0's| over the ranks: 0.0 when every rank gathered the same logits (TP 1: None)
    rank_spread: float | None = None


def speculative_run(decoder, prompts, max_new_tokens: int, ks: Sequence[int], max_length: int,
                    buckets: Sequence[int], sampled: Sequence[Sampled] = ()) -> SpeculativeResult:
    """Greedy generation of `prompts` (one batch) plain and with k drafts for each k in `ks`, then each `sampled`
    run, through `Qwen35Runtime.generate`; and the head's logits after prefill (what draft 1 of the first round is
    read from)."""
    from optimum_qwen35.runtime.speculative import _mtp_prefill  # noqa: PLC0415 (the runtime's own head prefill)

    prompts = [list(p) for p in prompts]
    model = Qwen35Runtime.from_decoder(decoder, batch_size=len(prompts), max_length=max_length, buckets=buckets)
    tokens, acceptance = {0: model.generate(prompts, max_new_tokens=max_new_tokens)}, {}
    for k in ks:
        tokens[k] = model.generate(prompts, max_new_tokens=max_new_tokens, num_speculative_tokens=k)
        acceptance[k] = model.speculation.acceptance_length
    sampled_tokens, sampled_acceptance = {}, {}
    for run in sampled:
        sampled_tokens[run] = model.generate(prompts, max_new_tokens=max_new_tokens, num_speculative_tokens=run.k,
                                             distribution=run.distribution,
                                             generator=torch.Generator().manual_seed(run.seed))
        sampled_acceptance[run] = model.speculation.acceptance_length
    slots = list(range(len(prompts)))
    with torch.no_grad():
        logits, hiddens = model.prefill(prompts, slots, hidden=True)
        first = [int(lg.argmax()) for lg in logits]
        head_logits, _ = _mtp_prefill(model, prompts, hiddens, first, slots)
    return SpeculativeResult(tokens, acceptance, _widen(head_logits), sampled_tokens, sampled_acceptance)


def _worker(rank, tp_degree, store_file, path, prompts, max_new_tokens, dtype, max_length, out_file, threads,
            moe_parallel="auto", speculative=None, weights_dtype=None):
    try:
        _run_rank(rank, tp_degree, store_file, path, prompts, max_new_tokens, dtype, max_length, out_file, threads,
                  moe_parallel, speculative, weights_dtype)
    except Qwen35Error as error:
        # Handed to the caller, which raises it with its own type (mp.spawn would wrap it in its own exception).
        with open(f"{out_file}.error-{rank}", "wb") as f:
            pickle.dump(error, f)
        raise


def _run_rank(rank, tp_degree, store_file, path, prompts, max_new_tokens, dtype, max_length, out_file, threads,
              moe_parallel="auto", speculative=None, weights_dtype=None):
    torch.set_num_threads(threads)
    # A file store, not a TCP store: with TCP, rank 0 hosts the store's server and could exit while another
    # rank's store client is still closing, which aborts that rank ("terminate called without an active
    # exception"). No port to pick either.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp_degree)
    try:
        group = dist.group.WORLD
        results = []
        for one_dtype in dtype:
            decoder = load_decoder(path, one_dtype, tp_degree, rank, TorchLayers(tp_degree, rank, group),
                                   _config(path, moe_parallel), mtp=speculative is not None, weights_dtype=weights_dtype)
            if speculative is not None:  # (ks, buckets, sampled): speculative_run, compared across ranks below
                ks, buckets, sampled = speculative
                result = speculative_run(decoder, prompts, max_new_tokens, ks, max_length, buckets, sampled)
                results.append(result)
                token_lists = [None] * tp_degree
                dist.all_gather_object(token_lists, (result.tokens, result.sampled), group=group)
                if any(t != token_lists[0] for t in token_lists):
                    raise RuntimeError("ranks disagree on the greedy or sampled tokens")
                # Each rank's host loop picks tokens from its own copy of the gathered logits: compared, not assumed.
                head_logits = [torch.empty_like(result.head_logits) for _ in range(tp_degree)]
                dist.all_gather(head_logits, result.head_logits.contiguous(), group=group)
                result.rank_spread = max((h - head_logits[0]).abs().max().item() for h in head_logits)
                del decoder
                continue
            result = greedy_run(decoder, prompts, max_new_tokens, max_length)
            del decoder
            # Every rank gathered the same logits, so every rank must have chosen the same tokens.
            tokens = [torch.empty_like(result.tokens) for _ in range(tp_degree)]
            dist.all_gather(tokens, result.tokens, group=group)
            if any(not torch.equal(t, tokens[0]) for t in tokens):
                raise RuntimeError("ranks disagree on the greedy tokens")
            results.append(result)
        if rank == 0:
            torch.save(results, out_file)
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


def _config(path, moe_parallel: str):
    """The folder's config, its MoE experts split as asked (a no-op for dense models)."""
    from optimum_qwen35.config import Qwen35Config  # noqa: PLC0415

    return dataclasses.replace(Qwen35Config.from_pretrained(path), moe_parallel=moe_parallel)


def run_tensor_parallel(
    path: str | os.PathLike,
    tp_degree: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    dtype: torch.dtype | str | Sequence[torch.dtype | str] = torch.float32,
    max_length: int | None = None,
    moe_parallel: str = "auto",
    weights_dtype: str | None = None,
    **renamed,
) -> TensorParallelResult | list[TensorParallelResult]:
    """Run prefill + greedy steps up to `max_new_tokens` new tokens with `tp_degree` gloo processes.

    Returns rank 0's logits and tokens. `path` is a checkpoint folder or a `save_sharded` export. `dtype`
    (a torch dtype or its name) may be a sequence of dtypes: the same processes then run once per dtype
    (process start-up dominates on small models) and a list of results is returned. Each process uses
    max(1, cpu_count // tp_degree) intra-op threads. Every argument (the degree against the model or the
    export, token ids against the vocabulary, sizes) is checked before any process starts. The processes
    are started with the `spawn` method, so a calling script needs the usual `if __name__ == "__main__":` guard.
    `moe_parallel` ("auto", "ep", "tp"): how a MoE model's ranks split the routed experts
    (`Qwen35Config.expert_parallel_mode`; a sharded export keeps the split it was written with).
    `weights_dtype="fp8"`: an FP8 checkpoint's weights kept as float8 on every rank (`load_decoder`).
    """
    from optimum_qwen35.checkpoint.sharded_files import is_sharded_export, read_manifest  # noqa: PLC0415
    from optimum_qwen35.config import Qwen35Config  # noqa: PLC0415

    if "decode_steps" in renamed:
        n = renamed["decode_steps"]
        raise UsageError(
            f"decode_steps was renamed max_new_tokens, the number of new tokens as in generate(): decode_steps={n} "
            f"returned {n} + 1 tokens; pass max_new_tokens={n + 1 if isinstance(n, int) else 'N + 1'} for the same run"
        )
    if renamed:
        raise UsageError(f"run_tensor_parallel got unexpected arguments {sorted(renamed)}")
    path = validation.model_folder(path, "run_tensor_parallel")
    config = dataclasses.replace(Qwen35Config.from_pretrained(path), moe_parallel=moe_parallel)
    config.check_tp_degree(tp_degree)
    if is_sharded_export(path):
        saved = read_manifest(path)["tp_degree"]
        if saved != tp_degree:
            raise IncompatibleExportError(
                f"{path} holds shards for tensor_parallel_size={saved}, not {tp_degree}; pass tp_degree={saved} or "
                f"export it again with --tensor-parallel-size {tp_degree}"
            )
    prompts = validation.token_ids(prompts, config.vocab_size)
    max_new_tokens = validation.positive_int(max_new_tokens, "max_new_tokens")
    single = not (isinstance(dtype, Sequence) and not isinstance(dtype, str))
    dtypes = [validation.parse_dtype(d) for d in ([dtype] if single else dtype)]
    if not dtypes:
        raise UsageError("dtype is an empty sequence: pass a dtype (e.g. torch.float32) or a list of them")
    needed = max(len(p) for p in prompts) + max_new_tokens
    if max_length is not None and validation.positive_int(max_length, "max_length") < needed:
        raise UsageError(
            f"max_length {max_length} is too short for the longest prompt + max_new_tokens ({needed}); raise it or omit it"
        )
    if tp_degree == 1:
        results = [greedy_run(load_decoder(path, d, config=config, weights_dtype=weights_dtype), prompts, max_new_tokens,
                              max_length) for d in dtypes]
        return results[0] if single else results
    threads = max(1, (os.cpu_count() or 1) // tp_degree)
    with tempfile.TemporaryDirectory(prefix="qwen35-tp-") as tmp:
        out_file, store_file = os.path.join(tmp, "rank0.pt"), os.path.join(tmp, "store")
        args = (tp_degree, store_file, os.fspath(path), prompts, max_new_tokens, dtypes, max_length, out_file, threads,
                moe_parallel, None, weights_dtype)
        try:
            mp.spawn(_worker, args=args, nprocs=tp_degree, join=True)
        except ProcessException:
            # A package error from a worker is raised again as itself; anything else is a bug: keep mp's report.
            for rank in range(tp_degree):
                if os.path.isfile(f"{out_file}.error-{rank}"):
                    with open(f"{out_file}.error-{rank}", "rb") as f:
                        raise pickle.load(f) from None
            raise
        results = torch.load(out_file, weights_only=False)
    return results[0] if single else results


def run_speculative_tensor_parallel(
    path: str | os.PathLike,
    tp_degree: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    ks: Sequence[int] = (1, 2, 3),
    dtype: Sequence[torch.dtype] = (torch.float32,),
    max_length: int = 128,
    buckets: Sequence[int] = (16, 32),
    sampled: Sequence[Sampled] = (),
) -> list[SpeculativeResult]:
    """`speculative_run` with the MTP head loaded (`load_decoder(..., mtp=True)`, sharded at tp_degree > 1), once per
    dtype in the same `tp_degree` gloo processes (tp_degree 1: in this process, the reference); rank 0's results.
    Every rank runs the host loop (SPMD); a rank whose greedy or sampled tokens differ from rank 0's fails the run."""
    from optimum_qwen35.config import Qwen35Config  # noqa: PLC0415 (as run_tensor_parallel)

    path = validation.model_folder(path, "run_speculative_tensor_parallel")
    Qwen35Config.from_pretrained(path).check_tp_degree(tp_degree)
    prompts, ks, buckets, sampled = [list(p) for p in prompts], list(ks), list(buckets), list(sampled)
    dtypes = [validation.parse_dtype(d) for d in dtype]
    if tp_degree == 1:
        return [speculative_run(load_decoder(path, d, mtp=True), prompts, max_new_tokens, ks, max_length, buckets,
                                sampled) for d in dtypes]
    threads = max(1, (os.cpu_count() or 1) // tp_degree)
    with tempfile.TemporaryDirectory(prefix="qwen35-tp-") as tmp:
        out_file, store_file = os.path.join(tmp, "rank0.pt"), os.path.join(tmp, "store")
        args = (tp_degree, store_file, os.fspath(path), prompts, max_new_tokens, dtypes, max_length, out_file, threads,
                "auto", (ks, buckets, sampled))
        mp.spawn(_worker, args=args, nprocs=tp_degree, join=True)
        return torch.load(out_file, weights_only=False)
