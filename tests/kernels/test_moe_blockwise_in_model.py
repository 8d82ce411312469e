"""The blockwise MoE kernel inside the model (issue 51 item 1): `SparseMoeBlock` runs a prompt's routed experts through
`torch.ops.optimum_qwen35.moe_blocks` on the NKI kernel (here the emulator) when its kernel backend is "nki", and
through the static forms otherwise.

- The block: a prompt's output equals the static blocked form's within fp32 rounding, at TP 1 and in both halves of
  an expert-parallel pair of ranks (pairs of the other rank's experts left out); the kernel ran once per prompt and
  ran once per prompt; decode (fewer pairs than experts) keeps the gathered form; experts packed for the CPU keep the
  looped form.
- The model: tiny-moe's greedy tokens and prompt logits with the process-wide "nki" backend (the DeltaNet kernels and
  this one) equal the "torch" backend's.
- A graph capture (torch.export) holds one `moe_blocks` node per MoE layer's prompt.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optimum_qwen35 import kernels
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.kernels.moe_blockwise.kernel import moe_blocks_kernel
from optimum_qwen35.modeling.moe import SparseMoeBlock
from optimum_qwen35.modeling.torch_layers import TorchLayers

from ..conftest import FIXTURES


@pytest.fixture
def torch_backend_after():
    yield
    kernels.set_backend("torch")


def block(backend: str | None, tp_degree: int = 1, rank: int = 0, seed: int = 0) -> SparseMoeBlock:
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-moe")
    if tp_degree > 1:
        config = dataclasses.replace(config, moe_parallel="ep")  # whole experts per rank
    torch.manual_seed(seed)
    # (a group name: no collective runs here, each rank's share is compared before the all-reduce)
    moe = SparseMoeBlock(config, TorchLayers(tp_degree, rank, group="unused", kernel_backend=backend))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    moe.block_size = 16  # blocks of 16 rows: a 40-token prompt fills several, with padding in the last of each expert
    return moe


class Rank(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.register_buffer("rank", torch.tensor([rank], dtype=torch.int32))


def test_the_prompts_routed_experts_run_the_kernel_equal_to_the_static_form():
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    kernel_block, static_block = block("nki"), block("torch")
    moe_blocks_kernel.last_report = None
    with torch.no_grad():
        got = kernel_block(x)
        report = moe_blocks_kernel.last_report
        want = static_block(x, static=True)
    assert report is not None, "the kernel did not run"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Decode (2 tokens: fewer pairs than experts) keeps the gathered form: no kernel call.
    moe_blocks_kernel.last_report = None
    with torch.no_grad():
        torch.testing.assert_close(kernel_block(x[:2]), static_block(x[:2], static=True), rtol=0, atol=1e-5)
    assert moe_blocks_kernel.last_report is None


def test_each_expert_parallel_rank_runs_its_own_experts_blocks():
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    total = 0
    for rank in (0, 1):
        kernel_block, static_block = block("nki", 2, rank), block("torch", 2, rank)
        for moe in (kernel_block, static_block):
            moe.layers.reduce = lambda y: y  # this rank's share, before the all-reduce
            moe.bind_rank(Rank(rank))
        with torch.no_grad():
            got, want = kernel_block(x), static_block(x, static=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        total = total + got
    assert total.abs().max() > 0


def test_experts_packed_for_the_cpu_keep_the_looped_form():
    """Experts packed for the CPU's GEMM (`Experts.pack`: the fused weights emptied) cannot feed the kernel: the
    eager block keeps the looped form under "nki" too."""
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    moe, plain = block("nki"), block("torch")
    with torch.no_grad():
        want = plain(x)
        moe.experts.pack(4)
        moe_blocks_kernel.last_report = None
        got = moe(x)
    assert moe_blocks_kernel.last_report is None
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_tiny_moe_greedy_tokens_with_the_kernels_equal_the_torch_backends(torch_backend_after):
    from optimum_qwen35.runtime import Qwen35Runtime

    # (unpacked: experts packed for the CPU's GEMM keep the looped form)
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-moe", batch_size=2, max_length=96, buckets=[64],
                                          pack_weights=False)
    for moe in (m for m in model.decoder.modules() if isinstance(m, SparseMoeBlock)):
        moe.block_size = 16
    prompts = [[(11 * i + 5) % 500 + 3 for i in range(40)], [(7 * i + 2) % 500 + 3 for i in range(23)]]
    want = model.generate(prompts, max_new_tokens=6)
    kernels.set_backend("nki")
    moe_blocks_kernel.last_report = None
    got = model.generate(prompts, max_new_tokens=6)
    assert moe_blocks_kernel.last_report is not None
    assert got == want


def test_a_graph_capture_holds_one_moe_blocks_node_per_prompt():
    moe = block("nki")
    program = torch.export.export(moe, (torch.randn(40, 64),))
    calls = [n for n in program.graph.nodes if n.op == "call_function" and "moe_blocks" in str(n.target)]
    assert len(calls) == 1 and calls[0].args[-1] == "nki"
