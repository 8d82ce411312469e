"""The export's Neuron graphs at every real Qwen3.5 size and natural TP degree: lowered HLO, per-rank memory, traffic.

    .nox/neuron/bin/python benchmarks/neuron_real_shapes.py --quick   # 0.8B, TP 1 and 2, 256 tokens (~2 min)
    .nox/neuron/bin/python benchmarks/neuron_real_shapes.py           # the table in docs/neuron_backend.md
    .nox/neuron/bin/python benchmarks/neuron_real_shapes.py --contract --logits --only 27B:8:1:4096
        # one configuration, each graph also checked by the compiler contract (hlo_contract.violations)
    .nox/neuron/bin/python benchmarks/neuron_real_shapes.py --contract --moe 4:4:1:4096
        # Qwen3.5-35B-A3B's graphs with its first 4 layers (3 DeltaNet + 1 attention), real widths, contract-checked

The graphs are built exactly as the export builds them (`get_neuron_config` -> `create_graph_builders` -> the
builders' model instances -> `load_module` / `get`, under neuronx-distributed's ahead-of-time parallel state,
rank 0's SPMD graph: every rank's graph has the same shapes) but **shape-only**: the modules are built on torch's
`meta` device and every parameter and buffer is replaced by a torch-xla placeholder (`create_placeholder_tensor`: a
device tensor with a shape and no buffer), so the HLO has the same parameters as with weights, and the 27B at TP 8
with a 32k KV cache lowers in about 1 GiB of host memory. Nothing is compiled for Neuron and nothing runs: no
neuronx-cc, no device (see docs/neuron_backend.md).

For each configuration it prints, per graph, the HLO instruction count (the whole module), the census of result
shapes by rank and element type, and the collectives in the HLO with their result bytes; and per rank: the weights,
the KV cache, the DeltaNet states (from the modules' own parameter shapes), the HBM bytes a step moves
(`step_traffic`) and which instances hold it. `--projection` adds the latency projection for the 2B on
trn2.3xlarge (labelled as one: the hardware figures are `TRN2`, `ALLREDUCE_US`, `BUS_GBS`, their sources beside
them and in `HARDWARE_SOURCES`) and the recommended TP degree per size and instance.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import resource
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import optimum.neuron  # noqa: E402,F401  (sets the compilation target, which neuronx-distributed reads on import)
import torch  # noqa: E402
import torch_xla  # noqa: E402

from optimum_qwen35.modeling.attention import QUERY_BLOCK  # noqa: E402
from optimum_qwen35.backends.nxd import hlo_contract  # noqa: E402
from optimum_qwen35.backends.nxd.tracing import (  # noqa: E402
    CONTEXT,
    LOGITS,
    TOKENS,
    export_config,
    model_class,
    neuron_config,
    traced_parallel_state,
)

ROOT = Path(__file__).resolve().parent.parent
REAL_CONFIG = ROOT / "tests" / "qwen3.5-0.8b.config.json"  # a real config.json (the 0.8B's), as shipped
GIB, MIB = 2**30, 2**20

# The text decoder per size (docs: ANCHORS section 1's table). The 0.8B is its real config file; the others change
# the table's fields in it. Assumed, not from a config file: every size keeps the 0.8B's 3:1 layer pattern (every
# 4th layer full attention, `full_attention_interval` 4), head_dim 256, DeltaNet head dims 128/128, conv kernel 4,
# vocab 248320; the 9B's `tie_word_embeddings` (unconfirmed: taken as untied, the larger memory).
SIZES = {
    "0.8B": {},
    "2B": {"hidden_size": 2048, "intermediate_size": 6144},
    "4B": {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
           "intermediate_size": 9216, "linear_num_value_heads": 32},
    "9B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
           "intermediate_size": 12288, "linear_num_value_heads": 32, "tie_word_embeddings": False},
    "27B": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
            "intermediate_size": 17408, "linear_num_value_heads": 48, "tie_word_embeddings": False},
}
# The natural TP degrees of the issue (27B at TP 16 is not a valid degree: 24 attention heads do not split by 16).
GRID = {"0.8B": (1,), "2B": (1, 2, 4), "4B": (4, 8), "9B": (4, 8), "27B": (8, 16)}
SEQUENCES, BATCHES, TARGETS = (4096, 32768), (1, 8), ("trn2", "trn1")

# Instances: Neuron cores a TP rank runs on and the HBM each has. trn2 runs at LNC 2 (optimum-neuron's default,
# `logical_nc_config` 2): a logical core is 2 physical NeuronCore-v3 and a quarter of the chip's 96 GiB.
INSTANCES = {  # name: (target, cores per instance, HBM GiB per core, HBM GB/s per core)
    "trn2.3xlarge": ("trn2", 4, 96 / 4, 2900 / 4),
    "trn2.48xlarge": ("trn2", 64, 96 / 4, 2900 / 4),
    "trn1.32xlarge": ("trn1", 32, 32 / 2, 820 / 2),
    "inf2.48xlarge": ("trn1", 24, 32 / 2, 820 / 2),
}
HARDWARE_SOURCES = {
    "trn2": "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium2_arch.html (8 NeuronCore-v3, "
            "96 GiB HBM, 2.9 TB/s; the v2.29 source of the same guide says 3 TB/s); "
            "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/training/best-practices.html (trn2.48xlarge: 16 "
            "chips, LNC 2 = 4 logical cores per chip, ~24 GiB per rank)",
    "trn1": "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html "
            "(2 NeuronCore-v2, 32 GiB, 820 GiB/s per chip; trn1.32xlarge 16 chips)",
    "inf2": "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/inferentia2.html "
            "(2 NeuronCore-v2, 32 GiB, 820 GiB/s per chip; up to 12 chips: inf2.48xlarge)",
}


def config_dict(size: str) -> dict:
    config = json.loads(REAL_CONFIG.read_text())
    text = config["text_config"]
    text.update(SIZES[size])
    if "tie_word_embeddings" in SIZES[size]:
        config["tie_word_embeddings"] = text["tie_word_embeddings"]
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return config


def config_folder(size: str, root: Path) -> Path:
    (root / "config.json").write_text(json.dumps(config_dict(size)))
    return root


# ------------------------------------------------------------------------------------------------ shape-only graphs
@dataclass
class ShapeGraph:
    key: str
    module: torch.nn.Module  # on the XLA device, every tensor a placeholder
    example_inputs: tuple
    alias_names: dict[str, int] = field(default_factory=dict)  # for testing.neuron_xla.lower / state_traffic


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch_xla
    from torch_xla.core.xla_builder import create_placeholder_tensor, mkshape

    if dtype == torch.float8_e4m3fn:  # torch-xla 2.8's dtype map lacks float8; XLA's own type name has it
        return torch_xla._XLAC._xla_create_placeholder_tensor(mkshape("f8e4m3fn", shape).shape)
    return create_placeholder_tensor(shape, dtype)


def _placeholders(module: torch.nn.Module) -> None:
    """Every parameter and buffer (on `meta`) becomes an XLA placeholder of its shape and dtype."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(_placeholder(tuple(p.shape), p.dtype), requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = _placeholder(tuple(b.shape), b.dtype)


