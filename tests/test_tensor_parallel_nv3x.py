"""TP = 4 on the 27B-shaped layout: nv = 3 nk and dk != dv (16 vs 32), untied, padded vocabulary and intermediate size.

tests/test_tensor_parallel.py runs TP = 2 and 4 on layouts where dk = dv, so value-head offsets computed with the key
head size shard correctly there; here they do not. Same checks (fp32 within 1e-4, fp64 to rounding, same tokens)."""

from .test_tensor_parallel import DTYPES, MAX_NEW_TOKENS, PROMPTS, check_against_reference, odd_sized_nv3x, reference
from optimum_qwen35.config import Qwen35Config
from tests.kit.tp import run_tensor_parallel


def test_tp4_with_three_value_heads_per_key_head_and_dk_not_dv(tmp_path):
    path = odd_sized_nv3x(tmp_path / "odd-nv3x")
    config = Qwen35Config.from_pretrained(path)
    assert config.linear_num_value_heads == 3 * config.linear_num_key_heads
    assert config.linear_key_head_dim != config.linear_value_head_dim
    refs = reference(path)
    assert refs[0].tokens.shape == (len(PROMPTS), MAX_NEW_TOKENS)
    results = run_tensor_parallel(path, 4, PROMPTS, MAX_NEW_TOKENS, DTYPES)
    check_against_reference(results, refs, "odd-nv3x TP=4")
