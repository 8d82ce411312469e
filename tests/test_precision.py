"""The precision policy (modeling/precision.py) and the lm_head's vocabulary padding."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_qwen35.modeling import parallel
from optimum_qwen35.modeling.parallel import VocabParallelHead
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.modeling.precision import NeuronPrecision, TorchPrecision
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder

from .conftest import FIXTURES


class CastLog(TorchDispatchMode):
    """Records the input of every dtype conversion."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout):
            self.casts.append(args[0])
        return func(*args, **(kwargs or {}))


def test_every_layer_shares_the_factorys_policy():
    decoder = load_decoder(FIXTURES / "tiny-nv2x")
    policies = {id(m.precision) for m in decoder.modules() if hasattr(m, "precision")}
    assert policies == {id(TorchLayers.precision)}
    assert isinstance(TorchLayers.precision, TorchPrecision)


@pytest.mark.parametrize("pack_weights", [False, True])
@pytest.mark.parametrize("kind", ["context", "token"])
def test_bf16_graphs_make_no_fp32_copy_of_a_matmul_weight(kind, pack_weights):
    """No weight of a matmul (linears, lm_head / tied embedding) is converted per call; only small vectors
    (norm weights, A_log, dt_bias, the [C, 4] conv filter) may be. Plain and prepacked (`Linear.pack`) weights."""
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", batch_size=2, max_length=128, dtype=torch.bfloat16,
                                              buckets=[64], pack_weights=pack_weights)
    params = [(name, p) for name, p in model.decoder.named_parameters() if p.dim() == 2 and p.shape[1] > 4]
    assert any(p.is_mkldnn for _, p in params) == (pack_weights and parallel.can_pack(torch.bfloat16))
    # A cast may read a weight or a view of it: plain weights are found by their storage, packed ones (opaque
    # oneDNN tensors, no storage pointer) by identity.
    weights = {p.data_ptr(): name for name, p in params if not p.is_mkldnn}
    packed = {id(p): name for name, p in params if p.is_mkldnn}
    assert {"lm_head.weight", "embed_tokens.weight"} & set(weights.values())

    def weight_name(t):
        return packed.get(id(t)) if t.is_mkldnn else weights.get(t.data_ptr())

    if kind == "token":
        model.prefill([[1, 2, 3], [4, 5]], [0, 1])  # decode continues encoded sequences
    with CastLog() as log, torch.no_grad():
        if kind == "context":
            model.prefill([[1, 2, 3], [4, 5]], [0, 1])
        else:
            model.decode([1, 2], [3, 2], [0, 1])
    copied = sorted({weight_name(t) for t in log.casts if weight_name(t)})
    assert not copied, f"per-call casts of matmul weights: {copied}"


def test_bf16_logits_are_fp32():
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", max_length=64, dtype=torch.bfloat16)
    assert model.prefill([[1, 2, 3]], [0]).dtype == torch.float32
    assert model.decode([4], [3], [0]).dtype == torch.float32


