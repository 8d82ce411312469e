"""Benchmark: what a trn2 user runs on TorchNeuron, this package's export against transformers 5's own Qwen3.5 under
`torch.compile`, through the same StableHLO check backend, on the same checkpoint and the same prompts.

    python benchmarks/torchneuron_vs_transformers.py            # 20 prompts of 17-2000 tokens, 64 new tokens each
    python benchmarks/torchneuron_vs_transformers.py --smoke    # 3 short prompts, 4 new tokens (what CI runs)
        [--prompts N] [--shortest 17] [--longest 2000] [--new-tokens 64] [--seed 0] [--layout tiny-nv3x]
        [--prefill-chunk 512] [--default-cache-prompts 1] [--sequence-length 2112]

Needs torch-mlir and transformers 5 (the `torchneuron` nox environment). Nothing here runs TorchNeuron or neuronx-cc
(not installable here): every graph goes through `optimum_qwen35.backends.torchneuron.stablehlo_check.CheckBackend`,
the `torch.compile` backend that follows TorchNeuron's documented pipeline (Dynamo, AOT Autograd, input mutations
as aliases, torch-mlir) down to the StableHLO neuronx-cc would receive, and runs the lowered ATen graph on the CPU
(docs/torchneuron.md). These are counts over that StableHLO, not device measurements; nothing is timed.

The sides (the same tiny random checkpoint, `optimum_qwen35.tiny`; the same greedy workload):

- `transformers, static cache`: transformers' `Qwen3_5ForCausalLM` as AWS's tutorial "Run a Hugging Face model for
  inference with torch.compile" (awsdocs-neuron, torch/tutorials/tutorial-hf-inference-torch-compile, 2026-10-15)
  describes it: `generate` compiles the forward pass when the model uses a static cache and a `CompileConfig`, and,
  with chunked prefill, runs the prompt through the compiled forward pass as well. So `generate(...,
  cache_implementation="static", compile_config=CompileConfig(backend=<check>, fullgraph=True, dynamic=False),
  prefill_chunk_size=--prefill-chunk)`, with `fullgraph=True` and `dynamic` off as "How to optimize a model with
  torch.compile" (torch/compile, 2026-10-14) asks ("Dynamic shapes are not supported"; "Use fullgraph=True so graph
  breaks are raised"). The tutorial's own chunk size was not readable here: 512 is this benchmark's choice.
  Dynamo's recompile limit (8 per code object) is raised for this side so that every graph it needs is compiled
  and counted: with the default limit, the 9th input signature of `forward` and all later ones run uncompiled.
- `transformers, default cache`: the model's forward wrapped as the how-to's functional form shows
  (`model.forward = torch.compile(model.forward, backend=<check>, fullgraph=True, dynamic=False)`), then plain
  `generate`: its cache grows every step, so every step is a new input signature. Run with Dynamo's defaults on the
  shortest --default-cache-prompts prompts only (it never stops compiling otherwise); the calls that ran uncompiled
  once Dynamo's recompile limit was hit are counted. Under `fullgraph=True`, torch 2.14 does not fall back: the
  call past the limit raises `FailOnRecompileLimitHit` ("Hard failure due to fullgraph=True") and `generate` fails;
  such prompts are counted ("generate failed") and their tokens are None.
- `ours`: a TorchNeuron export for trn2 made with the package's export code (`export/compile.py compile_graphs`
  with backend "torchneuron": the graph list `export_cpu` writes for a trn2 export, context buckets `default_buckets`
  of --sequence-length from 128, token-generation buckets `export_token_buckets`: those and their midpoints),
  loaded by `backends/torchneuron/runner.load_runtime` with the check backend in place of "neuron" on the CPU,
  generating through `Qwen35Runtime.generate`.

Per side: graphs compiled (Dynamo graphs handed to the backend), recompilations (Dynamo's "Recompiling function"
events: a compile of a code object that already had an entry; ours compiles each bucket's module once, which Dynamo
counts as a recompilation of the graph kind's `forward`), graph breaks (Dynamo's `graph_break` counter: 0 under
`fullgraph=True`, which raises instead), StableHLO ops (every op of the module, nested regions included) and bytes.

**Bytes read per decode step**, the same rule for both, over the StableHLO of each decode graph (one new token a row):
every argument of `@main` (weights, the state the graph holds: K/V cache, DeltaNet conv and recurrent states, and
the step's inputs) counts once, whole, if anything reads it whole; if its only readers take part of it (`slice`,
`dynamic_slice`, `gather`), the bytes those return; a write into it in place (operand 0 of `scatter` /
`dynamic_update_slice`) is not a read, the ops reading the updated buffer are; views (`reshape`, `transpose`,
`broadcast_in_dim`) read nothing themselves, their readers count; returning it (the aliased write-back) is not a
read. Intermediates and constants are not counted (on-chip or spilled: the compiler's choice, not the graph's). Per
side the average over every decode step the workload ran (each graph weighted by its calls) and the largest.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch._dynamo

VIEWS = {"stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim"}
PARTIAL_READS = {"stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.gather"}
IN_PLACE_WRITES = {"stablehlo.scatter", "stablehlo.dynamic_update_slice"}  # operand 0: the buffer written into
# torch's own defaults (torch/_dynamo/config.py), restored for the default-cache side whatever the process set before.
DYNAMO_DEFAULTS = dict(recompile_limit=8, accumulated_recompile_limit=256)
SIDES = ("transformers, static cache", "transformers, default cache", "ours")


# ------------------------------------------------------------------------------------------------ the StableHLO rule
def _nbytes(mlir_type) -> int:
    from torch_mlir import ir

    tensor = ir.RankedTensorType(mlir_type)
    element = tensor.element_type
    width = element.width if isinstance(element, (ir.IntegerType, ir.FloatType)) else 0
    return math.prod(tensor.shape) * max(1, width // 8)


def _read(value) -> int | None:
    """Bytes of `value` that its readers take: None for whole, else the sum of the partial reads (0: not read)."""
    partial = 0
    for use in value.uses:
        op = use.owner
        name = op.name
        if name == "func.return":
            continue
        if name in VIEWS or (name in IN_PLACE_WRITES and use.operand_number == 0):
            inner = _read(op.results[0])
            if inner is None:
                return None
            partial += inner
        elif name in PARTIAL_READS and use.operand_number == 0:
            partial += _nbytes(op.results[0].type)
        else:
            return None
    return partial


def graph_stats(stablehlo: str) -> dict:
    """{"ops": every op of the module, "args": [(bytes, bytes read)] per @main argument}."""
    from torch_mlir import ir

    from optimum_qwen35.backends.torchneuron.stablehlo_check import loaded_context

    with loaded_context():
        module = ir.Module.parse(stablehlo)
        ops = 0

        def walk(operation):
            nonlocal ops
            for region in operation.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        ops += 1
                        walk(inner.operation)

        walk(module.operation)
        main = next(op.operation for op in module.body.operations if op.operation.name == "func.func"
                    and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main")
        args = []
        for arg in main.regions[0].blocks[0].arguments:
            size = _nbytes(arg.type)
            read = _read(arg)
            args.append((size, size if read is None else min(read, size)))
    ops -= 1  # the func.func itself
    return {"ops": ops, "args": args}


# ------------------------------------------------------------------------------------------------ counting
def solve_unit_lower_triangular(A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    """`aten.linalg_solve_triangular` for the one form transformers' chunked delta rule calls (lower, unit diagonal,
    from the left), as transformers computes it for export targets without a triangular solver
    (modeling_qwen3_5.py, the `is_torchdynamo_exporting()` branch): the inverse by forward substitution, row by
    row, then a matmul. Upstream torch-mlir has no lowering of the op; TorchNeuron's is not documented."""
    assert not upper and left and unitriangular, "only the unit lower-triangular solve from the left"
    n = A.shape[-1]
    lower = -A.tril(-1)
    inverse = lower[..., :1, :]  # the rows done (written functionally: a decomposition may not mutate)
    for i in range(1, n):
        row = lower[..., i, :]
        row = row + (row[..., :i].unsqueeze(-1) * inverse).sum(-2)
        inverse = torch.cat([inverse, row.unsqueeze(-2)], dim=-2)
    return (inverse + torch.eye(n, dtype=A.dtype, device=A.device)) @ B


