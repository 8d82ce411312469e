"""The Qwen3.5 MoE models without transformers: config parsing, both on-disk expert forms, the block's three forms.

Parity with transformers is in tests/test_moe_parity.py, tensor/expert parallelism in tests/test_moe_parallel.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum_qwen35 import Qwen35Config, UnsupportedModelError
from optimum_qwen35.checkpoint import CheckpointError, CheckpointReader, convert_checkpoint
from optimum_qwen35.errors import UsageError
from optimum_qwen35.modeling.moe import SparseMoeBlock, block_count, route, routed_blocks
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.modeling.vision import VisionConfig
from tests.kit import build_tiny_checkpoint

# Qwen3.5-35B-A3B's config.json as published (../shared/configs; the shape, see its `_comment`).
REAL_MOE_CONFIG = Path(__file__).parent / "qwen3.5-35b-a3b.config.json"


def real_moe_config() -> dict:
    return json.loads(REAL_MOE_CONFIG.read_text())


def test_real_moe_config_nested_and_bare():
    nested = Qwen35Config.from_dict(real_moe_config())
    bare = Qwen35Config.from_dict(real_moe_config()["text_config"])
    for c in (nested, bare):
        assert c.is_moe and c.num_experts == 256 and c.num_experts_per_tok == 8
        assert c.moe_intermediate_size == 512 and c.shared_expert_intermediate_size == 512
        assert c.intermediate_size == 0 and c.hidden_size == 2048 and c.num_hidden_layers == 40
        assert c.linear_num_value_heads == 32 and not c.tie_word_embeddings and c.rope_theta == 1e7
    assert dataclasses.replace(nested, raw={}) == dataclasses.replace(bare, raw={})
    text = nested.to_text_dict()
    assert text["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in text
    assert Qwen35Config.from_dict(text) == dataclasses.replace(nested, raw=text)
    # The MoE checkpoints carry the dense models' vision tower (the file omits num_position_embeddings).
    vision = VisionConfig.from_dict(real_moe_config())
    assert vision.depth == 27 and vision.out_hidden_size == 2048 and vision.num_position_embeddings == 2304


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["text_config"].update(mlp_only_layers=[0]), "mlp_only_layers=\\[0\\]"),
        (lambda c: c["text_config"].update(model_type="qwen3_5_text"), "expected 'qwen3_5_moe_text'"),
        (lambda c: c["text_config"].update(num_experts_per_tok=300), "num_experts_per_tok \\(300\\)"),
    ],
)
def test_bad_moe_configs_get_one_line(edit, message):
    cfg = real_moe_config()
    edit(cfg)
    with pytest.raises(UnsupportedModelError, match=message):
        Qwen35Config.from_dict(cfg)


def test_expert_parallel_rule_and_refusals():
    c = Qwen35Config.from_dict(real_moe_config())
    # Split inside experts while a rank keeps >= 128 of the 512 expert rows, whole experts beyond.
    assert [c.expert_parallel_mode(t) for t in (1, 2, 4, 8, 16)] == ["tp", "tp", "tp", "ep", "ep"]
    assert dataclasses.replace(c, moe_parallel="ep").expert_parallel_mode(2) == "ep"
    assert dataclasses.replace(c, moe_parallel="tp").expert_parallel_mode(16) == "tp"
    small = dataclasses.replace(c, num_experts=4, moe_parallel="ep")
    with pytest.raises(UsageError, match="leaves ranks without an expert"):
        small.check_tp_degree(8)
    with pytest.raises(UsageError, match="moe_parallel='both'"):
        dataclasses.replace(c, moe_parallel="both").expert_parallel_mode(2)
    with pytest.raises(UsageError, match="does not split this model by whole heads"):
        c.check_tp_degree(3)


def _converted(folder):
    reader = CheckpointReader(folder)
    return dict(convert_checkpoint(reader, Qwen35Config.from_pretrained(folder)))


def test_both_expert_forms_convert_to_the_same_tensors(tmp_path):
    per_expert = build_tiny_checkpoint(tmp_path / "per", "tiny-moe", expert_form="per_expert")
    fused = build_tiny_checkpoint(tmp_path / "fused", "tiny-moe", expert_form="fused")
    on_disk = json.loads((per_expert / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.5.up_proj.weight" in on_disk
    assert not any(k.endswith("gate_up_proj") for k in on_disk)
    a, b = _converted(per_expert), _converted(fused)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a["layers.1.mlp.experts.gate_up_proj"].shape == (6, 64, 64)
    assert a["layers.1.mlp.experts.down_proj"].shape == (6, 64, 32)
    # Gate rows first: expert 2's gate_proj is rows 0..31 of its fused block, up_proj rows 32..63.
    raw = load_file(next(per_expert.glob("model-00001-*.safetensors"))) | load_file(next(per_expert.glob("model-00002-*.safetensors")))
    p = "model.language_model.layers.1.mlp.experts.2."
    assert torch.equal(a["layers.1.mlp.experts.gate_up_proj"][2, :32], raw[p + "gate_proj.weight"])
    assert torch.equal(a["layers.1.mlp.experts.gate_up_proj"][2, 32:], raw[p + "up_proj.weight"])
    assert not any(n.startswith("mtp") for n in a)


def test_incomplete_per_expert_checkpoint_names_what_is_missing(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "m", "tiny-moe-top1", expert_form="per_expert")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.language_model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        _converted(folder)
    message = str(e.value)
    assert "per-expert tensors missing (1): layers.2.mlp.experts.3.up_proj.weight" in message
    assert "layers.2.mlp.experts.gate_up_proj" in message
    assert "layers.2.mlp.experts.3.gate_proj.weight" in message  # the stray per-expert keys, listed as unexpected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_three_forms_agree(dtype):
    """The looped form (eager), the gathered one (traced decode) and the dense one (traced prompts) on the same
    tokens, also with pairs of weight 0 (what expert parallelism leaves for another rank's experts)."""
    config = Qwen35Config.from_pretrained(build_tiny_checkpoint_config("tiny-moe"))
    torch.manual_seed(0)
    block = SparseMoeBlock(config, TorchLayers())
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    block.to(dtype)
    block.gate.weight.data = block.gate.weight.data.float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    x = torch.randn(2, 1, config.hidden_size).to(dtype)  # 2 tokens x top-2 < 6 experts: the gathered form if static
    looped, gathered = block(x), block(x, static=True)
    weights, ids = route(block.gate(x.reshape(-1, config.hidden_size)), config.num_experts_per_tok, dtype)
    dense = torch.zeros(2, config.num_experts, dtype=dtype).scatter(1, ids, weights)
    expected = block.experts.dense(x.reshape(2, -1), dense)
    expected = expected + torch.sigmoid(block.shared_expert_gate(x.reshape(2, -1)).float()) * block.shared_expert(x.reshape(2, -1)).float()
    for got in (looped, gathered):
        torch.testing.assert_close(got.reshape(2, -1), expected, atol=tol, rtol=tol)
        assert got.dtype == torch.float32
    # Experts alone, 5 tokens (more pairs than experts), one pair in three weighted 0 (skipped by the looped form).
    x = torch.randn(5, config.hidden_size).to(dtype)
    weights, ids = route(block.gate(x), config.num_experts_per_tok, dtype)
    weights = weights * (torch.arange(weights.numel()).view(weights.shape) % 3 != 0).to(dtype)
    dense = torch.zeros(5, config.num_experts, dtype=dtype).scatter(1, ids, weights)
    expected = block.experts.dense(x, dense)
    torch.testing.assert_close(block.experts.looped(x, weights, ids), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(block.experts.gathered(x, weights, ids), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 3, 128])
def test_routed_blocks_give_every_pair_its_own_row_in_its_experts_blocks(block_size):
    """The blocked layout (`routed_blocks`) on random, skewed (every token to experts 0 and 1) and partly foreign
    routings (id E_r: another rank's expert): each served pair its own row, in a block of its expert, that row
    reading its token; padding rows read token N; foreign pairs the extra row nb B; never more blocks than the bound."""
    torch.manual_seed(0)
    E, N, k = 6, 7, 2
    random = torch.stack([torch.randperm(E)[:k] for _ in range(N)]).to(torch.int32)
    skewed = torch.tensor([[0, 1]] * N, dtype=torch.int32)
    foreign = torch.where(torch.arange(N * k).view(N, k) % 3 == 0, torch.full_like(random, E), random)
    for ids in (random, skewed, foreign):
        token, block_expert, pair_row, nb = routed_blocks(ids, E, block_size)
        assert nb == block_count(N * k, E, block_size) and token.shape == (nb * block_size,)
        served = (ids < E).reshape(-1)
        rows = pair_row[served]
        assert len(set(rows.tolist())) == len(rows)  # no two pairs share a row: nothing dropped, nothing overwritten
        assert (pair_row[~served] == nb * block_size).all()
        pairs_token = torch.arange(N * k) // k
        assert (token[rows.long()] == pairs_token[served]).all()
        assert (block_expert[(rows // block_size).long()] == ids.reshape(-1)[served]).all()
        unused = torch.ones(nb * block_size, dtype=torch.bool)
        unused[rows.long()] = False
        assert (token[unused] == N).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_form_equals_the_dense_form(dtype):
    """The blocked prompt form (routed work only) gives the dense (all-experts) form's output, through the block on a
    prompt, and for the experts alone with pairs weighted 0; the block picks it only when it has fewer rows."""
    config = Qwen35Config.from_pretrained(build_tiny_checkpoint_config("tiny-moe"))
    torch.manual_seed(0)
    block = SparseMoeBlock(config, TorchLayers())
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    block.to(dtype)
    block.gate.weight.data = block.gate.weight.data.float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    x = torch.randn(1, 40, config.hidden_size).to(dtype)  # 80 pairs over 6 experts
    block.block_size = 4  # 80 / 4 + 6 blocks x 4 rows = 104 rows < 40 x 6 dense rows: the blocked form
    calls = []
    original = block.experts.blocks
    block.experts.blocks = lambda *a: calls.append(1) or original(*a)
    blocked = block(x, static=True)
    assert calls, "the blocked form was not used"
    block.block_size = 64  # 2 + 6 blocks x 64 rows > 240: the dense form
    calls.clear()
    dense = block(x, static=True)
    assert not calls
    torch.testing.assert_close(blocked, dense, atol=tol, rtol=tol)
    # Experts alone, one pair in three weighted 0 and served elsewhere (what expert parallelism leaves).
    flat = x.reshape(-1, config.hidden_size)
    weights, ids = route(block.gate(flat), config.num_experts_per_tok, dtype)
    weights = weights * (torch.arange(weights.numel()).view(weights.shape) % 3 != 0).to(dtype)
    dense_weights = torch.zeros(40, config.num_experts, dtype=dtype).scatter(1, ids, weights)
    block.block_size = 4
    got = block._blocked(flat, weights, ids.to(torch.int32), False, config.num_experts)
    torch.testing.assert_close(got, block.experts.dense(flat, dense_weights), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_give_the_same_outputs_and_state_dict(dtype):
    """`pack_linears` re-blocks every expert's matrices for oneDNN (the looped form runs them so): the same outputs,
    the same state_dict, and the static forms refused in one line."""
    from optimum_qwen35.modeling.parallel import can_pack
    from optimum_qwen35.modeling.torch_layers import pack_linears

    if not can_pack(dtype):
        pytest.skip(f"this CPU / torch build cannot pack {dtype}")
    config = Qwen35Config.from_pretrained(build_tiny_checkpoint_config("tiny-moe"))
    torch.manual_seed(0)
    block = SparseMoeBlock(config, TorchLayers())
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    block.to(dtype)
    block.gate.weight.data = block.gate.weight.data.float()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    x = torch.randn(5, 1, config.hidden_size).to(dtype)
    expected = block(x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # another GEMM kernel: another summation order
    assert pack_linears(block, 1) == 5  # the shared expert's 3 linears, its gate, the experts
    assert block.experts.packed_for == 1 and block.experts.gate_up_proj.numel() == 0  # no second copy
    torch.testing.assert_close(block(x), expected, atol=tol, rtol=tol)
    pack_linears(block, 4)  # re-packed for another batch size, from the packed weights
    torch.testing.assert_close(block(x), expected, atol=tol, rtol=tol)
    after = block.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(UsageError, match="packed for eager CPU inference"):
        block(x, static=True)


def test_routing_ties_and_renormalisation():
    # Equal logits: torch.topk's tie order (the lowest indices on CPU), weights renormalised to 1/k each.
    weights, ids = route(torch.zeros(3, 6), 2, torch.float32)
    assert ids.tolist() == torch.topk(torch.zeros(3, 6), 2).indices.tolist()
    assert torch.equal(weights, torch.full((3, 2), 0.5))
    # Float64 logits: softmax in fp32, as transformers' router (softmax(..., dtype=torch.float)).
    logits = torch.randn(4, 6, dtype=torch.float64)
    weights, _ = route(logits, 3, torch.float64)
    top = torch.topk(torch.softmax(logits.float(), -1), 3).values
    assert torch.equal(weights, (top / top.sum(-1, keepdim=True)).double())


def build_tiny_checkpoint_config(layout: str) -> Path:
    import tempfile

    from tests.kit import tiny_full_config

    folder = Path(tempfile.mkdtemp(prefix="qwen35-moe-config-"))
    (folder / "config.json").write_text(json.dumps(tiny_full_config(layout)))
    return folder


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.slow  # the torch.export of 3 programs: 4.5 min wall on the shared 2 cores at load 17 (8 users)
def test_compiled_cpu_graphs_run_the_moe(tmp_path, layout="tiny-moe"):
    """The cpu target's `torch.export` programs (context encoding, token generation) hold the MoE block (static
    shapes: the dense form in prefill, the gathered form in decode) and give transformers' recorded greedy tokens."""
    import numpy as np

    from optimum_qwen35.checkpoint.sharded_files import save_sharded
    from optimum_qwen35.export import layout as export_layout
    from optimum_qwen35.export.compile import compile_graphs
    from optimum_qwen35.runtime import Qwen35Runtime

    source = FIXTURES / layout
    config = Qwen35Config.from_pretrained(source)
    save_sharded(source, config, 1, tmp_path / export_layout.CHECKPOINT_DIR, progress=False)
    compile_graphs(config, 1, 1, 64, [64], torch.float32, tmp_path / export_layout.COMPILED_DIR, progress=False)
    model = Qwen35Runtime.from_export(tmp_path)
    try:
        with np.load(source / "reference.npz") as ref:
            prompt, expected = ref["gen_prompt_1"].tolist(), ref["gen_tokens_1"].tolist()
        assert model.generate([prompt], max_new_tokens=24) == [expected[:24]]
    finally:
        model.close()


def test_the_cpu_benchmarks_roofline_counts_the_decoders_weights():
    """benchmarks/moe_cpu_decode.py's bytes per decode step (its roofline) against the parameters of the decoder it
    measures, built on the meta device: each part's weights, the k chosen experts' share of the routed ones."""
    import sys

    from optimum_qwen35.modeling.decoder import Qwen35Decoder

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from moe_cpu_decode import step_bytes, text_config
    finally:
        sys.path.pop(0)
    text = text_config("LF", 32000)
    config = Qwen35Config.from_dict(text)
    with torch.device("meta"):
        params = dict(Qwen35Decoder(config, 1, TorchLayers(1)).named_parameters())

    def size(*parts, skip=("norm.weight", "A_log", "dt_bias")):
        return sum(4 * p.numel() for n, p in params.items() if any(s in n for s in parts) and not n.endswith(skip))

    got = step_bytes(text, torch.float32, batch=1, positions=0)
    assert got["experts"] == size(".experts.") * config.num_experts_per_tok / config.num_experts
    assert got["shared expert + router"] == size(".shared_expert", ".mlp.gate.")
    assert got["attention / DeltaNet"] == size(".self_attn.", ".linear_attn.")
    assert got["lm_head"] == size("lm_head")
    assert got["states"] > 0
