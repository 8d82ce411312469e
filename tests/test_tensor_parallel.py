"""Tensor parallelism on CPU with real gloo collectives: TP = 2 and 4 against TP = 1.

Each check launches t processes (torch.multiprocessing spawn), each holding only its shard, and compares
rank 0's gathered logits with the single-process model: every prompt position of context encoding and 32
greedy decode steps (33 new tokens: the first comes from context encoding). Each launch runs fp32 (the requirement: within 1e-4, same top-1) and fp64 (which
shows the sharded model computes exactly the same function: differences are pure rounding, ~1e-13).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimum_qwen35.checkpoint import CheckpointReader
from optimum_qwen35.checkpoint.shard import MANIFEST, convert_and_shard, rank_file
from optimum_qwen35.checkpoint.sharded_files import save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.runtime.eager import load_decoder
from tests.kit.tp import run_tensor_parallel
from tests.kit import build_tiny_checkpoint

PROMPTS = [[5, 17, 300, 42, 7, 99, 12, 250, 3, 77, 401], [3, 200, 41, 8, 64]]
MAX_NEW_TOKENS = 33  # 32 decode steps after the token context encoding gives
DTYPES = (torch.float32, torch.float64)
FP32_ATOL, FP32_RTOL = 1e-4, 0.0  # the bound, absolute
FP64_ATOL = 1e-10
MAX_DIFFS: dict[str, float] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    paths = {layout: build_tiny_checkpoint(root / layout, layout, seed=3) for layout in ("tiny-2b", "tiny-nv2x")}
    paths["odd-nv3x"] = odd_sized_nv3x(root / "odd-nv3x")
    return paths


def odd_sized_nv3x(path):
    """tiny-nv3x (untied, nv = 3 nk) with a vocabulary (509) and intermediate size (189) that need padding."""
    build_tiny_checkpoint(path, "tiny-nv3x", seed=5)
    vocab, inter = 509, 189
    tensors = load_file(path / "model.safetensors")
    for key in list(tensors):
        if key.endswith(("embed_tokens.weight", "lm_head.weight")) and not key.startswith("mtp."):
            tensors[key] = tensors[key][:vocab].clone()
        elif "language_model" in key and key.endswith(("gate_proj.weight", "up_proj.weight")):
            tensors[key] = tensors[key][:inter].clone()
        elif "language_model" in key and key.endswith("down_proj.weight"):
            tensors[key] = tensors[key][:, :inter].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(vocab_size=vocab, intermediate_size=inter)
    (path / "config.json").write_text(json.dumps(config))
    return path


_REFERENCES: dict[str, list] = {}


def reference(path):
    key = str(path)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_tensor_parallel(path, 1, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    return _REFERENCES[key]


def assert_same_run(got, ref, atol, rtol, label):
    for p, (a, b) in enumerate(zip(got.prefill_logits, ref.prefill_logits)):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{label} prompt {p} context encoding: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{label} prompt {p}: context-encoding top-1 differs"
    assert got.decode_logits.shape == (MAX_NEW_TOKENS - 1, len(PROMPTS), ref.decode_logits.shape[-1])
    torch.testing.assert_close(got.decode_logits, ref.decode_logits, atol=atol, rtol=rtol, msg=lambda m: f"{label} decode: {m}")
    assert torch.equal(got.decode_logits.argmax(-1), ref.decode_logits.argmax(-1)), f"{label}: decode top-1 differs"
    assert torch.equal(got.tokens, ref.tokens), f"{label}: greedy tokens differ"
    diff = max(
        max((a - b).abs().max().item() for a, b in zip(got.prefill_logits, ref.prefill_logits)),
        (got.decode_logits - ref.decode_logits).abs().max().item(),
    )
    MAX_DIFFS[label] = diff
    print(f"{label}: max |logit difference| {diff:.3g}")


def check_against_reference(results, refs, label):
    fp32, fp64 = results
    ref32, ref64 = refs
    assert fp32.decode_logits.dtype == torch.float32 and fp64.decode_logits.dtype == torch.float64
    assert_same_run(fp32, ref32, FP32_ATOL, FP32_RTOL, f"{label} fp32")
    assert_same_run(fp64, ref64, FP64_ATOL, 0.0, f"{label} fp64")


@pytest.mark.parametrize("tp_degree", [2, 4])
@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-nv2x"])
def test_tensor_parallel_matches_single_process(checkpoints, layout, tp_degree):
    path = checkpoints[layout]
    refs = reference(path)
    assert refs[0].tokens.shape == (len(PROMPTS), MAX_NEW_TOKENS)
    results = run_tensor_parallel(path, tp_degree, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    check_against_reference(results, refs, f"{layout} TP={tp_degree}")


def test_saved_shards_round_trip(checkpoints, tmp_path):
    """Padded vocab/intermediate, untied lm_head, nv = 3 nk: save per-rank files, then run from them alone."""
    path = checkpoints["odd-nv3x"]
    config = Qwen35Config.from_pretrained(path)
    assert config.vocab_size % 2 and config.intermediate_size % 2 and not config.tie_word_embeddings
    reader = CheckpointReader(path)
    exports = {}
    for t in (1, 2, 4):
        out = save_sharded(path, None, t, tmp_path / f"tp{t}", progress=False)
        exports[t] = out
        assert (out / MANIFEST).is_file() and (out / "config.json").is_file()
        assert not list(out.glob(".*tmp*")), "temporary files left behind"
        for r in range(t):
            saved = load_file(out / rank_file(r))
            direct = dict(convert_and_shard(reader, config, t, r))
            assert saved.keys() == direct.keys()
            for name in direct:
                assert torch.equal(saved[name], direct[name]), (t, r, name)
    # TP = 1 from the export, in process: identical weights, identical logits.
    whole = load_decoder(path).state_dict()
    exported = load_decoder(exports[1]).state_dict()
    assert whole.keys() == exported.keys() and all(torch.equal(whole[k], exported[k]) for k in whole)
    # TP = 2 from the export, with gloo, against TP = 1 from the original checkpoint.
    results = run_tensor_parallel(exports[2], 2, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    check_against_reference(results, reference(path), "odd-nv3x (saved shards) TP=2")
    # An export for one degree is refused for another.
    with pytest.raises(ValueError, match="tensor_parallel_size=2, not 4"):
        load_decoder(exports[2], tp_degree=4, layers=None)


def test_max_new_tokens_means_what_generate_means(checkpoints):
    """run_tensor_parallel(max_new_tokens=N) returns the N tokens generate(max_new_tokens=N) returns (no EOS)."""
    from optimum_qwen35.runtime import Qwen35Runtime  # noqa: PLC0415

    path = checkpoints["tiny-2b"]
    ref = reference(path)[0]
    model = Qwen35Runtime.from_pretrained(path, batch_size=2, max_length=64)
    assert model.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS) == ref.tokens.tolist()
    for n in (1, 3):
        assert run_tensor_parallel(path, 1, PROMPTS, n).tokens.tolist() == model.generate(PROMPTS, max_new_tokens=n)