def build_modules(folder: Path, nc, keys=(CONTEXT, TOKENS), placeholders: bool = True,
                  fp8_weights: bool = False, fp8_lm_head: bool = False) -> dict[str, ShapeGraph]:
    """The export's graph modules (rank 0) built on `meta`; with `placeholders`, moved to XLA as placeholders;
    `fp8_weights`: an export with FP8 weights (the weights Qwen's FP8 releases quantize, backends/nxd/fp8.py);
    `fp8_lm_head`: and its lm_head (untied)."""
    from optimum_qwen35.backends.nxd.fp8 import rule_weight_names
    from optimum_qwen35.checkpoint.quantize import untied
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.export.layout import FP8_EXPORT_KEY

    cls = model_class()
    config = export_config(folder, nc)
    if fp8_weights:  # (a config folder, no weights to read: the names by Qwen's rule)
        qwen_config = Qwen35Config.from_pretrained(folder)
        if fp8_lm_head:
            qwen_config = Qwen35Config.from_dict(untied(qwen_config.raw))
            config.tie_word_embeddings = False
        setattr(config, FP8_EXPORT_KEY, {"weights": rule_weight_names(qwen_config, fp8_lm_head)})
    with torch.device("meta"):
        builders = cls.create_graph_builders(config, nc)
    graphs = {}
    for key in keys:
        with torch.device("meta"):
            instance = builders[key].get_model_instance()
            instance.load_module()
            module, aliases = instance.get(0)
        names = {id(p): n for n, p in module.named_parameters()}
        alias_names = {names[id(p)]: output for p, output in aliases.items()}
        if placeholders:
            _placeholders(module)
        graphs[key] = ShapeGraph(key, module, builders[key].input_generator()[0], alias_names)
    return graphs


def lower_text(graph: ShapeGraph) -> str:
    """The graph's HLO module as text (torch-xla's lowering of its outputs; nothing executes)."""
    return lower_graph(graph)[0]


def lower_graph(graph: ShapeGraph, proto: bool = False) -> tuple[str, dict | None]:
    """One run of the graph's module: its HLO text, and with `proto` also the HloModuleProto as JSON (what
    `hlo_contract` reads) of the same outputs."""
    device = torch_xla.device()
    outputs = list(graph.module(*(t.to(device) for t in graph.example_inputs)))
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    hlo = None
    if proto:  # the same pending IR lowered again, as `neuron_xla.lower` does
        context = torch_xla._XLAC.lowering.LoweringContext("qwen35")
        context.build(outputs)
        hlo = json.loads(context.hlo_json())
    torch_xla._XLAC._clear_pending_irs(str(device))
    return text, hlo