@pytest.mark.parametrize("queries", [3, 2, 1])  # 3 != the 4 query heads; one query: the decode case (bmm form)
@pytest.mark.parametrize("form", [TorchPrecision, NeuronPrecision], ids=["torch", "neuron"])
def test_attention_core_matches_the_explicit_form(form, queries):
    """The policy's attention (SDPA on CPU, bmm for one query; explicit on Neuron) against the explicit matmul form
    in float64, with GQA and a mask; in bf16 within the rounding of its operands, scores and probabilities."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, queries, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 16, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, queries, 7, generator=g) > 0.5
    mask[..., 0] = True
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(form.attention(q, k, v, mask, 0.25), want, rtol=0, atol=1e-12)
    got = form.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2)


def test_padded_vocabulary_is_never_selected(monkeypatch):
    """Vocabulary 7 over TP = 2: 4 rows per rank, the last rank's last row is padding. Its logit would win every
    argmax (all real logits are negative, the padded row's is 0 as in a zero-padded shard, or huge if the padding
    held garbage): the gathered logits stop at the real vocabulary, so nothing downstream can pick it."""
    vocab, hidden = 7, 6
    torch.manual_seed(0)
    full = -torch.rand(vocab, hidden) - 0.1  # negative rows; inputs positive: every real logit < 0
    heads = []
    for rank in range(2):
        head = VocabParallelHead(hidden, 4, vocab, group_name="fake", tp_degree=2)
        rows = torch.zeros(4, hidden)
        block = full[4 * rank : 4 * rank + 4]
        rows[: len(block)] = block
        head.weight.data.copy_(rows)
        heads.append(head)
    x = torch.rand(3, 1, hidden) + 0.1
    local = [torch.nn.functional.linear(x, h.weight) for h in heads]
    monkeypatch.setattr(parallel, "all_gather_last_dim", lambda y, t, g: torch.cat(local, dim=-1))
    for padding_row in (torch.zeros(hidden), torch.full((hidden,), 1e4)):
        heads[1].weight.data[3] = padding_row
        local[1] = torch.nn.functional.linear(x, heads[1].weight)
        assert torch.cat(local, -1).argmax(-1).eq(vocab).all()  # the padded column would win
        logits = heads[0](x)
        assert logits.shape == (3, 1, vocab)
        torch.testing.assert_close(logits, torch.nn.functional.linear(x, full))
        assert logits.argmax(-1).lt(vocab).all()


def test_the_decoders_head_stops_at_the_real_vocabulary(monkeypatch):
    """The decoder gives its lm_head the real vocabulary size: at TP = 2 with an odd vocabulary the gathered logits
    (here rank 0's twice, standing in for the gather) are cut to it."""
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.modeling.decoder import Qwen35Decoder

    import dataclasses

    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-nv3x")
    config = dataclasses.replace(config, vocab_size=2 * (config.vocab_size // 2) + 1)
    monkeypatch.setattr(parallel, "all_gather_last_dim", lambda y, t, g: torch.cat([y] * t, dim=-1))
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, 2, TorchLayers(2, 0, group="fake"))
    assert decoder.lm_head.weight.shape[0] == (config.vocab_size + 1) // 2
    assert decoder.lm_head(torch.empty(1, 1, config.hidden_size, device="meta")).shape[-1] == config.vocab_size


def test_gate_parameters_stay_fp32_in_a_bf16_model(tmp_path):
    """A_log and dt_bias are held in fp32 whatever the model dtype: loaded from a checkpoint, and from a bf16
    per-rank export (save_sharded with dtype) loaded back."""
    from optimum_qwen35.checkpoint.sharded_files import save_sharded

    def gate_dtypes(decoder):
        return {p.dtype for name, p in decoder.named_parameters() if name.endswith(("A_log", "dt_bias"))}

    decoder = load_decoder(FIXTURES / "tiny-nv2x", dtype=torch.bfloat16)
    assert gate_dtypes(decoder) == {torch.float32}
    assert decoder.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    export = save_sharded(FIXTURES / "tiny-nv2x", None, 1, tmp_path / "export", dtype=torch.bfloat16, progress=False)
    assert gate_dtypes(load_decoder(export, dtype=torch.bfloat16)) == {torch.float32}
    assert gate_dtypes(load_decoder(FIXTURES / "tiny-nv2x")) == {torch.float32}
    assert gate_dtypes(load_decoder(FIXTURES / "tiny-nv2x", dtype=torch.float64)) == {torch.float64}


def test_bf16_compiled_export_holds_fp32_gates_too(tmp_path):
    """The cpu target's compiled programs take the gate parameters as the export stores them (fp32), and give the
    eager bf16 model's greedy tokens."""
    from optimum_qwen35.checkpoint.sharded_files import save_sharded
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.export import layout as export_layout
    from optimum_qwen35.export.compile import compile_graphs
    from optimum_qwen35.runtime import Qwen35Runtime

    source = FIXTURES / "tiny-2b"
    config = Qwen35Config.from_pretrained(source)
    save_sharded(source, config, 1, tmp_path / export_layout.CHECKPOINT_DIR, torch.bfloat16, progress=False)
    compile_graphs(config, 1, 1, 128, [128], torch.bfloat16, tmp_path / export_layout.COMPILED_DIR, progress=False)
    model = Qwen35Runtime.from_export(tmp_path)
    try:
        eager = Qwen35Runtime.from_pretrained(source, max_length=128, dtype=torch.bfloat16)
        assert model.generate([[1, 2, 3, 4, 5]], max_new_tokens=6) == eager.generate([[1, 2, 3, 4, 5]], max_new_tokens=6)
    finally:
        model.close()


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float64])
def test_casting_the_model_keeps_the_rotary_frequencies_exact(cast):
    """A bf16 export casts the whole decoder (`.to(torch.bfloat16)`); the rotary frequencies must stay fp32 and
    exact, or odd positions above 256 would rotate as even ones. Any cast, widening ones included, leaves the two
    tables (fp32, float64) as built."""
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.modeling.decoder import Qwen35Decoder

    from .conftest import FIXTURES

    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-2b")
    positions = torch.tensor([[0, 255, 257, 301, 4095]])
    want = Qwen35Decoder(config).rotary(positions, torch.bfloat16)
    built = Qwen35Decoder(config).rotary
    cast = Qwen35Decoder(config).to(cast)
    assert cast.rotary.inv_freq.dtype == torch.float32 and cast.rotary.inv_freq64.dtype == torch.float64
    assert torch.equal(cast.rotary.inv_freq, built.inv_freq) and torch.equal(cast.rotary.inv_freq64, built.inv_freq64)
    for a, b in zip(cast.rotary(positions, torch.bfloat16), want):
        assert torch.equal(a, b)


