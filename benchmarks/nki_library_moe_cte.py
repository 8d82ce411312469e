"""The NKI Library's MoE context-encoding kernels (`bwmm_shard_on_block`; the dynamic `shard_on_i_hybrid`) against
ours (kernels/moe_blockwise), on the emulator, at the 35B-A3B's routing (issue 51 item 1).

    python benchmarks/nki_library_moe_cte.py --nkilib /tmp/nkilib/src/nkilib_src          # 1024 and 4096 tokens
    python benchmarks/nki_library_moe_cte.py --nkilib DIR --tokens 1024 --check-tokens 128 --hidden 512

`--nkilib` is a directory holding the library's `nkilib` package (or a checkout whose `src/nkilib_src` does). Nothing
of the library is in this repository: the kernels are imported from there, unmodified, with the emulator installed
as `nki` (docs/moe.md, "Against the NKI Library's MoE CTE kernels", says which repository and commit were run).

Both kernels take the same blocked layout (kernels/moe_blockwise/layout.py `routed_blocks`: pairs sorted by expert,
blocks of B rows, token N for a padding row, the padding blocks after the filled ones on the last expert; the
library's test builds the same one, `generate_token_position_to_id_and_experts`), the same bf16 hidden states and
weights (theirs in its [E, H, 2, I] / [E, I, H] layout, ours contraction-first), and the same routing weights
(theirs as the dense [(N + 1) E, 1] affinities, applied in the kernel; ours applied after, as `routed_experts`).

It prints:

* the largest error of each against the all-experts form (every token through every expert, weight 0 for the
  unchosen, fp32 from the bf16 values) at `--check-tokens` tokens, and of theirs against ours at each length;
* per length and block size: blocks run (theirs: its static loop over every block of the bound, `NUM_STATIC_BLOCKS =
  N`; ours: the filled ones, read from the cost report), rows computed / routed pairs, and the cost-model time
  (trn2) against the top-k minimum of benchmarks/moe_blockwise_kernel.py (ours on a balanced routing whose blocks are
  all full). Theirs runs at LNC=2 (two physical cores, blocks alternating between them; it needs two for its top-k
  accumulation), ours at LNC=1: both wall times are printed, and theirs x 2 in core-microseconds. Theirs gathers
  the block rows and adds the weighted outputs into the result inside the kernel; ours takes gathered blocks and
  leaves the weighted sum to the graph (`routed_experts`): a line adds that data movement to ours as a DMA-time
  floor (`outside_floor_us`), against the minimum plus its own (the N k rows gathered, the same weighted sum).

A second table runs their dynamic kernel, `blockwise_mm_baseline_shard_intermediate_hybrid` (shard_on_i_hybrid:
I split between the two cores, a static loop over N - E blocks then `nl.dynamic_range` up to the filled count), at
B = 256 and I_r = `--hybrid-inter` (256, the 35B-A3B at TP 2: it needs I_r / 2 >= 128), beside ours and the minimum
at that width.

Their kernel's PSUM allocations exceed 16 KiB per partition while Python still holds earlier tiles (the emulator
counts a tile live while the kernel's Python can reach it, docs/nki_emulator.md "Liveness"): it runs with
`capacity="spill"`, and the excess is printed (PSUM has nothing to spill to; the compiler frees tiles at their last
use). It also runs with `uninitialized="nan"`: its output initialization skips a last tile of one row (`if
num_elements != 1` in `bwmm_output_initialization`), which with N + 1 = 128 m + 1 rows is the padding row N, and a
block of padding rows then reads that row before anything wrote it (a device reads whatever HBM held, into the padding
row only, which is discarded); the rows of the tokens are checked finite and against the reference.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys
import time

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from optimum_qwen35.kernels.emulator import cost, estimate, install_as_nki, rules  # noqa: E402
from optimum_qwen35.kernels.moe_blockwise.kernel import moe_blocks_kernel  # noqa: E402
from optimum_qwen35.kernels.moe_blockwise.layout import block_layout, weighted_sum  # noqa: E402

E, K, I = 256, 8, 128  # the 35B-A3B at TP 4: 256 local experts, top 8, moe_intermediate_size 512 / 4
BF16 = ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------------------------- library
def load_library(path: str):
    """Import `nkilib.core.moe.moe_cte.bwmm_shard_on_block` from `path` (the directory holding `nkilib`, or a checkout
    with `src/nkilib_src`), with the emulator installed as `nki`. Returns the kernel."""
    root = pathlib.Path(path)
    if not (root / "nkilib").is_dir() and (root / "src" / "nkilib_src" / "nkilib").is_dir():
        root = root / "src" / "nkilib_src"
    if not (root / "nkilib" / "core" / "moe" / "moe_cte" / "bwmm_shard_on_block.py").is_file():
        raise FileNotFoundError(f"no nkilib/core/moe/moe_cte/bwmm_shard_on_block.py under {path}")
    install_as_nki(legacy=False)
    for name in [n for n in sys.modules if n == "nkilib" or n.startswith("nkilib.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    return importlib.import_module("nkilib.core.moe.moe_cte.bwmm_shard_on_block").bwmm_shard_on_block


# -------------------------------------------------------------------------------------------------------- inputs
def inputs(tokens: int, hidden: int, block: int, kind: str = "uniform", experts: int = E, top_k: int = K,
           inter: int = I, seed: int = 0) -> dict:
    """A prompt's routed experts: ids [N, k], routing weights [N, k] (softmax over the chosen logits), bf16 hidden
    states [N, H] and weights in the model's layout (gate_up [E, 2I, H], down [E, H, I]), and the blocked layout."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":  # token t takes experts (k t + j) mod E: every expert exactly N k / E pairs
        ids = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % experts
        logits = torch.randn(tokens, top_k, generator=g)
    elif kind == "skewed":  # every token on experts 0 .. k-1: the fewest filled blocks, the most padding
        ids = torch.arange(top_k)[None, :].expand(tokens, top_k)
        logits = torch.randn(tokens, top_k, generator=g)
    else:  # uniform: top k of seeded Gaussian router logits
        router = torch.randn(tokens, experts, generator=g)
        logits, ids = router.topk(top_k, -1)
    w = torch.softmax(logits, -1)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(torch.bfloat16)
    ids = ids.to(torch.int32)
    return {"ids": ids, "w": w, "x": x, "gate_up": gate_up, "down": down, "B": block,
            "layout": block_layout(ids, experts, block)}


