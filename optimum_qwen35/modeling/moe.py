"""The Qwen3.5 sparse mixture-of-experts block (`qwen3_5_moe`): a router, routed experts, one gated shared expert.

Routing as transformers 5 computes it (`Qwen3_5MoeTopKRouter`): router logits, softmax over all experts in fp32
(`softmax(..., dtype=float32)`, for float64 models too), `torch.topk` on the probabilities (its tie order), the k
weights always renormalised to sum 1, then cast to the model dtype. The router's logits are computed in fp32 from
an fp32-held router weight (`precision.FP32_PARAMETERS`): in bf16 the routing decision is not made on bf16 logits.
Each chosen expert computes down(silu(gate(x)) * up(x)), weighted; the shared expert's output is scaled by
sigmoid(shared_expert_gate(x)) and added. The weighted sum is accumulated in fp32 (transformers' bf16 path adds
bf16 expert outputs into a bf16 buffer).

Three forms. Run eagerly (no graph being traced), the block uses the looped form:
- looped: each expert some token chose runs once, on the rows that chose it, from views of its weights. Its
  shapes depend on the routing (a Python loop over the chosen experts), so no graph can hold it; it reads each
  chosen expert's weights once per step, what decode on CPU is bound by (docs/moe.md, "Speed on CPU").
Graphs being traced (`torch.jit.trace`, `torch.export`) get one of two static-shape forms, chosen by the (static)
number of routed (token, expert) pairs, with no data-dependent shapes, so that `torch.export` and Neuron can
trace them:
- dense: every local expert runs on every token and a [tokens, experts] weight matrix (zero for experts not
  chosen) combines them. For prompts (many pairs) and tiny expert counts.
- gathered: the weights of each chosen (token, expert) pair are gathered and applied with a batched matmul. For
  decode, where the pairs are fewer than the local experts (reads k experts' weights per token, not all, but
  copies them first).
- blocks (`routed_blocks`): the routed work only, for prompts. The (token, expert) pairs are sorted by expert and laid
  out in blocks of `block_size` rows, each block one expert's (its last block padded with a zero row), and each block
  runs through its expert's gathered weights in one batched matmul. The number of blocks is static and
  dropless: sum over experts of ceil(pairs_e / B) <= (P + m (B - 1)) / B for P pairs over m <= min(E_r, P) used
  experts, whatever the routing; no token is ever dropped, so no fallback is needed. The layout is
  neuronx-distributed's blockwise one (`expert_mlps_v2.py`, `get_blockwise_expert_and_token_mapping`: blocks of
  tokens per expert, num_blocks bounded the same way), whose own matmul is a closed NKI kernel; here the matmul is
  the gathered form's (`Experts(expert_indices=...)`, NxD's selective loading, which its decode graphs compile), and
  the positions come from a sort (the router's top-k is one already) and int32 sums, not a cumsum. Used when its
  rows (blocks x B) are fewer than the dense form's (tokens x E_r).

Tensor parallelism (`Qwen35Config.expert_parallel_mode`): the router and `shared_expert_gate` are replicated,
the shared expert is split like the dense MLP (intermediate rows, zero-padded), and the routed experts are split
either by whole experts ("ep": rank r holds experts r*E_r .. (r+1)*E_r - 1, zero experts appended when E does not
divide, never routed) or inside every expert ("tp": each rank the same block of every expert's intermediate rows,
gate and up alike, zero-padded). Every rank routes every token identically; one all-reduce sums the ranks' shares
of the routed and shared outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from ..errors import UsageError
from ..kernels.backends import resolve as kernel_backend_of
from ..kernels.moe_blockwise.layout import block_count, block_layout, routed_blocks, weighted_sum
from ..kernels.moe_blockwise.op import routed_experts
from .fp8 import is_fp8, select_experts
from .parallel import Linear
from .precision import accumulation_dtype, upcast


ROUTED_BLOCK = 128  # rows per block of the blocked prompt form (SparseMoeBlock.block_size)


@dataclass(frozen=True)
class ExpertSharding:
    """Per-rank sizes of a sparse block at a tensor-parallel degree (checkpoint/shard.py lays the weights out so)."""

    mode: str  # "ep" or "tp" (see Qwen35Config.expert_parallel_mode)
    tp_degree: int
    experts_per_rank: int  # local experts (padded E / t for "ep"; E for "tp")
    intermediate_per_rank: int  # rows of each local expert (I for "ep"; padded I / t for "tp")
    shared_per_rank: int  # shared-expert rows (padded / t)

    @classmethod
    def from_config(cls, config: Qwen35Config, tp_degree: int = 1) -> "ExpertSharding":
        mode = config.expert_parallel_mode(tp_degree)
        t = tp_degree
        ep = mode == "ep"
        return cls(
            mode=mode,
            tp_degree=t,
            experts_per_rank=math.ceil(config.num_experts / t) if ep else config.num_experts,
            intermediate_per_rank=config.moe_intermediate_size if ep else math.ceil(config.moe_intermediate_size / t),
            shared_per_rank=math.ceil(config.shared_expert_intermediate_size / t),
        )


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in `dtype`, expert ids [N, k] int64), as transformers routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, E] in the accumulation dtype (fp32 for bf16 models; the weight is held so)."""
        w = self.weight
        return F.linear(x.to(accumulation_dtype(x.dtype)), w.to(accumulation_dtype(w.dtype)))


