"""Prepacked CPU linears (modeling/parallel.py `Linear.pack`): the products of F.linear, from a re-blocked weight
that replaces the plain one."""

import pytest
import torch
import torch.nn.functional as F

from optimum_qwen35.modeling.parallel import Linear, RowParallelLinear, can_pack
from optimum_qwen35.modeling.torch_layers import pack_linears
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder

from .conftest import FIXTURES

needs_fp32 = pytest.mark.skipif(not can_pack(torch.float32), reason="this torch build has no oneDNN")
needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN has no bf16 GEMM for this CPU")


def _inputs(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "transposed":  # a non-contiguous [5, 48]
        return torch.randn(48, 5, generator=g).to(dtype).t()
    if kind == "strided":  # a non-contiguous [2, 3, 48]
        return torch.randn(2, 6, 48, generator=g).to(dtype)[:, ::2]
    return torch.randn(*kind, generator=g).to(dtype)


def _linear(dtype: torch.dtype, cls=Linear) -> Linear:
    torch.manual_seed(1)
    return cls(48, 40).to(dtype)


@needs_fp32
@pytest.mark.parametrize("kind", [(1, 48), (4, 48), (3, 5, 48), (300, 48), "transposed", "strided"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_packed_fp32_linear_gives_f_linear_products(kind, batch_size):
    lin = _linear(torch.float32)
    x = _inputs(kind, torch.float32)
    exact = F.linear(x.double(), lin.weight.double())
    lin.pack(batch_size)
    assert lin.packed and lin.weight.is_mkldnn and lin.packed_for == batch_size
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == exact.shape
    torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6)


@needs_bf16
@pytest.mark.parametrize("kind", [(1, 48), (4, 48), (3, 5, 48), "strided"])
def test_packed_bf16_linear_accumulates_in_fp32_and_rounds_once(kind):
    """bf16 operands, fp32 accumulation, one rounding of the result to bf16: within half a bf16 ulp (2^-9
    relative) of the exact product of the bf16 operands, like F.linear."""
    lin = _linear(torch.bfloat16)
    x = _inputs(kind, torch.bfloat16)
    exact = F.linear(x.double(), lin.weight.double())
    lin.pack(4)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(y.double(), F.linear(x, lin.weight.to_dense()).double(), rtol=2**-7, atol=0)


@needs_fp32
def test_packing_keeps_the_weight_values_and_the_state_dict_plain():
    lin = _linear(torch.float32, RowParallelLinear)
    plain = lin.weight.detach().clone()
    lin.pack(1)
    saved = lin.state_dict()["weight"]
    assert not saved.is_mkldnn and torch.equal(saved, plain)
    packed_once = lin.weight
    lin.pack(1)  # same batch size: nothing to do
    assert lin.weight is packed_once
    lin.pack(8)  # another batch size: re-blocked from the packed one, same values
    assert lin.weight is not packed_once and lin.packed_for == 8
    assert torch.equal(lin.weight.to_dense(), plain)
    assert not any(p.requires_grad for p in lin.parameters())


def test_plain_linear_is_f_linear():
    lin = _linear(torch.float64)
    x = _inputs((3, 48), torch.float64)
    assert not lin.packed
    assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert not can_pack(torch.float64) and not can_pack(torch.float16)


@needs_fp32
@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-nv3x"])  # tied and untied embeddings
def test_pack_linears_packs_every_linear_and_the_head_not_the_embedding(layout):
    decoder = load_decoder(FIXTURES / layout)
    tied = decoder.config.tie_word_embeddings
    assert tied == (layout == "tiny-2b") and (decoder.lm_head.weight is decoder.embed_tokens.weight) == tied
    embedding, head = decoder.embed_tokens.weight, decoder.lm_head.weight.detach().clone()
    linears = [name for name, m in decoder.named_modules() if isinstance(m, Linear)]
    kinds = decoder.config.layer_types  # DeltaNet: in_proj_qkv/z/b/a, out_proj; attention: q/k/v/o; MLP: 3
    expected = 1 + 5 * kinds.count("linear_attention") + 4 * kinds.count("full_attention") + 3 * len(kinds)
    assert "lm_head" in linears and len(linears) == expected
    assert pack_linears(decoder, 2) == len(linears)
    assert all(m.packed_for == 2 for m in decoder.modules() if isinstance(m, Linear))
    # The head is packed (a packed copy when tied); the embedding keeps its plain rows.
    assert decoder.lm_head.weight.is_mkldnn and decoder.embed_tokens.weight is embedding and not embedding.is_mkldnn
    assert torch.equal(decoder.state_dict()["lm_head.weight"], head)
    assert pack_linears(load_decoder(FIXTURES / layout, dtype=torch.float64), 2) == 0


@needs_fp32
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_head_gives_fp32_logits_of_the_real_vocabulary(dtype):
    decoder = load_decoder(FIXTURES / "tiny-nv3x", dtype=dtype)
    x = torch.randn(3, decoder.config.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = decoder.lm_head(x)
    pack_linears(decoder, 1)
    packed = decoder.lm_head(x)
    assert packed.dtype == plain.dtype == torch.float32 and packed.shape == plain.shape
    torch.testing.assert_close(packed, plain, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-6)


@needs_fp32
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_model_gives_the_plain_models_logits_and_tokens(dtype):
    prompts = [[3, 17, 4, 99, 23, 5, 8, 61, 7], [42, 11, 5]]
    kwargs = dict(batch_size=2, max_length=64, dtype=dtype, buckets=[16])
    plain = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", pack_weights=False, **kwargs)
    packed = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", **kwargs)  # packs by default
    assert not any(m.packed for m in plain.decoder.modules() if isinstance(m, Linear))
    assert all(m.packed_for == 2 for m in packed.decoder.modules() if isinstance(m, Linear))
    # bf16: the project's bf16 tolerance (on an avx512_bf16 CPU the two forms give identical logits)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(plain.logits(prompts), packed.logits(prompts)):
        torch.testing.assert_close(b, a, **tolerance)
    if dtype == torch.float32:
        assert packed.generate(prompts, max_new_tokens=8) == plain.generate(prompts, max_new_tokens=8)


def test_traced_graphs_keep_plain_weights():
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", max_length=32, buckets=[16], trace=True)
    assert not any(m.packed for m in model.decoder.modules() if isinstance(m, Linear))