class CountedBackend:
    """The check backend, with every call of each lowered graph counted and each graph labelled by `label(gm)`."""

    def __init__(self, name: str, label=None, decompositions: dict | None = None):
        from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend

        self.check = CheckBackend(decompositions=decompositions, name=name)
        self.label = label or (lambda gm: "")
        self.labels: list[str] = []
        self.calls: list[int] = []

    def __deepcopy__(self, memo):  # generate deep-copies its GenerationConfig, compile_config and backend included
        return self

    def __call__(self, gm, example_inputs):
        compiled = self.check(gm, example_inputs)
        index = len(self.labels)
        assert len(self.check.graphs) == index + 1, "one lowered graph per Dynamo graph (inference)"
        self.labels.append(self.label(gm))
        self.calls.append(0)

        def run(*args):
            self.calls[index] += 1
            return compiled(*args)

        return run


class DynamoEvents(logging.Handler):
    """Dynamo's recompilation and recompile-limit log records, counted."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.recompiles = self.limit_hits = 0

    def emit(self, record):
        message = record.getMessage()
        self.recompiles += "Recompiling function" in message
        self.limit_hits += "recompile_limit" in message or "cache_size_limit" in message

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)  # its children's records (guards) propagate to it
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch._dynamo").removeHandler(self)
        torch._logging.set_logs()


def reset_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def input_ids_length(gm) -> int:
    """Tokens of the `input_ids` placeholder of a Dynamo graph of transformers' forward."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "input_ids" in node.name:
            return int(node.meta["example_value"].shape[-1])
    raise AssertionError(f"no input_ids among {[n.name for n in gm.graph.nodes if n.op == 'placeholder']}")


