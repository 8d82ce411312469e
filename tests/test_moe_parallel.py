"""Tensor and expert parallelism of the MoE models on CPU with real gloo collectives, against one process.

Attention and DeltaNet split by heads as for the dense models; the routed experts split by whole experts ("ep")
or inside every expert ("tp"), forced here both ways (`moe_parallel`; the "auto" rule is tested in test_moe.py).
Each run: every prompt position of context encoding and 32 greedy decode steps, fp32 within 1e-4 (and the same
top-1 and tokens) and fp64 within 1e-10 of TP = 1 (tests/test_tensor_parallel.py's checks). Decode with 2 rows
reaches both forms of the block: the gathered one where the routed pairs are fewer than a rank's experts, the
dense one elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from optimum_qwen35.checkpoint import CheckpointReader, convert_checkpoint
from optimum_qwen35.checkpoint.shard import MANIFEST, shard_tensor, unshard_tensor
from optimum_qwen35.checkpoint.sharded_files import read_manifest, save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import UsageError
from tests.kit.tp import run_tensor_parallel
from tests.kit import build_tiny_checkpoint

from .test_tensor_parallel import DTYPES, MAX_NEW_TOKENS, PROMPTS, check_against_reference

_REFS: dict[str, list] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-tp")
    return {layout: build_tiny_checkpoint(root / layout, layout, seed=3) for layout in ("tiny-moe", "tiny-moe-top1")}


def reference(path):
    if str(path) not in _REFS:
        _REFS[str(path)] = run_tensor_parallel(path, 1, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    return _REFS[str(path)]


# Each gloo launch runs fp32 and fp64: the 6 launches and the saved-export one took 709 s wall together on the shared
# 2 cores at load 17.
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, tp_degree, mode",
    [
        ("tiny-moe", 2, "ep"),  # 3 experts a rank
        ("tiny-moe", 4, "ep"),  # 6 experts on 4 ranks: 2 a rank, the last two zero experts never routed
        # ("tiny-moe", 2, "tp"): test_saved_moe_shards_keep_their_split runs it, from a saved export
        ("tiny-moe", 4, "tp"),  # 32 expert rows, 48 shared rows: 8 and 12 a rank
        ("tiny-moe-top1", 4, "ep"),  # top-1, one expert a rank
        ("tiny-moe-top1", 4, "tp"),  # 24 expert rows: 6 a rank
    ],
)
def test_moe_parallel_matches_single_process(checkpoints, layout, tp_degree, mode):
    path = checkpoints[layout]
    results = run_tensor_parallel(path, tp_degree, PROMPTS, MAX_NEW_TOKENS, DTYPES, moe_parallel=mode)
    check_against_reference(results, reference(path), f"{layout} TP={tp_degree} experts {mode}")


@pytest.mark.parametrize("mode", ["ep", "tp"])
@pytest.mark.parametrize("tp_degree", [2, 3, 4])
def test_expert_shards_round_trip(checkpoints, mode, tp_degree):
    """shard -> unshard is the identity for every MoE tensor (padding, the gate/up interleave), and each rank's
    shard has the block's per-rank shape. Degree 4 pads the 6 experts ("ep"), degree 3 the 32 expert rows ("tp";
    checked on a config whose heads allow degree 3)."""
    base = Qwen35Config.from_pretrained(checkpoints["tiny-moe"])
    config = dataclasses.replace(base, moe_parallel=mode, num_attention_heads=12, num_key_value_heads=3,
                                 linear_num_key_heads=12, linear_num_value_heads=24) if tp_degree == 3 else \
        dataclasses.replace(base, moe_parallel=mode)
    tensors = {n: t for n, t in convert_checkpoint(CheckpointReader(checkpoints["tiny-moe"]), base) if ".mlp." in n}
    from optimum_qwen35.modeling.moe import ExpertSharding

    s = ExpertSharding.from_config(config, tp_degree)
    for name, whole in tensors.items():
        shards = [shard_tensor(name, whole, config, tp_degree, r) for r in range(tp_degree)]
        assert torch.equal(unshard_tensor(name, shards, config), whole), name
        if name.endswith("experts.gate_up_proj"):
            assert shards[0].shape == (s.experts_per_rank, 2 * s.intermediate_per_rank, base.hidden_size)
            if mode == "tp":  # rank 1 holds rows I_r..2I_r - 1 of expert 0's gate, then of its up
                i, ir = base.moe_intermediate_size, s.intermediate_per_rank
                assert torch.equal(shards[1][0, :ir], whole[0, ir : 2 * ir])
                assert torch.equal(shards[1][0, ir:], whole[0, i + ir : i + 2 * ir])
        if name.endswith("experts.down_proj"):
            assert shards[0].shape == (s.experts_per_rank, base.hidden_size, s.intermediate_per_rank)


@pytest.mark.slow
def test_saved_moe_shards_keep_their_split(checkpoints, tmp_path):
    path = checkpoints["tiny-moe"]
    config = dataclasses.replace(Qwen35Config.from_pretrained(path), moe_parallel="tp")
    out = save_sharded(path, config, 2, tmp_path / "tp2", progress=False)
    assert read_manifest(out)["moe_parallel"] == "tp"
    assert load_file(out / "rank_0.safetensors")["layers.0.mlp.experts.gate_up_proj"].shape == (6, 32, 64)
    # The export runs with the split it was written with ("auto" would pick "ep" at this width).
    results = run_tensor_parallel(out, 2, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    check_against_reference(results, reference(path), "tiny-moe (saved shards, experts tp) TP=2")
    assert (out / MANIFEST).is_file()


def test_invalid_degrees_are_refused_before_any_process(checkpoints):
    with pytest.raises(UsageError, match="does not split this model by whole heads"):
        run_tensor_parallel(checkpoints["tiny-moe"], 3, PROMPTS, MAX_NEW_TOKENS)
    with pytest.raises(UsageError, match="moe_parallel='both'"):
        run_tensor_parallel(checkpoints["tiny-moe"], 2, PROMPTS, MAX_NEW_TOKENS, moe_parallel="both")
