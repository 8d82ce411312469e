"""The multi-token-prediction head (modeling/mtp.py) against an independent float64 implementation of its equations
(tests/oracle.py `mtp`, written from the equations with the safetensors library: no code shared with the package),
and the opt-in reading of `mtp.*` (the plain model's reading is unchanged).

In float64 both sides compute the same numbers up to rounding (measured below 1e-12), so the bound 1e-9 catches a
swapped concatenation, a plain-w norm, the hidden state taken before the final norm, a wrong rotary position or a
cache read out of place by orders of magnitude."""

import pytest
import torch

from optimum_qwen35.checkpoint import CheckpointReader
from optimum_qwen35.errors import UnsupportedModelError
from optimum_qwen35.runtime import Qwen35Runtime

from . import oracle
from .conftest import FIXTURES

ATOL = 1e-9
TOKENS = [3, 77, 120, 5, 9, 300, 41, 41, 2, 511, 17, 64, 200, 8, 99, 150, 6, 33, 250, 1]


def test_reader_serves_mtp_only_when_asked():
    plain, with_mtp = CheckpointReader(FIXTURES / "tiny-2b"), CheckpointReader(FIXTURES / "tiny-2b", mtp=True)
    assert plain.names() == with_mtp.names() and not plain.mtp_names()
    assert not any("mtp" in n for n in plain.names())
    assert {"fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= set(with_mtp.mtp_names())
    assert with_mtp.mtp_shape("fc.weight") == (128, 256)
    # An MoE head stored per expert is served fused, as the decoder's experts are.
    moe = CheckpointReader(FIXTURES / "tiny-moe", mtp=True)
    assert "layers.0.mlp.experts.gate_up_proj" in moe.mtp_names()
    assert not any(".experts.0." in n for n in moe.mtp_names())


@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-nv3x"])  # tied lm_head; untied, nv = 3 nk
def test_mtp_head_matches_float64_oracle(layout):
    text = oracle.read_text_weights(FIXTURES / layout)
    M = oracle.read_mtp_weights(FIXTURES / layout)
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=2, max_length=64, dtype=torch.float64,
                                          buckets=[32], mtp=True)  # one block: no fp32 state between calls
    n = len(TOKENS) - 1  # the head at positions 0 .. n - 1 reads token i + 1
    want_hidden = oracle.hidden_states(text, TOKENS[:n])
    _, hiddens = model.prefill([TOKENS[:n]], [1], hidden=True)  # slot 1: row 0 of the graph, slot 1 of the caches
    assert (hiddens[0] - want_hidden).abs().max().item() < ATOL
    want_logits, want_out = oracle.mtp(text, M, TOKENS[1:], want_hidden)

    def run(ids, hidden, start):
        T = len(ids)
        return model.graphs.mtp(
            None, torch.tensor([ids, [0] * T], dtype=torch.int32), torch.stack([hidden, torch.zeros_like(hidden)]),
            torch.arange(start, start + T, dtype=torch.int32).expand(2, T).contiguous(),
            torch.tensor([T, 1], dtype=torch.int32), torch.tensor([1, -1], dtype=torch.int32),
        )

    # A block of 12 positions from 0, then single positions continuing the head's own KV cache.
    m = 12
    logits, out = run(TOKENS[1 : m + 1], hiddens[0][:m], 0)
    assert (logits[0] - want_logits[m - 1]).abs().max().item() < ATOL
    assert (out[0] - want_out[m - 1]).abs().max().item() < ATOL
    for i in range(m, n):
        logits, out = run([TOKENS[i + 1]], hiddens[0][i : i + 1], i)
        assert (logits[0] - want_logits[i]).abs().max().item() < ATOL, f"position {i}"
    # A draft step: the head's own output as the hidden state at the next position (what k > 1 drafts re-run).
    draft_hidden = torch.cat([want_hidden[: n - 1], want_out[n - 2 : n - 1]])
    want_draft, _ = oracle.mtp(text, M, TOKENS[1:n] + [7], draft_hidden)
    logits, _ = run([7], out[0:1] * 0 + want_out[n - 2 : n - 1], n - 1)
    assert (logits[0] - want_draft[n - 1]).abs().max().item() < ATOL


def test_mtp_is_opt_in(tmp_path):
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", max_length=32)
    assert model.decoder.mtp is None and not model.graphs.mtp_state
    assert not any(k.startswith("mtp.") for k in model.decoder.state_dict())
    with pytest.raises(Exception, match="multi-token-prediction head"):
        model.generate([[1, 2, 3]], max_new_tokens=3, num_speculative_tokens=2)
    # A sharded export holds no head (save_sharded writes the text decoder only): asking for it there is refused.
    from optimum_qwen35.checkpoint.sharded_files import save_sharded
    from optimum_qwen35.runtime.eager import load_decoder

    save_sharded(FIXTURES / "tiny-2b", None, tp_degree=1, out_dir=tmp_path / "export")
    with pytest.raises(UnsupportedModelError, match="sharded export does not hold it"):
        load_decoder(tmp_path / "export", mtp=True)