# ------------------------------------------------------------------------------------------------ the sides
def workload(n: int, shortest: int, longest: int, seed: int, vocab: int) -> list[list[int]]:
    """`n` prompts, lengths log-uniform in [shortest, longest] with both ends included, random ids; seeded."""
    rng = random.Random(seed)
    lengths = [shortest, longest][:n] + [round(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
                                         for _ in range(n - 2)]
    rng.shuffle(lengths)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def run_transformers(source: Path, prompts, new_tokens: int, eos: list[int], static: bool, prefill_chunk: int) -> dict:
    from transformers import AutoModelForCausalLM, CompileConfig

    reset_dynamo()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    backend = CountedBackend("transformers", label=lambda gm: "decode" if input_ids_length(gm) == 1
                             else f"prefill {input_ids_length(gm)}",
                             decompositions={torch.ops.aten.linalg_solve_triangular.default: solve_unit_lower_triangular})
    calls = 0
    if static:
        compile_config = CompileConfig(backend=backend, fullgraph=True, dynamic=False, mode=None)
        compile_config._compile_all_devices = True  # generate compiles on "neuron" devices; here on the CPU
        options = dict(cache_implementation="static", compile_config=compile_config, prefill_chunk_size=prefill_chunk)
        limits = dict(recompile_limit=4096, accumulated_recompile_limit=65536)
    else:
        options = {}
        compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)

        @functools.wraps(model.forward)  # counted outside the compiled frame (a counter inside it would be guarded on)
        def forward(*args, **kwargs):
            nonlocal calls
            calls += 1
            return compiled(*args, **kwargs)

        model.forward = forward
        limits = DYNAMO_DEFAULTS
    tokens, failed = [], 0
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False, **limits), DynamoEvents() as events, \
            torch.no_grad():
        for prompt in prompts:
            try:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, eos_token_id=eos, **options)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                if static:
                    raise
                failed += 1  # fullgraph=True: the call past the recompile limit raises instead of running eagerly
                tokens.append(None)
                continue
            tokens.append(out[0, len(prompt):].tolist())
            print(f"  {len(prompt)} tokens: {len(backend.labels)} graphs so far", file=sys.stderr, flush=True)
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    result = summarize(backend, events, breaks, tokens, uncompiled=calls - sum(backend.calls) if not static else 0,
                       known_before=0)
    return {**result, "generate_failed": failed}


def export_for_trn2(source: Path, out: Path, sequence_length: int) -> Path:
    """A TorchNeuron export of `source` for trn2 at TP 1, batch 1, fp32: what `export_cpu(..., backend="torchneuron")`
    writes (per-rank weights, configs, graphs.json), through its own steps (export_cpu itself takes optimum-neuron's
    NxDNeuronConfig, which this environment does not have)."""
    from optimum_qwen35.checkpoint.sharded_files import save_sharded
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.export import layout
    from optimum_qwen35.export.compile import compile_graphs
    from optimum_qwen35.export.cpu import SMALLEST_EXPORT_BUCKET, export_token_buckets
    from optimum_qwen35.export.writer import copy_side_files
    from optimum_qwen35.runtime.buckets import default_buckets
    from optimum_qwen35.runtime.prefix_cache import export_block_size

    config = Qwen35Config.from_pretrained(source)
    save_sharded(source, config, 1, out / layout.CHECKPOINT_DIR, torch.float32, progress=False)
    copy_side_files(source, out)
    compile_graphs(config, 1, 1, sequence_length, default_buckets(sequence_length, smallest=SMALLEST_EXPORT_BUCKET),
                   torch.float32, out / layout.COMPILED_DIR, progress=False,
                   prefix_block_size=export_block_size(sequence_length), backend=layout.TORCHNEURON_BACKEND,
                   token_buckets=export_token_buckets(sequence_length, layout.TORCHNEURON_BACKEND))
    return out