# ------------------------------------------------------------------------------------------------ HLO text census
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s8": 1, "u8": 1, "pred": 1}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], s32[]) tuple(...)' / 'f32[2]{0} add(...)' -> (shape text, opcode)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                break
        shape, tail = rest[: i + 1], rest[i + 1 :]
    else:
        shape, _, tail = rest.partition(" ")
    return shape, tail.strip().split("(", 1)[0].strip()


@dataclass
class Census:
    instructions: int
    ranks: Counter  # rank -> result arrays of that rank (tuple elements counted one by one)
    dtypes: Counter  # element type -> result arrays
    opcodes: Counter
    collectives: list  # (opcode, dtype, result bytes) in program order
    parameter_bytes: int  # the entry computation's parameters

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    def collective_summary(self) -> str:
        if not self.collectives:
            return "none"
        groups = Counter((op, dt, b) for op, dt, b in self.collectives)
        return ", ".join(f"{n} {op} {dt} {fmt_bytes(b)}" for (op, dt, b), n in sorted(groups.items()))

    @property
    def collective_bytes(self) -> int:
        return sum(b for *_, b in self.collectives)


# On the HLO text, not hlo_contract's proto dicts: 27B x 32768 peaks at 3.97 GiB so, 5.70 GiB with the proto (--contract,
# which checks this census's max rank / f64 / s64 equal to `hlo_contract.dtype_census` and runs its `violations`).
def census(hlo: str) -> Census:
    """Instruction count, rank and element-type census of the result shapes, collectives (with result bytes) and
    the entry parameters' bytes of an HLO module's text."""
    ranks, dtypes, opcodes, collectives, parameter_bytes, count = Counter(), Counter(), Counter(), [], 0, 0
    entry = False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            entry = True
        elif line.startswith("}"):
            entry = False
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        count += 1
        shape, opcode = _split_shape(m.group(1))
        opcodes[opcode] += 1
        arrays = _ARRAY.findall(shape)
        for dtype, dims in arrays:
            ranks[len(dims.split(",")) if dims else 0] += 1
            dtypes[dtype] += 1
        nbytes = sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dt] for dt, dims in arrays)
        if entry and opcode == "parameter":
            parameter_bytes += nbytes
        base = opcode.removesuffix("-start")
        if base in COLLECTIVES:
            # The first array: torch-xla's all-reduce returns (result, token) tuples.
            dt, dims = arrays[0]
            collectives.append((base, dt, math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dt]))
    return Census(count, ranks, dtypes, opcodes, collectives, parameter_bytes)


# ------------------------------------------------------------------------------------------------ per-rank sizes
@dataclass
class RankShapes:
    """Per-rank bytes of one configuration, from the modules' own parameter and state shapes (no lowering)."""

    size: str
    tp: int
    batch: int
    sequence: int
    weights: int  # every weight (the untied lm_head copy of a tied embedding included)
    embedding: int
    kv: int  # K/V of the attention layers, all slots
    deltanet: int  # conv + recurrent states, all slots
    hidden: int
    vocab_padded_per_rank: int
    layers: int
    attention_layers: int
    kv_heads_per_rank: int
    head_dim: int
    matmul_params: int  # per rank, the weights a token multiplies (all but the embedding table)
    attention_heads_per_rank: int
    value_heads_per_rank: int
    key_dim: int
    value_dim: int

    @property
    def state(self) -> int:
        return self.kv + self.deltanet

    @property
    def total(self) -> int:
        return self.weights + self.state


def rank_shapes(size: str, tp: int, batch: int, sequence: int, graphs: dict[str, ShapeGraph] | None = None,
                dtype=torch.bfloat16) -> RankShapes:
    """Built on `meta` when no graphs are given (seconds, no memory)."""
    if graphs is None:
        return _meta_rank_shapes(size, tp, batch, sequence, dtype)
    module = graphs[TOKENS].module
    layout = module.state_layout
    params = dict(module.named_parameters())
    weights = {n: p for n, p in params.items() if not n.startswith("past_key_values.") and not n.endswith("master_weight")}
    nbytes = {n: p.numel() * p.element_size() for n, p in weights.items()}
    held = layout.held_specs
    spec_bytes = [math.prod(s.shape) * s.dtype.itemsize for s in held]
    kv = sum(b for j, b in enumerate(spec_bytes) if layout.is_kv(j))
    config, dims = module.config, module.dims
    embedding = nbytes["embed_tokens.weight"]  # the table (its rank tensor, 4 bytes, counts with the weights)
    lm_head = next(p for n, p in weights.items() if n.startswith("lm_head.") and n.endswith("weight"))
    kv_spec = held[0]
    recurrent = next(s for s in held if "recurrent" in s.name)
    return RankShapes(
        size, tp, batch, sequence, sum(nbytes.values()), embedding, kv, sum(spec_bytes) - kv, config.hidden_size,
        lm_head.shape[0], config.num_hidden_layers, len(config.attention_layers), kv_spec.shape[1], kv_spec.shape[-1],
        sum(p.numel() for n, p in weights.items() if not n.startswith("embed_tokens.")), dims.num_heads,
        recurrent.shape[1], recurrent.shape[2], recurrent.shape[3],
    )


