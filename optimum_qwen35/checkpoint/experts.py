"""The two on-disk forms of Qwen3.5 MoE expert weights, read as one.

A `qwen3_5_moe` checkpoint holds each layer's routed experts either fused, as transformers 5 holds them in
memory (`mlp.experts.gate_up_proj` [E, 2I, H] with each expert's gate rows before its up rows, and
`mlp.experts.down_proj` [E, H, I]), or per expert, as `save_pretrained` writes them by default and the published
checkpoints ship them (`mlp.experts.N.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight`
[H, I]). transformers reads both (conversion_mapping.py: the qwen2_moe rules stack the experts, then concatenate
gate and up). `fuse_expert_names` gives the reader the fused names over a per-expert checkpoint, so that
everything after it (checks, conversion, sharding) sees one form.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from ..errors import CheckpointError

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_names(names: list[str]) -> dict[str, list[str]]:
    """{fused name: the per-expert names it stacks, in its row order} for every complete per-expert layer of
    `names`: `...experts.gate_up_proj` <- [gate 0, up 0, gate 1, up 1, ...] (concatenated per expert, then
    stacked), `...experts.down_proj` <- [down 0, down 1, ...]. A layer missing an expert's tensor, or numbering
    its experts other than 0..E-1, is left as it is (the checkpoint check then names what is missing)."""
    layers: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for name in names:
        m = _PER_EXPERT.match(name)
        if m:
            layers[m["layer"]][int(m["expert"])][m["proj"]] = name
    fused = {}
    for prefix, experts in layers.items():
        count = len(experts)
        if sorted(experts) != list(range(count)) or any(len(p) != 3 for p in experts.values()):
            continue
        fused[prefix + "gate_up_proj"] = [n for e in range(count) for n in (experts[e]["gate_proj"], experts[e]["up_proj"])]
        fused[prefix + "down_proj"] = [experts[e]["down_proj"] for e in range(count)]
    return fused


def missing_expert_tensors(names: list[str]) -> list[str]:
    """The per-expert tensors a partly stored layer lacks (experts numbered 0..max, each with its three)."""
    layers: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name in names:
        m = _PER_EXPERT.match(name)
        if m:
            layers[m["layer"]][int(m["expert"])].add(m["proj"])
    missing = []
    for prefix, experts in layers.items():
        for e in range(max(experts) + 1):
            missing += [f"{prefix}{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj") if p not in experts.get(e, ())]
    return missing


def fused_shape(name: str, part_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The fused tensor's shape from its parts' shapes (see `fuse_expert_names` for the order)."""
    if name.endswith("gate_up_proj"):
        (inter, hidden), experts = part_shapes[0], len(part_shapes) // 2
        return (experts, 2 * inter, hidden)
    return (len(part_shapes), *part_shapes[0])


def fuse(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack the per-expert tensors into the fused one (parts in `fuse_expert_names` order)."""
    if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
        raise CheckpointError(f"{name}: the per-expert tensors it stacks differ in shape or dtype")
    if name.endswith("gate_up_proj"):
        return torch.stack([torch.cat(parts[i : i + 2], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)