def run_ours(folder: Path, prompts, new_tokens: int, eos: list[int]) -> dict:
    from optimum_qwen35.backends.torchneuron.runner import load_runtime

    reset_dynamo()
    backend = CountedBackend("ours")
    runtime = load_runtime(folder, compile_backend=backend, device="cpu")
    try:
        with DynamoEvents() as events:
            tokens = [runtime.generate([prompt], new_tokens, eos_token_id=eos, min_new_tokens=new_tokens)[0]
                      for prompt in prompts]
        names = list(runtime.graphs._compiled)  # in the order of their first call: the order they were lowered
        assert len(names) == len(backend.labels), (names, backend.labels)
        backend.labels = ["decode" if n.startswith("token_generation") else n for n in names]
        known = len(runtime.graphs.manifest["graphs"])
    finally:
        runtime.close()
    from torch._dynamo.utils import counters

    return summarize(backend, events, sum(counters["graph_break"].values()), tokens, 0, known, names)


def summarize(backend: CountedBackend, events: DynamoEvents, breaks: int, tokens, uncompiled: int, known_before: int,
              names=None) -> dict:
    graphs = []
    for i, (graph, label, calls) in enumerate(zip(backend.check.graphs, backend.labels, backend.calls)):
        stats = graph_stats(graph.stablehlo)
        state = set(graph.aliases)
        read = sum(r for _, r in stats["args"])
        state_read = sum(r for k, (_, r) in enumerate(stats["args"]) if k in state)
        graphs.append(dict(name=names[i] if names else label, label=label, calls=calls, ops=stats["ops"],
                           read=read, state_read=state_read, args=sum(s for s, _ in stats["args"])))
    decode = [g for g in graphs if g["label"] == "decode"]
    steps = sum(g["calls"] for g in decode)
    return dict(
        graphs=graphs, compiled=len(graphs), dynamo_graphs=backend.check.dynamo_graphs, recompiles=events.recompiles,
        limit_hits=events.limit_hits, breaks=breaks, tokens=tokens, uncompiled=uncompiled, known_before=known_before,
        ops=sum(g["ops"] for g in graphs), decode_steps=steps,
        decode_mean=sum(g["read"] * g["calls"] for g in decode) / steps if steps else float("nan"),
        decode_max=max((g["read"] for g in decode if g["calls"]), default=float("nan")),
    )


# ------------------------------------------------------------------------------------------------ report
def failed_note(r: dict) -> str:
    n = r.get("generate_failed", 0)
    return f" (generate failed on {n} prompt(s): FailOnRecompileLimitHit under fullgraph=True)" if n else ""


def kib(n: float) -> str:
    return "-" if n != n else f"{n / 1024:,.1f}"