@functools.lru_cache(maxsize=None)
def _meta_rank_shapes(size: str, tp: int, batch: int, sequence: int, dtype) -> RankShapes:
    with tempfile.TemporaryDirectory() as tmp:
        folder = config_folder(size, Path(tmp))
        nc = neuron_config(folder, "trn2", tp, dtype, batch, sequence)
        with traced_parallel_state(tp, nc.logical_nc_config):
            return rank_shapes(size, tp, batch, sequence, build_modules(folder, nc, keys=(TOKENS,), placeholders=False))


def step_traffic(s: RankShapes, graph: str, dtype_bytes: int = 2) -> dict[str, int]:
    """HBM bytes one call of a graph moves per rank, a lower bound: every matmul weight read once, the embedding rows
    of the call's tokens, and the held state as `testing.neuron_xla.state_traffic` counts it from the HLO (checked
    against it in tests/neuron_xla/test_real_shapes.py): token generation reads each row's whole K/V (and the
    position it writes once more) and DeltaNet states, and writes one K/V position and the DeltaNet states; context encoding (one row, T = sequence) writes the
    row's K/V and DeltaNet states and reads the K/V twice and the DeltaNet states once. Activations are left out."""
    slot_kv, slot_dn = s.kv // s.batch, s.deltanet // s.batch
    matmul = s.weights - s.embedding
    if graph == TOKENS:
        kv_write = s.batch * s.attention_layers * 2 * s.kv_heads_per_rank * s.head_dim * dtype_bytes
        return {"weights": matmul + s.batch * s.hidden * dtype_bytes, "state_read": s.kv + kv_write + s.deltanet,
                "state_write": kv_write + s.deltanet}
    rows = s.sequence
    return {"weights": matmul + rows * s.hidden * dtype_bytes, "state_read": 2 * slot_kv + slot_dn,
            "state_write": slot_kv + slot_dn}


def collectives_per_step(s: RankShapes, graph: str) -> list[tuple[str, str, int]]:
    """The collectives a graph's HLO holds (checked against the lowered HLO): one all-reduce per row-parallel
    layer call (in the model dtype, bf16 here: `NxDLayers.row_linear`'s reduce_dtype) -- each DeltaNet mixer's and MLP's output
    projection, and each attention layer's o_proj once per query block of `QUERY_BLOCK` tokens (context encoding
    attends block by block, o_proj included) -- one for the vocabulary-split embedding (model dtype), and the
    lm_head's fp32 logits gathered along the vocabulary (the last token of the one row in context encoding, one
    token per row in token generation). None at TP 1 (neuronx-distributed's layers skip them)."""
    if s.tp == 1:
        return []
    rows = s.batch if graph == TOKENS else 1
    tokens = rows * (1 if graph == TOKENS else s.sequence)
    length = 1 if graph == TOKENS else s.sequence
    blocks = [min(QUERY_BLOCK, length - start) for start in range(0, length, QUERY_BLOCK)]
    out = [("all-reduce", "bf16", tokens * s.hidden * 2)]
    out += [("all-reduce", "bf16", tokens * s.hidden * 2)] * (2 * s.layers - s.attention_layers)
    out += [("all-reduce", "bf16", rows * block * s.hidden * 2) for block in blocks] * s.attention_layers
    out += [("all-gather", "f32", rows * s.vocab_padded_per_rank * s.tp * 4)]
    return out


def fits(s: RankShapes) -> dict[str, str]:
    """Per instance: whether a rank's weights + held state fit one core's HBM (activations, the compiler's scratch
    and the runtime's own memory not counted), and the share used."""
    out = {}
    for name, (target, cores, gib, _) in INSTANCES.items():
        if s.tp > cores:
            out[name] = "no (too few cores)"
            continue
        share = s.total / (gib * GIB)
        out[name] = f"{'yes' if share <= 1 else 'no'} ({share:.0%})"
    return out


def fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------------------------------ running
@dataclass
class Lowered:
    size: str
    tp: int
    batch: int
    sequence: int
    target: str
    graph: str
    census: Census
    seconds: float
    contract: dict | None = None  # with --contract: hlo_contract.dtype_census of the graph's proto
    violations: list | None = None  # with --contract: hlo_contract.violations (empty: the contract holds)