class Experts(nn.Module):
    """This rank's routed experts, fused as transformers holds them: gate_up_proj [E_r, 2 I_r, H] (each expert's
    gate rows, then its up rows) and down_proj [E_r, H, I_r]."""

    packed_for: int | None = None  # the batch size the experts are packed for (`pack`)

    def __init__(self, experts: int, intermediate: int, hidden_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden_size, intermediate))
        self.intermediate = intermediate
        self._packed: list = []  # per expert (gate_up, down), re-blocked

    def pack(self, batch_size: int) -> None:
        """Re-block each expert's two matrices for oneDNN's GEMM at about `batch_size` rows, as `parallel.Linear.pack`
        does for a linear (CPU inference; measured on one core, bf16 [1024, 2048]: 1.9x faster at 1 row, 1.6x at 4,
        the plain weight being re-blocked on every call otherwise). The looped form then uses them; the fused
        parameters become empty (no second copy; `state_dict` still gives them), so the static forms cannot run."""
        if self.packed_for == batch_size:
            return
        reorder = torch.ops.mkldnn._reorder_linear_weight
        experts = len(self._packed) or self.gate_up_proj.shape[0]
        packed = self._packed or [None] * experts
        for e in range(experts):  # expert by expert: a re-pack holds one expert's plain copy at a time
            gate_up, down = self.expert_weights(e)
            packed[e] = (reorder(gate_up.detach(), batch_size), reorder(down.detach(), batch_size))
        self._packed = packed
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(getattr(self, name).new_empty(0), requires_grad=False))
        self.packed_for = batch_size

    def select(self, name: str, index) -> torch.Tensor:
        """Experts `index` (an int, or an index tensor) of fused weight `name`. FP8 weights kept as float8
        (modeling/fp8.py) are gathered as float8 with their scales and only then dequantized: the selected experts'
        bytes, not the whole tensor's."""
        if isinstance(index, int):
            if not is_fp8(self):
                return getattr(self, name)[index]  # a view, as before: nothing copied
            return select_experts(self, name, torch.tensor([index]))[0]
        return select_experts(self, name, index)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2 I_r, H], down [H, I_r]) as plain tensors (views of the fused ones unless packed)."""
        if self._packed:
            return self._packed[e][0].to_dense(), self._packed[e][1].to_dense()
        return self.gate_up_proj[e], self.down_proj[e]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._packed:
            plain = [self.expert_weights(e) for e in range(len(self._packed))]
            destination[prefix + "gate_up_proj"] = torch.stack([gu for gu, _ in plain])
            destination[prefix + "down_proj"] = torch.stack([down for _, down in plain])

    def dense(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, E_r] (0 for experts a token did not choose) -> sum_e w[n, e] expert_e(x[n]), fp32."""
        h = torch.matmul(x, self.gate_up_proj.transpose(1, 2))  # [E_r, N, 2 I_r]
        gate, up = h.split(self.intermediate, dim=-1)
        out = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E_r, N, H]
        return weighted_sum(weights, out.transpose(0, 1))

    def looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, k], local expert ids [N, k] -> [N, H] fp32. Eager only (data-dependent shapes): each
        chosen expert runs once on the rows that chose it, its weights used in place (views, nothing gathered);
        pairs of weight 0 (another rank's experts) are skipped. A token's pairs are summed in expert order."""
        y = torch.zeros(x.shape, dtype=accumulation_dtype(x.dtype), device=x.device)
        rows, slots = (weights != 0).nonzero(as_tuple=True)
        chosen = ids[rows, slots]
        for e in chosen.unique().tolist():  # sorted
            pick = chosen == e
            r = rows[pick]
            gate_up, down = self._packed[e] if self._packed else (self.select("gate_up_proj", e), self.select("down_proj", e))
            gate, up = _linear(x[r], gate_up).split(self.intermediate, dim=-1)
            out = _linear(F.silu(gate) * up, down)
            y.index_add_(0, r, upcast(out) * upcast(weights[r, slots[pick]])[:, None])
        return y

    def blocks(self, x: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
        """x [nb, B, H] (rows grouped by expert), block_expert [nb] int32 -> [nb, B, H] in x's dtype: each block through
        its expert's gathered weights, one batched matmul per projection."""
        h = torch.bmm(x, self.select("gate_up_proj", block_expert).transpose(1, 2))  # [nb, B, 2 I_r]
        gate, up = h.split(self.intermediate, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.select("down_proj", block_expert).transpose(1, 2))

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, k], local expert ids [N, k] (weight 0 for a pair another rank serves) -> [N, H] fp32:
        each pair's expert weights gathered, one batched matmul per projection."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        xk = x.repeat_interleave(k, dim=0)[:, :, None]  # [N k, H, 1]
        h = torch.bmm(self.select("gate_up_proj", flat), xk)[..., 0]  # [N k, 2 I_r]
        gate, up = h.split(self.intermediate, dim=-1)
        out = torch.bmm(self.select("down_proj", flat), (F.silu(gate) * up)[:, :, None])[..., 0]  # [N k, H]
        return weighted_sum(weights, out.view(N, k, -1))


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn:  # re-blocked by `Experts.pack`
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


