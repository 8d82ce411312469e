"""`torch.ops.optimum_qwen35.moe_blocks`: the routed experts over a prompt's blocks as one `torch.library` custom op
(as the DeltaNet seams, optimum_qwen35/kernels/custom_ops.py): a graph capture records it as one node; `backend`
picks what runs: "torch" (reference.py: every block of the static bound, the fallback of the cpu target and NxD) or
"nki" (kernel.py: the filled blocks only, dynamic loops; on the NKI emulator here). Rows of blocks past the filled
ones are zeros in both (the kernel does not write them; the op zeroes them, reading the filled count from the tables).

No `from __future__ import annotations`: `torch.library.custom_op` reads the schema from the annotations."""

import numpy as np
import torch

from .layout import BlockLayout, weighted_sum
from .reference import moe_blocks_reference

NAMESPACE = "optimum_qwen35"


def _nki(x_blocks, gate_up, down, used, start, end, n_used):
    from .kernel import moe_blocks_kernel  # (deferred: the kernel binds NKI, real or emulated, only when it runs)

    x_t = x_blocks.transpose(1, 2).contiguous()
    # (A compiled model would hold the weights contraction-first; here they are transposed per call.)
    gate_up_t = gate_up.transpose(1, 2).contiguous()
    down_t = down.transpose(1, 2).contiguous()
    args = [t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
            for t in (x_t, gate_up_t, down_t, used, start, end, n_used)]
    out = moe_blocks_kernel(*args, np.zeros(x_blocks.shape, dtype=np.float32))
    return torch.from_numpy(np.asarray(out, dtype=np.float32))


@torch.library.custom_op(f"{NAMESPACE}::moe_blocks", mutates_args=())
def moe_blocks(x_blocks: torch.Tensor, block_expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               used: torch.Tensor, start: torch.Tensor, end: torch.Tensor, n_used: torch.Tensor,
               backend: str) -> torch.Tensor:
    nb = x_blocks.shape[0]
    if backend == "torch":
        out = moe_blocks_reference(x_blocks, block_expert, gate_up, down)
    elif backend == "nki":
        out = _nki(x_blocks, gate_up, down, used, start, end, n_used)
    else:
        raise ValueError(f"moe_blocks backend {backend!r}: pass 'torch' or 'nki'")
    filled = (end - start).sum()  # rows of unused entries are 0 - 0
    keep = (torch.arange(nb, device=out.device) < filled).to(out.dtype)[:, None, None]
    return (out * keep).contiguous()


@moe_blocks.register_fake
def _(x_blocks, block_expert, gate_up, down, used, start, end, n_used, backend):
    acc = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    return x_blocks.new_empty(x_blocks.shape, dtype=acc)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, layout: BlockLayout, gate_up: torch.Tensor,
                   down: torch.Tensor, block_size: int, backend: str = "torch") -> torch.Tensor:
    """x [N, H], the pairs' weights [N, k] -> [N, H] fp32: the blocks form of `SparseMoeBlock._blocked` through the op."""
    N, H = x.shape
    nb = layout.nb
    rows = torch.cat([x, x.new_zeros(1, H)]).index_select(0, layout.token).view(nb, block_size, H)
    out = torch.ops.optimum_qwen35.moe_blocks(rows, layout.block_expert, gate_up, down, layout.used, layout.start,
                                              layout.end, layout.n_used, backend)
    out = torch.cat([out.reshape(nb * block_size, H), out.new_zeros(1, H)])
    return weighted_sum(weights, out.index_select(0, layout.pair_row).view(N, -1, H))