def reference_census() -> set[str]:
    """The compiler contract's reference: optimum-neuron 0.4.5's own Qwen3, Llama and Qwen3-MoE graphs, as its test
    builds it (`lowering.reference_hlos`)."""
    from optimum_qwen35.backends.nxd.lowering import REFERENCE_MODELS, reference_hlos

    hlos = []
    for kind in REFERENCE_MODELS:
        for tp in (1, 2):
            for dtype in (torch.float32, torch.bfloat16):
                hlos += list(reference_hlos(kind, "trn2", tp, dtype).values())
    return hlo_contract.reference_census(hlos)


def lower_configuration(size: str, tp: int, batch: int, sequence: int, target: str = "trn2",
                        keys=(CONTEXT, TOKENS), dtype=torch.bfloat16,
                        reference: set[str] | None = None) -> tuple[RankShapes, list[Lowered]]:
    """With `reference` (a contract census), each graph is also checked by `hlo_contract` on its proto."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = config_folder(size, Path(tmp))
        nc = neuron_config(folder, target, tp, dtype, batch, sequence)
        with traced_parallel_state(tp, nc.logical_nc_config):
            graphs = build_modules(folder, nc, keys=tuple(dict.fromkeys((TOKENS, *keys))))
            shapes = rank_shapes(size, tp, batch, sequence, graphs)
            out = []
            for key in keys:
                start = time.perf_counter()
                text, hlo = lower_graph(graphs[key], proto=reference is not None)
                c = census(text)
                low = Lowered(size, tp, batch, sequence, target, key, c, time.perf_counter() - start)
                del text
                if hlo is not None:
                    low.contract = hlo_contract.dtype_census(hlo)
                    low.violations = hlo_contract.violations(hlo, reference)
                    del hlo
                    # The text census and the contract's count the same arrays.
                    assert low.contract == {"max_rank": c.max_rank, "f64": c.dtypes.get("f64", 0),
                                            "s64": c.dtypes.get("s64", 0)}, (low.contract, c.dtypes)
                out.append(low)
    return shapes, out


MOE_CONFIG = ROOT / "tests" / "qwen3.5-35b-a3b.config.json"  # Qwen3.5-35B-A3B's published config.json


def lower_moe(layers: int, tp: int, batch: int, sequence: int, reference: set[str] | None,
              target: str = "trn2", dtype=torch.bfloat16) -> list[tuple[str, int, dict | None, list | None]]:
    """The 35B-A3B's context-encoding and token-generation graphs at its real widths (256 experts, top 8, hidden
    2048) with its first `layers` layers, shape-only, lowered; with `reference`, each checked by the compiler
    contract. Returns (graph, HLO instructions, dtype census, violations) per graph."""
    config = json.loads(MOE_CONFIG.read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        nc = neuron_config(tmp, target, tp, dtype, batch, sequence)
        with traced_parallel_state(tp, nc.logical_nc_config):
            graphs = build_modules(Path(tmp), nc)
            for key in (CONTEXT, TOKENS):
                start = time.perf_counter()
                text_hlo, hlo = lower_graph(graphs[key], proto=reference is not None)
                c = census(text_hlo)
                found = None if hlo is None else hlo_contract.violations(hlo, reference)
                contract = None if hlo is None else hlo_contract.dtype_census(hlo)
                print(f"lowered 35B-A3B ({layers} layers) TP {tp} batch {batch} {sequence} {target} {key}: "
                      f"{c.instructions:,} instructions in {time.perf_counter() - start:.0f} s, max rank {c.max_rank}, "
                      f"{c.collective_summary()}"
                      + ("" if found is None else f"; contract {contract}: "
                         + (f"{len(found)} violations: {found[:20]}" if found else "holds")), flush=True)
                out.append((key, c.instructions, contract, found))
    return out


def check_against_hlo(shapes: RankShapes, lowered: Lowered) -> None:
    """The computed collectives equal the lowered graph's; the entry parameters hold the weights and the state."""
    expected = sorted(collectives_per_step(shapes, lowered.graph))
    if lowered.graph == LOGITS:
        return
    assert sorted(lowered.census.collectives) == expected, (lowered.graph, lowered.census.collective_summary())
    assert lowered.census.parameter_bytes >= shapes.weights + shapes.state, (lowered.census.parameter_bytes, shapes)


QUICK = [("0.8B", 1, 2, 256), ("0.8B", 2, 2, 256)]
# What the full run lowers (the rest of the grid is computed by `rank_shapes` / `step_traffic` /
# `collectives_per_step`, which the lowered ones check): every size and degree at batch 8, 4096 tokens; the 2B at
# TP 4 and the 27B at TP 8 also at batch 1 and at 32768 tokens; the 2B at TP 2 also for trn1.
LOWERED = ([(size, tp, 8, 4096, "trn2") for size, tps in GRID.items() for tp in tps if not (size == "27B" and tp == 16)]
           + [("2B", 4, 1, 4096, "trn2"), ("27B", 8, 1, 4096, "trn2"), ("2B", 4, 8, 32768, "trn2"),
              ("27B", 8, 8, 32768, "trn2"), ("2B", 2, 8, 4096, "trn1")])


