"""The model's layer factory on CPU: plain torch layers with torch.distributed's functional collectives.

The model asks its layer factory for every part that a backend builds its own way (modeling/decoder.py, deltanet.py,
attention.py, moe.py); this one builds them from modeling/parallel.py's primitives and modeling/moe.py's experts, for
the cpu target, the exported programs and the tests. The NxD backend's factory is backends/nxd/layers.py.
`pack_linears` prepacks a built model's matmuls for oneDNN (CPU inference).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .fp8 import is_fp8
from .moe import Experts, SharedExpert
from .parallel import Linear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, all_reduce, can_pack
from .precision import TorchPrecision


def pack_linears(module: nn.Module, batch_size: int) -> int:
    """Prepack every `Linear` of `module` (the lm_head too), and the MoE experts' matrices (`moe.Experts.pack`),
    whose dtype this build can pack, for calls of about `batch_size` rows (CPU inference: the module is not trained
    or re-loaded afterwards). Returns how many modules were packed. A packed weight replaces the plain one, except where the plain one is also used elsewhere: the lm_head
    of a model with tied embeddings gets a packed copy (vocab x hidden more in the model dtype), the embedding keeps
    the plain rows it looks up."""
    # A layer holding float8 weights (modeling/fp8.py) dequantizes them at each call: it is not packed.
    linears = [m for m in module.modules() if isinstance(m, Linear) and not is_fp8(m) and can_pack(m.weight.dtype)]
    for m in linears:
        m.pack(batch_size)
    experts = [m for m in module.modules() if isinstance(m, Experts) and not is_fp8(m) and can_pack(m.gate_up_proj.dtype)]
    for m in experts:
        m.pack(batch_size)
    return len(linears) + len(experts)


class TorchLayers:
    """Plain torch layers; with tp_degree > 1, torch.distributed collectives over `group`.

    `group` may be a process group or its name. Building the layers does not need torch.distributed
    (a graph can be built on the meta device and exported anywhere); running them at tp_degree > 1 does.
    `kernel_backend` names the kernel backend the model's DeltaNet layers call (e.g. "nki": the NKI kernels, on
    the emulator on CPU); None uses the process-wide one (`kernels.set_backend`).
    """

    # The precision policy of these layers' backend (modeling/precision.py): the model asks it for the forms of
    # its bf16-operand / fp32-accumulator matmuls.
    precision = TorchPrecision()
    # Context encoding runs the layers over at most this many rows (batch x tokens) at a time, in whole delta-rule
    # chunks (DecoderLayer.block_tokens). On CPU: the activations of a 4096-token prompt at once (projections, the
    # delta rule's per-chunk tensors, the MLP) would outweigh the KV cache; and glibc's malloc hands an allocation
    # above its mmap threshold (at most 32 MiB) back to the OS when freed, so such intermediates are fresh,
    # page-faulting memory on every call (elementwise ops on 50 MB tensors measured 4-5x slower than in place).
    # 1024 rows keep the largest (the conv's fp32 [rows, 6144] at the 2B shape: 24 MiB) below it: a bf16 prefill
    # of 4 x 512 tokens went from 7.3 to 5.1 s (1 thread) with 256-token blocks instead of one 2048-row block.
    # None: the whole block at once.
    token_block = 1024
    # State updates in place (modeling/state.py): a decode step moves only the slots it writes. A graph whose state
    # outputs are aliased to its inputs (the Neuron backend) needs updated copies instead: False.
    state_in_place = True

    def __init__(self, tp_degree: int = 1, rank: int = 0, group=None, kernel_backend: str | None = None):
        if group is None and tp_degree > 1:
            if not dist.is_initialized():
                raise RuntimeError("tensor parallelism on CPU needs torch.distributed initialized (gloo) first")
            group = dist.group.WORLD
        self.tp_degree, self.rank = tp_degree, rank
        self.group_name = group if isinstance(group, str) or group is None else group.group_name
        # The kernel backend of the model built over these layers (`optimum_qwen35.kernels`); None: the
        # process-wide one.
        self.kernel_backend = kernel_backend

    # The LNC degree the DeltaNet kernels are launched with (`kernels.deltanet_prefill(lnc=)`): on CPU none (the NKI
    # emulator takes that of the target it emulates); the Neuron factory passes its compiled target's.
    kernel_lnc = None

    def column_linear(self, in_features: int, out_features_per_rank: int, bias: bool = False) -> nn.Module:
        # Column-parallel output stays sharded: the next row-parallel layer consumes it as is.
        return Linear(in_features, out_features_per_rank, bias)

    def replicated_linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        # The whole weight on every rank (the MTP head's fc at TP > 1: modeling/mtp.py).
        return Linear(in_features, out_features, bias)

    def row_linear(self, in_features_per_rank: int, out_features: int, bias: bool = False) -> nn.Module:
        return RowParallelLinear(in_features_per_rank, out_features, self.group_name, self.tp_degree, bias)

    def embedding(self, vocab_per_rank: int, hidden_size: int) -> nn.Module:
        return VocabParallelEmbedding(vocab_per_rank, hidden_size, self.rank, self.group_name, self.tp_degree)

    def lm_head(self, hidden_size: int, vocab_per_rank: int, vocab_size: int) -> nn.Module:
        return VocabParallelHead(hidden_size, vocab_per_rank, vocab_size, self.group_name, self.tp_degree, self.precision)

    # The sparse MoE block's parts (modeling/moe.py), per-rank sizes (`moe.ExpertSharding`).
    def routed_experts(self, experts_per_rank: int, intermediate_per_rank: int, hidden_size: int) -> nn.Module:
        return Experts(experts_per_rank, intermediate_per_rank, hidden_size)

    def shared_expert(self, hidden_size: int, intermediate_per_rank: int) -> nn.Module:
        return SharedExpert(hidden_size, intermediate_per_rank)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial x (the MoE block's routed and shared outputs, summed once)."""
        return x if self.tp_degree == 1 else all_reduce(x, self.group_name)