class SharedExpert(nn.Module):
    """The shared SwiGLU expert over this rank's intermediate rows (its partial output: ranks sum it)."""

    def __init__(self, hidden_size: int, intermediate_per_rank: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_per_rank)
        self.up_proj = Linear(hidden_size, intermediate_per_rank)
        self.down_proj = Linear(intermediate_per_rank, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """The MLP of every Qwen3.5 MoE layer (parameter names as transformers': `gate`, `experts.gate_up_proj`,
    `experts.down_proj`, `shared_expert.*`, `shared_expert_gate`). Returns fp32 (the residual stream's dtype)."""

    def __init__(self, config: Qwen35Config, layers):
        super().__init__()
        # The layer factory builds the experts, the shared expert and the one all-reduce: plain torch modules and
        # torch.distributed's functional collective (TorchLayers), or neuronx-distributed's MoE modules
        # (NxDLayers of the neuron package). The router and `shared_expert_gate` are replicated plain linears in both.
        self.layers = layers
        self.tp_degree = layers.tp_degree
        self.sharding = s = ExpertSharding.from_config(config, self.tp_degree)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.gate = Router(config.num_experts, config.hidden_size)
        self.experts = layers.routed_experts(s.experts_per_rank, s.intermediate_per_rank, config.hidden_size)
        self.shared_expert = layers.shared_expert(config.hidden_size, s.shared_per_rank)
        self.shared_expert_gate = Linear(config.hidden_size, 1)
        self._rank_source: list[nn.Module] = []  # the module holding the rank tensor (not a submodule)
        # Rows per block of the blocked prompt form (`routed_blocks`): TensorE's 128 partitions.
        self.block_size = ROUTED_BLOCK
        # The kernel backend the layer factory names (None: the process-wide one, `kernels.set_backend`): under
        # "nki" the prompts' routed experts run the blockwise NKI kernel (kernels/moe_blockwise), which computes
        # the filled blocks only.
        self.kernel_backend = getattr(layers, "kernel_backend", None)

    def bind_rank(self, module: nn.Module) -> None:
        """Read the rank from `module.rank` (the vocabulary-parallel embedding's, a weight input of the graphs, so
        one graph serves every rank); needed for expert parallelism only."""
        self._rank_source = [module]

    def _rank(self) -> torch.Tensor:
        """[1]: the CPU embedding's `rank` buffer, or neuronx-distributed's `rank_util.rank` (int32)."""
        source = self._rank_source[0]
        return source.rank if hasattr(source, "rank") else source.rank_util.rank

    def forward(self, x: torch.Tensor, static: bool | None = None) -> torch.Tensor:
        """`static`: use the static-shape forms (dense or gathered); by default only while a graph is traced."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k = x.shape[0], self.top_k
        weights, ids = route(self.gate(x), k, x.dtype)
        ids = ids.to(torch.int32)  # int32 indices, as the Neuron graphs take them (the compiler contract)
        ep = self.sharding.mode == "ep" and self.tp_degree > 1
        E_r = self.sharding.experts_per_rank
        if static is None:
            # The looped form's shapes follow the routing: eager CPU experts only, never while a graph is traced
            # (is_compiling: torch.export too) nor on a lazy device (XLA, the Neuron graphs' experts).
            static = (torch.jit.is_tracing() or torch.compiler.is_compiling() or x.device.type != "cpu"
                      or not isinstance(self.experts, Experts))
        if static and getattr(self.experts, "packed_for", None) is not None:
            raise UsageError("the MoE experts are packed for eager CPU inference (pack_weights=True): graphs cannot be "
                             "traced from them; load the model again without packing to trace it")
        blockable = N * k >= E_r and hasattr(self.experts, "blocks")
        # The kernel takes the experts' plain fused weights: not FP8 ones, nor ones packed for the CPU's GEMM.
        kernel = (blockable and kernel_backend_of(self.kernel_backend) == "nki" and not is_fp8(self.experts)
                  and getattr(self.experts, "packed_for", None) is None)
        use_blocks = kernel or (static and blockable
                                and block_count(N * k, E_r, self.block_size) * self.block_size < N * E_r)
        if use_blocks:
            y = self._blocked(x, weights, ids, ep, E_r, kernel)
        elif not static or N * k < E_r:
            if ep:
                local = ids - self._rank() * E_r
                mine = (local >= 0) & (local < E_r)
                weights = weights * mine.to(weights.dtype)
                ids = torch.where(mine, local, torch.zeros_like(local)).to(torch.int32)
            y = self.experts.gathered(x, weights, ids) if static else self.experts.looped(x, weights, ids)
        else:
            # [N, E] weights, 0 for experts not chosen: a one-hot sum over the k choices (each row's ids are distinct,
            # so every entry is one weight or 0, the values of a scatter; no scatter op in the graph).
            E = E_r * self.tp_degree if ep else E_r
            experts = torch.arange(E, dtype=torch.int32, device=x.device)
            dense = (weights[:, :, None] * (ids[:, :, None] == experts).to(weights.dtype)).sum(1)
            if ep:
                dense = dense.view(N, self.tp_degree, E_r).index_select(1, self._rank()).view(N, E_r)
            y = self.experts.dense(x, dense)
        gate = torch.sigmoid(upcast(self.shared_expert_gate(x)))
        y = y + gate * upcast(self.shared_expert(x))
        if self.tp_degree > 1:
            # Summed in the model dtype (bf16: half the bytes of the fp32 partial sums), as the dense layers'
            # row-parallel reduces; fp32 / float64 models are unchanged.
            y = upcast(self.layers.reduce(y.to(x.dtype)))
        return y.view(*shape[:-1], -1)

    def _blocked(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ep: bool, E_r: int,
                 kernel: bool = False) -> torch.Tensor:
        """The blocks form (`routed_blocks`): [N, H] fp32, the pairs of another rank's experts left out. With `kernel`,
        through `torch.ops.optimum_qwen35.moe_blocks` on the NKI kernel, which runs the filled blocks only."""
        N, H = x.shape
        if ep:
            local = ids - self._rank() * E_r
            mine = (local >= 0) & (local < E_r)
            ids = torch.where(mine, local, torch.full_like(local, E_r)).to(torch.int32)
            weights = weights * mine.to(weights.dtype)
        if kernel:
            layout = block_layout(ids, E_r, self.block_size)
            return routed_experts(x, weights, layout, self.experts.gate_up_proj, self.experts.down_proj,
                                  self.block_size, backend="nki")
        token, block_expert, pair_row, nb = routed_blocks(ids, E_r, self.block_size)
        padded = torch.cat([x, x.new_zeros(1, H)])
        rows = padded.index_select(0, token).view(nb, self.block_size, H)
        out = self.experts.blocks(rows, block_expert).reshape(nb * self.block_size, H)
        out = torch.cat([out, out.new_zeros(1, H)])  # the row of the pairs served elsewhere
        return weighted_sum(weights, out.index_select(0, pair_row).view(N, -1, H))