def all_experts(inp: dict) -> torch.Tensor:
    """[N, H] fp32: every token through every expert, weighted (0 for the experts it did not choose)."""
    x, gate_up, down = inp["x"].float(), inp["gate_up"].float(), inp["down"].float()
    n_e, inter = gate_up.shape[0], down.shape[-1]
    dense = torch.zeros(x.shape[0], n_e).scatter_(1, inp["ids"].long(), inp["w"])
    out = torch.zeros(x.shape)
    for e in range(n_e):  # one expert at a time: [N, E, H] at once would not fit at 4,096 tokens
        h = x @ gate_up[e].T
        out += dense[:, e:e + 1] * ((F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].T)
    return out


# ------------------------------------------------------------------------------------------------------- kernels
def theirs(kernel, inp: dict, compute: bool = True, skip_weight: bool = False):
    """Their `bwmm_shard_on_block` at LNC=2 on the layout (`skip_weight`: its `SkipMode(skip_weight=True)`, which
    does not load the weights again for a core's block of the same expert as its previous one). Returns ([N, H]
    fp32 or None, cost report, blocks)."""
    skip = sys.modules["nkilib.core.moe.moe_cte.moe_cte_utils"].SkipMode(False, skip_weight)
    x, lay, B = inp["x"], inp["layout"], inp["B"]
    tokens = x.shape[0]
    hidden_states, affinities, gate_up, down = _their_inputs(inp)
    out, report = estimate(kernel, hidden_states, affinities, gate_up, down, B, lay.token.numpy(),
                           lay.block_expert.numpy().reshape(-1, 1), skip_dma=skip, grid=2, target="trn2",
                           capacity="spill", uninitialized="nan", compute=compute)
    result = None
    if compute:  # [N + 1, 2, H]: its final step adds the two cores' halves into slot 0 and zeroes slot 1
        result = torch.from_numpy(np.asarray(out, np.float32)[:tokens].sum(1))
    return result, report, lay.nb