def test_norms_compute_in_fp32_and_round_once():
    """A bf16 activation through RMSNorm: normalised and scaled in fp32, rounded to bf16 once at the end."""
    from optimum_qwen35.modeling.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=g).bfloat16()
    x = (torch.randn(4, 64, generator=g) * 3).bfloat16()
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.float())).bfloat16()
    assert torch.equal(norm(x), want)


def test_rotary_tables_and_state_dtypes_follow_the_policy():
    """RoPE tables in fp32 for fp32 and bf16 models (float64 for float64), from the fp32 frequencies as transformers
    computes them; the state in the model dtype (K/V, conv) except the recurrent state, fp32 always."""
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.modeling.decoder import Qwen35Decoder

    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-nv3x")
    decoder = Qwen35Decoder(config)
    positions = torch.tensor([[0, 1, 300, 4095]])
    for dtype, table in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        cos, sin = decoder.rotary(positions, dtype)
        assert cos.dtype == sin.dtype == table
        inv_freq = decoder.rotary.inv_freq64 if table == torch.float64 else decoder.rotary.inv_freq
        angles = positions.to(table)[..., None] * inv_freq
        assert torch.equal(cos[:, 0], torch.cat([angles, angles], -1).cos())
    for dtype in (torch.float32, torch.bfloat16):
        specs = Qwen35Decoder(config).to(dtype).state_specs(2, 64)
        for spec in specs:
            want = torch.float32 if spec.name.endswith("recurrent_state") else dtype
            assert spec.dtype == want, spec.name


def test_to_model_dtype_keeps_the_gate_parameters_in_the_accumulation_dtype():
    """`to_model_dtype` (the cpu export's cast): every parameter in the model dtype, except A_log and dt_bias, which
    keep fp32 (float64 in a float64 model) and their exact values."""
    from optimum_qwen35.modeling.precision import FP32_PARAMETERS, to_model_dtype

    decoder = load_decoder(FIXTURES / "tiny-nv2x")
    before = {name: p.detach().clone() for name, p in decoder.named_parameters()}
    for dtype, accumulation in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        to_model_dtype(decoder, dtype)
        for name, param in decoder.named_parameters():
            gate = name.endswith(FP32_PARAMETERS)
            assert param.dtype == (accumulation if gate else dtype), name
            want = before[name].to(param.dtype) if gate else before[name].to(torch.bfloat16).to(param.dtype)
            assert torch.equal(param, want), name
        assert sum(name.endswith(FP32_PARAMETERS) for name, _ in decoder.named_parameters()) > 0