def lowered_table(rows: list[tuple[RankShapes, Lowered]]) -> list[str]:
    lines = ["| size | TP | batch | tokens | target | graph | HLO instructions | max rank | ranks (count) | "
             "dtypes (count) | collectives in the graph | lowered in |", "|" + "---|" * 12]
    for shapes, low in rows:
        c = low.census
        rank_text = " ".join(f"{r}:{n}" for r, n in sorted(c.ranks.items()))
        dtype_text = " ".join(f"{d}:{n}" for d, n in sorted(c.dtypes.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {low.size} | {low.tp} | {low.batch} | {low.sequence} | {low.target} | {low.graph} | "
                     f"{c.instructions:,} | {c.max_rank} | {rank_text} | {dtype_text} | {c.collective_summary()} | "
                     f"{low.seconds:.0f} s |")
    return lines


def memory_table(configs) -> list[str]:
    lines = ["| size | TP | batch | tokens | weights / rank | KV / rank | DeltaNet / rank | decode step: HBM bytes / rank "
             "| decode: collectives (bytes) | prefill: HBM bytes / rank | prefill: collectives (bytes) | "
             + " | ".join(INSTANCES) + " |", "|" + "---|" * (11 + len(INSTANCES))]
    for s in configs:
        t, p = step_traffic(s, TOKENS), step_traffic(s, CONTEXT)
        ct, cp = collectives_per_step(s, TOKENS), collectives_per_step(s, CONTEXT)
        f = fits(s)
        lines.append(
            f"| {s.size} | {s.tp} | {s.batch} | {s.sequence} | {fmt_bytes(s.weights)} | {fmt_bytes(s.kv)} | "
            f"{fmt_bytes(s.deltanet)} | {fmt_bytes(sum(t.values()))} | {len(ct)} ({fmt_bytes(sum(b for *_, b in ct)) if ct else '-'}) | "
            f"{fmt_bytes(sum(p.values()))} | {len(cp)} ({fmt_bytes(sum(b for *_, b in cp)) if cp else '-'}) | "
            + " | ".join(f[name] for name in INSTANCES) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ the projection
# Hardware figures for the projection (trn2, LNC 2). Each a (low, high) range; sources in the docs' section.
TRN2 = {
    "hbm_gbs_per_core": (2900 / 4, 3000 / 4),  # chip 2.9 TB/s (arch guide), 3 TB/s (v2.29 NKI guide); 4 logical cores
    "bf16_tflops_per_core": (2 * 79, 667 / 4),  # NeuronCore-v3 79 TFLOPS x 2 physical; chip 667 / 4 logical
}
# Latency of one small all-reduce between the logical cores of one chip: AWS publishes no figure we could find
# (nccom-test's guide prints a 2-rank 32 MB all-reduce, 768 us = 40.7 GB/s bus bandwidth, its only number). The
# range is bounded from above by NxDI's own measurement: 4.0 ms/token for the 2B at TP 8 on trn2.48xlarge, whose
# 49 all-reduces per step cannot take more than (4.0 ms - its weight streaming) / 49 = ~68 us each.
ALLREDUCE_US = (10.0, 68.0)
BUS_GBS = (40.7, 200.0)  # bus bandwidth of an all-reduce: nccom-test's printed figure .. an assumed intra-chip upper
SEED = {"ttft_ms": 157.8, "tok_s_b1": 114.5, "tok_s_b8": 409.5}  # seed contrib, trn2.3xlarge TP 4, seq 128
NXDI = {"ms_per_token": 4.0}  # NxDI contrib (later version), trn2.48xlarge TP 8, seq 512


def decode_ms(s: RankShapes, bound: int) -> float:
    """Projected ms per decode step: HBM time of the step's bytes (bandwidth-bound: the roofline's compute side is
    below it at these batches) + each collective's latency and bytes. bound 0: the optimistic end, 1: pessimistic."""
    hbm = sum(step_traffic(s, TOKENS).values()) / (TRN2["hbm_gbs_per_core"][1 - bound] * 1e9)
    flops = 2 * s.matmul_params * s.batch / (TRN2["bf16_tflops_per_core"][1 - bound] * 1e12)
    colls = collectives_per_step(s, TOKENS) if s.tp > 1 else []
    comm = sum(ALLREDUCE_US[bound] * 1e-6 + 2 * b * (s.tp - 1) / s.tp / (BUS_GBS[1 - bound] * 1e9) for *_, b in colls)
    return 1e3 * (max(hbm, flops) + comm)


def prefill_flops(s: RankShapes, tokens: int) -> float:
    """Per rank: the matmuls of every token (lm_head only for the last), causal attention, the chunked delta rule
    (chunk 64: per chunk the C x C intra-chunk products and the state products, about 4 C dk dv + 2 C^2 (dk + dv))."""
    lm = s.vocab_padded_per_rank * s.hidden
    dense = 2 * (s.matmul_params - lm) * tokens + 2 * lm
    attention = s.attention_layers * 2 * 2 * (tokens * tokens / 2) * s.attention_heads_per_rank * s.head_dim
    chunks = math.ceil(tokens / 64)
    deltanet = (s.layers - s.attention_layers) * s.value_heads_per_rank * chunks * (
        4 * 64 * s.key_dim * s.value_dim * 2 + 2 * 64 * 64 * (s.key_dim + s.value_dim) * 2)
    return dense + attention + deltanet


def prefill_ms(s: RankShapes, tokens: int, bound: int) -> float:
    """Projected TTFT of one prompt (context encoding, one row): compute at peak TensorE rate or weight streaming,
    whichever is longer, + the collectives of `tokens` rows."""
    compute = prefill_flops(s, tokens) / (TRN2["bf16_tflops_per_core"][1 - bound] * 1e12)
    hbm = (s.weights - s.embedding) / (TRN2["hbm_gbs_per_core"][1 - bound] * 1e9)
    colls = collectives_per_step(RankShapes(**{**s.__dict__, "sequence": tokens}), CONTEXT) if s.tp > 1 else []
    comm = sum(ALLREDUCE_US[bound] * 1e-6 + 2 * b * (s.tp - 1) / s.tp / (BUS_GBS[1 - bound] * 1e9) for *_, b in colls)
    return 1e3 * (max(compute, hbm) + comm)


def projection() -> list[str]:
    lines = ["Projection (not a measurement): Qwen3.5-2B bf16 on trn2.3xlarge (one chip, LNC 2: 4 logical cores). Each "
             "cell a range: optimistic .. pessimistic ends of the hardware figures.",
             "| TP | batch | weights+state / rank (4096) | decode ms/token, cache 128 | decode ms/token, cache 4096 | "
             "tok/s per sequence (4096) | tok/s per chip, 4/TP replicas (4096) | TTFT 128 tokens | TTFT 4096 tokens |",
             "|" + "---|" * 9]
    for batch in (1, 8):
        for tp in (1, 2, 4):
            short, s = rank_shapes("2B", tp, batch, 128), rank_shapes("2B", tp, batch, 4096)
            lo, hi = decode_ms(s, 0), decode_ms(s, 1)
            replicas = 4 // tp
            lines.append(
                f"| {tp} | {batch} | {fmt_bytes(s.total)} | {decode_ms(short, 0):.2f} - {decode_ms(short, 1):.2f} | "
                f"{lo:.2f} - {hi:.2f} | {1e3 / hi:.0f} - {1e3 / lo:.0f} | "
                f"{replicas * batch * 1e3 / hi:.0f} - {replicas * batch * 1e3 / lo:.0f} | "
                f"{prefill_ms(s, 128, 0):.1f} - {prefill_ms(s, 128, 1):.1f} ms | "
                f"{prefill_ms(s, 4096, 0):.0f} - {prefill_ms(s, 4096, 1):.0f} ms |")
    s1 = rank_shapes("2B", 1, 1, 128)
    matmul = s1.weights - s1.embedding
    limit = matmul / (TRN2["hbm_gbs_per_core"][1] * 4e9) * 1e3, matmul / (TRN2["hbm_gbs_per_core"][0] * 4e9) * 1e3
    lines.append(f"Physical limit, batch 1, the whole chip's HBM bandwidth (2.9-3.0 TB/s) over the "
                 f"{fmt_bytes(matmul)} of matmul weights a token reads: {limit[0]:.2f}-{limit[1]:.2f} ms/token "
                 f"({1e3 / limit[1]:.0f}-{1e3 / limit[0]:.0f} tok/s). Measured, not by this project: the seed "
                 f"(trn2.3xlarge TP 4, seq 128) {SEED['ttft_ms']} ms TTFT, {SEED['tok_s_b1']} tok/s batch 1 "
                 f"({1e3 / SEED['tok_s_b1']:.2f} ms/token), {SEED['tok_s_b8']} tok/s batch 8; NxDI's later version "
                 f"(trn2.48xlarge TP 8, seq 512) {NXDI['ms_per_token']} ms/token.")
    return lines


def recommend(sequence: int = 32768, batch: int = 8, headroom: float = 0.8) -> list[str]:
    """Per size and instance: the smallest valid TP degree whose rank holds weights + state for `batch` sequences of
    `sequence` tokens within `headroom` of a core's HBM (the rest left to activations, scratch and the runtime: an
    assumption), and on trn2 the degree the decode projection finds fastest at batch 1 (4096-token cache), at its
    optimistic / pessimistic end."""
    from optimum_qwen35.config import Qwen35Config

    lines = [f"| size | valid TP | smallest TP within {headroom:.0%} of a core's HBM ({batch} x {sequence} tokens): "
             + " / ".join(INSTANCES) + " | fastest batch-1 decode, trn2.3xlarge (TP <= 4) | fastest batch-1 decode, "
             "trn2.48xlarge |", "|---|---|---|---|---|"]
    for size in SIZES:
        valid = Qwen35Config.from_dict(config_dict(size)).valid_tp_degrees()
        cells = []
        for name, (target, cores, gib, _) in INSTANCES.items():
            fit = next((t for t in valid if t <= cores and rank_shapes(size, t, batch, sequence).total <= headroom * gib * GIB), None)
            cells.append(f"TP {fit}" if fit else "none")
        timings = []
        for cores in (4, 64):
            degrees = [t for t in valid if t <= cores]
            best = [min(degrees, key=lambda t: decode_ms(rank_shapes(size, t, 1, 4096), bound)) for bound in (0, 1)]
            timings.append(" / ".join(f"TP {t} ({decode_ms(rank_shapes(size, t, 1, 4096), b):.2f} ms)"
                                      for b, t in enumerate(best)))
        lines.append(f"| {size} | {', '.join(map(str, valid))} | {' / '.join(cells)} | {timings[0]} | {timings[1]} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.8B at TP 1 and 2, batch 2, 256 tokens (lowered)")
    parser.add_argument("--no-lower", action="store_true", help="the computed table only")
    parser.add_argument("--projection", action="store_true", help="also the 2B latency projection on trn2.3xlarge")
    parser.add_argument("--only", action="append", metavar="SIZE:TP:BATCH:TOKENS[:TARGET]",
                        help="lower only these configurations (repeatable), e.g. --only 27B:8:1:4096")
    parser.add_argument("--logits", action="store_true", help="with --only: also the per-position logits graph")
    parser.add_argument("--contract", action="store_true",
                        help="also check every lowered graph with the compiler contract (hlo_contract.violations)")
    parser.add_argument("--moe", action="append", metavar="LAYERS:TP:BATCH:TOKENS",
                        help="lower Qwen3.5-35B-A3B's graphs with its first LAYERS layers (repeatable), e.g. "
                        "--moe 4:4:1:4096; with --contract each graph is checked; nothing else is lowered")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.moe:
        reference = reference_census() if args.contract else None
        for spec in args.moe:
            parts = spec.split(":")
            if len(parts) != 4 or not all(p.isdigit() for p in parts):
                parser.error(f"--moe {spec}: expected LAYERS:TP:BATCH:TOKENS, e.g. 4:4:1:4096")
            lower_moe(*map(int, parts), reference=reference)
        print(f"peak RSS {rss_gib():.2f} GiB")
        return
    rows = []
    plan = [(*q, "trn2") for q in QUICK] if args.quick else ([] if args.no_lower else LOWERED)
    if args.only:
        plan = []
        for spec in args.only:
            parts = spec.split(":")
            if len(parts) not in (4, 5) or parts[0] not in SIZES:
                parser.error(f"--only {spec}: expected SIZE:TP:BATCH:TOKENS[:TARGET], SIZE one of {', '.join(SIZES)}")
            plan.append((parts[0], *map(int, parts[1:4]), parts[4] if len(parts) == 5 else "trn2"))
    reference = None
    if args.contract:
        start = time.perf_counter()
        reference = reference_census()
        print(f"contract reference census: {len(reference)} opcodes and forms in {time.perf_counter() - start:.0f} s",
              flush=True)
    for size, tp, batch, sequence, target in plan:
        logits = args.logits if args.only else (args.quick or (size, tp, batch, sequence) == ("2B", 4, 8, 4096))
        keys = (CONTEXT, TOKENS, LOGITS) if logits else (CONTEXT, TOKENS)
        shapes, lowered = lower_configuration(size, tp, batch, sequence, target, keys, reference=reference)
        for low in lowered:
            check_against_hlo(shapes, low)
            rows.append((shapes, low))
        print(f"lowered {size} TP {tp} batch {batch} {sequence} {target}: "
              + ", ".join(f"{low.graph} {low.census.instructions:,} in {low.seconds:.0f} s" for low in lowered)
              + f"; peak RSS {rss_gib():.2f} GiB", flush=True)
        for low in lowered:
            if low.violations is not None:
                print(f"  contract {low.graph}: {low.contract}, "
                      + (f"{len(low.violations)} violations: {low.violations[:20]}" if low.violations else "holds"),
                      flush=True)
    if rows:
        print("\n".join(lowered_table(rows)))
    configs = ([rank_shapes(size, tp, b, seq) for size, tp, b, seq in QUICK] if args.quick else
               [rank_shapes(size, tp, b, seq) for size, tps in GRID.items() for tp in tps if not (size == "27B" and tp == 16)
                for seq in SEQUENCES for b in BATCHES])
    print("\n".join(memory_table(configs)))
    if args.projection:
        print("\n".join(projection()))
        print("\n".join(recommend()))
        print("\n".join(f"{chip}: {source}" for chip, source in HARDWARE_SOURCES.items()))
    print(f"peak RSS {rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