def theirs_hybrid(inp: dict, compute: bool = True):
    """Their dynamic kernel `blockwise_mm_baseline_shard_intermediate_hybrid` (shard_on_i_hybrid) at LNC=2: I split
    between the cores (each block's partial down projections exchanged with `sendrecv`), a static loop over the
    N - E blocks every routing fills, then `nl.dynamic_range` up to the filled count (`conditions`: 1 per filled
    block, in order). Needs B a multiple of 256 and I / 2 >= 128. Returns ([N, H] fp32 or None, report, filled)."""
    kernel = sys.modules["nkilib.core.moe.moe_cte.bwmm_shard_on_I"].blockwise_mm_baseline_shard_intermediate_hybrid
    hidden_states, affinities, gate_up, down = _their_inputs(inp)
    lay = inp["layout"]
    conditions = np.zeros(lay.nb + 1, np.int32)
    conditions[: int(lay.filled)] = 1
    out, report = estimate(kernel, conditions, hidden_states, affinities, gate_up, down, inp["B"], lay.token.numpy(),
                           lay.block_expert.numpy().reshape(-1, 1), grid=2, target="trn2", capacity="spill",
                           uninitialized="nan", compute=compute)
    result = torch.from_numpy(np.asarray(out, np.float32)[: inp["x"].shape[0]]) if compute else None
    return result, report, int(lay.filled)


def _their_inputs(inp: dict):
    """The library's layouts: hidden states [N + 1, H] (row N the padding row), dense affinities [(N + 1) E, 1],
    gate_up [E, H, 2, I], down [E, I, H], all bf16."""
    x = inp["x"]
    tokens, hidden = x.shape
    n_e, inter = inp["gate_up"].shape[0], inp["down"].shape[-1]
    hidden_states = np.zeros((tokens + 1, hidden), BF16)
    hidden_states[:tokens] = x.float().numpy().astype(BF16)
    affinities = np.zeros((tokens + 1, n_e), np.float32)
    np.put_along_axis(affinities[:tokens], inp["ids"].long().numpy(), inp["w"].numpy(), axis=1)
    gate_up = inp["gate_up"].float().view(n_e, 2, inter, hidden).permute(0, 3, 1, 2).numpy().astype(BF16)
    down = inp["down"].float().transpose(1, 2).numpy().astype(BF16)
    return hidden_states, affinities.astype(BF16).reshape(-1, 1), gate_up, down