def report(results: dict, lengths: list[int], new_tokens: int, default_prompts: int) -> None:
    print(f"\nWorkload: {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens ({len(set(lengths))} distinct "
          f"lengths: {sorted(lengths)}), {new_tokens} new tokens each, greedy, batch 1, fp32; the default-cache row "
          f"ran the shortest {default_prompts} prompt(s) only.\n")
    print("| side | graphs compiled | known before the first prompt | recompilations | graph breaks | calls run "
          "uncompiled | StableHLO ops (all graphs) | decode steps | bytes read / decode step, mean (KiB) | max (KiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side, r in results.items():
        limit = f" (recompile limit hit {r['limit_hits']}x)" if r["limit_hits"] else ""
        print(f"| {side} | {r['compiled']} | {r['known_before']} | {r['recompiles']}{limit} | {r['breaks']} | "
              f"{r['uncompiled']}{failed_note(r)} | {r['ops']:,} | {r['decode_steps']} | {kib(r['decode_mean'])} | "
              f"{kib(r['decode_max'])} |")
    print("\nEvery graph (prefill: tokens per call; bytes read by the rule above, state = the aliased inputs):\n")
    print("| side | graph | calls | StableHLO ops | bytes read (KiB) | of it state (KiB) | @main arguments (KiB) |")
    print("|---|---|---|---|---|---|---|")
    for side, r in results.items():
        for g in sorted(r["graphs"], key=lambda g: (g["label"] == "decode", g["name"])):
            print(f"| {side} | {g['name']} | {g['calls']} | {g['ops']:,} | {kib(g['read'])} | {kib(g['state_read'])} | "
                  f"{kib(g['args'])} |")
    if "ours" not in results or SIDES[0] not in results:
        return
    ours, theirs = results["ours"], results[SIDES[0]]
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    print(f"\nGreedy tokens, ours vs transformers static cache: {same}/{len(lengths)} prompts identical")
    fixed = ours["compiled"] <= ours["known_before"] and ours["uncompiled"] == 0
    bytes_ok = ours["decode_mean"] <= theirs["decode_mean"] and ours["decode_max"] <= theirs["decode_max"]
    print(f"Verdict: fixed set of graphs: {'yes' if fixed else 'NO'} (ours compiled {ours['compiled']} of the "
          f"{ours['known_before']} its export lists before any prompt; transformers compiled {theirs['compiled']} for "
          f"{len(set(lengths))} prompt lengths); reads no more per decode step than transformers (static cache): "
          f"{'yes' if bytes_ok else 'NO'} (mean {kib(ours['decode_mean'])} vs {kib(theirs['decode_mean'])} KiB, max "
          f"{kib(ours['decode_max'])} vs {kib(theirs['decode_max'])} KiB)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="3 prompts of 17-90 tokens, 4 new tokens (CI)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--shortest", type=int, default=17)
    parser.add_argument("--longest", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="tiny-nv3x", help="optimum_qwen35.tiny layout of the checkpoint")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="transformers' prefill_chunk_size")
    parser.add_argument("--default-cache-prompts", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=None,
                        help="ours: the export's sequence_length (default: longest + new tokens, rounded up to 64)")
    parser.add_argument("--sides", nargs="+", choices=("static", "default", "ours"), default=["static", "default", "ours"],
                        help="run only these sides (e.g. one per process), with --save; --merge reports them together")
    parser.add_argument("--save", type=Path, help="write the results as JSON")
    parser.add_argument("--merge", type=Path, nargs="+", help="report the results of --save files instead of running")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.shortest, args.longest, args.new_tokens, args.default_cache_prompts = 3, 17, 90, 4, 1
    if args.merge:
        saved = [json.loads(path.read_text()) for path in args.merge]
        results = {side: r for s in saved for side, r in s["results"].items()}
        report({side: results[side] for side in SIDES if side in results}, **saved[0]["workload"])
        return
    torch.set_num_threads(1)
    from optimum_qwen35.tiny import build_tiny_checkpoint, tiny_text_config

    work = Path(tempfile.mkdtemp(prefix="tn-vs-tf-"))
    try:
        source = work / "tiny"
        build_tiny_checkpoint(source, args.layout)
        prompts = workload(args.prompts, args.shortest, args.longest, args.seed, tiny_text_config(args.layout)["vocab_size"])
        length = args.sequence_length or -(-(args.longest + args.new_tokens) // 64) * 64
        eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
        eos = eos if isinstance(eos, list) else [eos]  # min_new_tokens = max_new_tokens on both sides: never chosen
        results = {}
        print(f"checkpoint {args.layout}; ours: a trn2 export, sequence_length {length}", flush=True)
        if "static" in args.sides:
            results[SIDES[0]] = run_transformers(source, prompts, args.new_tokens, eos, True, args.prefill_chunk)
        if "default" in args.sides:
            shortest = sorted(prompts, key=len)[:args.default_cache_prompts]  # its graph count does not depend on length
            results[SIDES[1]] = run_transformers(source, shortest, args.new_tokens, eos, False, 0)
        if "ours" in args.sides:
            results[SIDES[2]] = run_ours(export_for_trn2(source, work / "export", length), prompts, args.new_tokens, eos)
        workload_info = dict(lengths=[len(p) for p in prompts], new_tokens=args.new_tokens,
                             default_prompts=args.default_cache_prompts)
        if args.save:
            args.save.write_text(json.dumps(dict(results=results, workload=workload_info)))
        report(results, **workload_info)
    finally:
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    sys.exit(main())