def ours(inp: dict, compute: bool = True):
    """Our `moe_blocks_kernel` (LNC=1) on the layout, the weighted sum after. Returns ([N, H] fp32, report,
    executed blocks read from the report)."""
    x, lay, B = inp["x"], inp["layout"], inp["B"]
    tokens, hidden = x.shape
    rows = torch.cat([x, x.new_zeros(1, hidden)]).index_select(0, lay.token).view(lay.nb, B, hidden)
    args = [t.float().numpy() for t in (rows.transpose(1, 2).contiguous(), inp["gate_up"].transpose(1, 2).contiguous(),
                                        inp["down"].transpose(1, 2).contiguous())]
    out = np.zeros((lay.nb, B, hidden), np.float32)
    _, report = estimate(moe_blocks_kernel, *[a.astype(BF16) for a in args], lay.used.numpy(), lay.start.numpy(),
                         lay.end.numpy(), lay.n_used.numpy(), out, target="trn2", compute=compute)
    # TensorE records per block (benchmarks/moe_blockwise_kernel.py): per I tile, gate and up over the H tiles and
    # down over the 512-column chunks, each a LoadStationary and a MultiplyMoving
    per_block = 2 * (-(-inp["down"].shape[-1] // 128)) * (2 * (-(-hidden // 128)) + (-(-hidden // 512)))
    executed = report.instructions["tensor"] / per_block
    flat = torch.cat([torch.from_numpy(out).reshape(lay.nb * B, hidden), torch.zeros(1, hidden)])
    result = weighted_sum(inp["w"], flat.index_select(0, lay.pair_row).view(tokens, -1, hidden))
    return result, report, executed


def outside_floor_us(tokens: int, hidden: int, nb: int, block: int, top_k: int = K) -> float:
    """What ours leaves to the graph around it and theirs does inside, as a DMA-time floor (trn2, mid parameters):
    the gather of the hidden rows into the bound's blocks (bf16, read and written: `routed_experts` materializes
    every block of the static bound) and the weighted sum (the pairs' fp32 outputs read, the [N, H] fp32 result
    written)."""
    nbytes = 2 * nb * block * hidden * 2 + tokens * top_k * hidden * 4 + tokens * hidden * 4
    return nbytes / cost.dma_bandwidth(rules.TRN2) * 1e6


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return float((got - want).abs().max()), float(want.abs().max())


def fmt(err: tuple[float, float]) -> str:
    return f"{err[0]:.2e} (of {err[1]:.2f}, {err[0] / max(err[1], 1e-30):.1e} relative)"


# ---------------------------------------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nkilib", default=os.environ.get("OPTIMUM_QWEN35_NKILIB"),
                        help="directory holding the NKI Library's `nkilib` package (or a checkout's root)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--blocks", type=int, nargs="*", default=[64, 128, 256],
                        help="block sizes (theirs: multiples of 128; ours: at most 128)")
    parser.add_argument("--hidden", type=int, default=512, help="H (2,048 in the model; scaled as in "
                        "benchmarks/moe_blockwise_kernel.py)")
    parser.add_argument("--skip-weight", action="store_true", help="also run theirs with SkipMode(skip_weight=True)")
    parser.add_argument("--hybrid-inter", type=int, default=256, help="I_r of the shard_on_i_hybrid table (it needs "
                        "I_r / 2 >= 128; 0: no such table)")
    parser.add_argument("--check-tokens", type=int, default=256, help="length of the all-experts check (0: none)")
    args = parser.parse_args()
    if not args.nkilib:
        parser.error("--nkilib PATH is required (the NKI Library is not part of this repository)")
    torch.set_num_threads(1)
    kernel = load_library(args.nkilib)
    print(f"NKI Library bwmm_shard_on_block from {sys.modules['nkilib.core.moe.moe_cte.bwmm_shard_on_block'].__file__}")
    print(f"35B-A3B routing at TP 4 (E_r = {E}, top {K}, I_r = {I}), hidden {args.hidden}; trn2 cost model, bf16")
    t0 = time.time()
    if args.check_tokens:
        inp = inputs(args.check_tokens, args.hidden, 128)
        want = all_experts(inp)
        print(f"\nagainst the all-experts form at {args.check_tokens} tokens, B = 128: theirs "
              f"{fmt(max_error(theirs(kernel, inp)[0], want))}; ours {fmt(max_error(ours(inp)[0], want))}"
              f"  [{time.time() - t0:.0f} s]")
    notes = []
    print("\n| tokens | B | kernel | blocks run (bound) | rows / routed pairs | us (wall) | core-us | vs minimum |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        floor = ours(inputs(tokens, args.hidden, tokens * K // E, "balanced"))[1].total_us
        floor_outside = outside_floor_us(tokens, args.hidden, E, tokens * K // E)  # E full blocks: N k rows
        print(f"| {tokens} | {tokens * K // E} | ours, balanced routing (the minimum) | - | 1.00 | {floor:.0f} | "
              f"{floor:.0f} | 1.00 |")
        for B in args.blocks:
            inp = inputs(tokens, args.hidden, B)
            lay, pairs = inp["layout"], tokens * K
            t1 = time.time()
            got_t = got_o = None
            modes = [False, True] if args.skip_weight else [False]
            for skip_weight in (modes if B % 128 == 0 else []):  # theirs: whole 128-row tiles per block
                got, rep_t, run_t = theirs(kernel, inp, skip_weight=skip_weight)
                got_t = got if got_t is None else got_t
                label = "theirs, skip_weight (LNC=2)" if skip_weight else "theirs (LNC=2)"
                print(f"| {tokens} | {B} | {label} | {run_t} ({lay.nb}) | {run_t * B / pairs:.2f} | "
                      f"{rep_t.total_us:.0f} | {2 * rep_t.total_us:.0f} | {rep_t.total_us / floor:.2f} "
                      f"({rep_t.total_us / (floor + floor_outside):.2f} against the minimum's own gather and "
                      "combine added) |")
                notes.append(f"{tokens} tokens, B = {B}, {label}: PSUM over capacity "
                             f"{rep_t.over_capacity_bytes.get('psum', 0)} B/partition, SBUF "
                             f"{rep_t.over_capacity_bytes.get('sbuf', 0)}; DMA {rep_t.dma_bytes / 1e6:.1f} MB; "
                             f"against its run without skip_weight {fmt(max_error(got, got_t))}")
            if B <= 128:  # ours: at most one 128-partition tile of rows per block
                got_o, rep_o, run_o = ours(inp)
                assert run_o == int(lay.filled), (run_o, int(lay.filled))
                print(f"| {tokens} | {B} | ours (LNC=1) | {run_o:.0f} ({lay.nb}) | {run_o * B / pairs:.2f} | "
                      f"{rep_o.total_us:.0f} | {rep_o.total_us:.0f} | {rep_o.total_us / floor:.2f} |")
                extra = outside_floor_us(tokens, args.hidden, lay.nb, B)
                print(f"| {tokens} | {B} | ours + gather and combine (DMA floor; vs the minimum's own) | | | "
                      f"{rep_o.total_us + extra:.0f} | {rep_o.total_us + extra:.0f} | "
                      f"{(rep_o.total_us + extra) / (floor + floor_outside):.2f} |")
                notes.append(f"{tokens} tokens, B = {B}: our DMA {rep_o.dma_bytes / 1e6:.1f} MB")
            if got_t is not None and got_o is not None:
                notes.append(f"{tokens} tokens, B = {B}: theirs against ours {fmt(max_error(got_t, got_o))}")
            notes[-1] += f"  [{time.time() - t1:.0f} s]"
    print("\n" + "\n".join(notes))
    if args.hybrid_inter:
        hybrid_table(args.tokens, args.hidden, args.hybrid_inter)


def hybrid_table(token_counts, hidden: int, inter: int):
    """Their dynamic kernel (shard_on_i_hybrid, B = 256) beside ours at I_r = `inter` (256: the 35B-A3B at TP 2)."""
    print(f"\nshard_on_i_hybrid (their dynamic loop) at I_r = {inter}, B = 256, against ours at that width:")
    print("\n| tokens | B | kernel | blocks run (bound) | rows / routed pairs | us (wall) | core-us | vs minimum |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in token_counts:
        floor = ours(inputs(tokens, hidden, tokens * K // E, "balanced", inter=inter))[1].total_us
        print(f"| {tokens} | {tokens * K // E} | ours, balanced routing (the minimum) | - | 1.00 | {floor:.0f} | "
              f"{floor:.0f} | 1.00 |")
        t1 = time.time()
        inp = inputs(tokens, hidden, 256, inter=inter)
        got_h, rep_h, run_h = theirs_hybrid(inp)
        lay, pairs = inp["layout"], tokens * K
        print(f"| {tokens} | 256 | theirs, shard_on_i_hybrid (LNC=2) | {run_h} ({lay.nb}) | "
              f"{run_h * 256 / pairs:.2f} | {rep_h.total_us:.0f} | {2 * rep_h.total_us:.0f} | "
              f"{rep_h.total_us / floor:.2f} |")
        for B in (64, 128):
            inp_o = inputs(tokens, hidden, B, inter=inter)
            got_o, rep_o, run_o = ours(inp_o)
            print(f"| {tokens} | {B} | ours (LNC=1) | {run_o:.0f} ({inp_o['layout'].nb}) | {run_o * B / pairs:.2f} | "
                  f"{rep_o.total_us:.0f} | {rep_o.total_us:.0f} | {rep_o.total_us / floor:.2f} |")
        print(f"|  |  | theirs against ours (B = 128): {fmt(max_error(got_h, got_o))}; DMA theirs "
              f"{rep_h.dma_bytes / 1e6:.1f} MB, ours {rep_o.dma_bytes / 1e6:.1f} MB; PSUM over capacity "
              f"{rep_h.over_capacity_bytes.get('psum', 0)}  [{time.time() - t1:.0f} s] | | | | | |")

if __name__ == "__main__":
    main()
