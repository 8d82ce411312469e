"""The NKI Library's GDN kernels (`gdn_tkg`, `gdn_block_tkg`, `gdn_cte`) against ours, on the emulator, at the 2B layer.

    python benchmarks/nki_library_gdn.py --nkilib /tmp/nkilib-gdn/src/nkilib_src            # decode b1, b8; cte 1024, 4096
    python benchmarks/nki_library_gdn.py --nkilib DIR --tokens 1024 --check-tokens 256 --no-ranges

`--nkilib` is a directory holding the library's `nkilib` package (or a checkout whose `src/nkilib_src` does). Nothing
of the library is in this repository: the kernels are imported from there, unmodified, with the emulator installed as
`nki` (docs/kernels.md, "Against the NKI Library's GDN kernels", says which repository and commit were run).

For each of their kernels it prints:

* the largest error against our torch reference (kernels/gated_delta_rule/reference.py, float64), on random inputs
  in the kernels' own contracts at the 2B layer's head layout (16 key and value heads, dk = dv = 128; H = 2048),
  with a nonzero initial state: `gdn_tkg` and `gdn_block_tkg` at batch 1 and 8, `gdn_cte` at `--check-tokens`
  tokens; ours on the same inputs beside it;
* the cost-model time (trn2, one rank) of theirs and ours at the 2B layer, and their ratio at the middle of the cost
  model's parameters with its range over them (kernels/emulator/cost.py PARAMETERS: each parameter at its low and high
  end, all low, all high, and the envelope, as benchmarks/nki_cost_model.py --sensitivity does).

What is compared with what (the kernels do not cut the layer at the same places):

* decode: ours (`gated_delta_rule_tkg`: conv, SiLU, q/k norm, gates, the rule, one launch) against their
  `gdn_conv1d_decode` + `gdn_tkg` (two launches: conv + SiLU; then norms, gates, the rule and the gated RMSNorm; their
  q, k arrive GQA-expanded and the conv output is split into them outside the kernels), and against `gdn_tkg` alone;
* the decode block: `gdn_block_tkg` (in_proj of q|k|v, z, a, b + conv + rule + gated RMSNorm) against ours plus the
  projection's floor: its bf16 weights read once at the model's DMA rate (the projections are outside our kernel);
* prefill: `gdn_cte` (normalized q, k and the gates g, beta in; the Schur solve, its default) against ours
  (`gated_delta_rule_cte`: raw q, k, a, b in, norms and gates inside), both launched at LNC=2 (their kernel splits
  its (batch, head) lanes over the programs, ours its heads) and at LNC=1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pathlib
import sys
import time
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch

from optimum_qwen35.kernels.emulator import cost, estimate, install_as_nki, rules
from optimum_qwen35.kernels.gated_delta_rule import fused
from optimum_qwen35.kernels.gated_delta_rule.cte import gated_delta_rule_cte, solve_masks
from optimum_qwen35.kernels.gated_delta_rule.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule_step
from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

NK = NV = 16
DK = DV = 128
KW = 4  # conv kernel
HIDDEN = 2048
C = 2 * NK * DK + NV * DV  # conv channels [q | k | v]
EPS = 1e-6  # rms_norm_eps of the Qwen3.5 configs; their gdn_tkg's norm epsilon
BF16 = ml_dtypes.bfloat16
TRN2 = rules.TRN2


# ------------------------------------------------------------------------------------------------------- library
def load_library(path: str):
    """Import `nkilib.experimental.gdn` from `path` (the directory holding `nkilib`, or a checkout with
    `src/nkilib_src`), with the emulator installed as `nki`. Returns the module."""
    root = pathlib.Path(path)
    if not (root / "nkilib").is_dir() and (root / "src" / "nkilib_src" / "nkilib").is_dir():
        root = root / "src" / "nkilib_src"
    if not (root / "nkilib" / "experimental" / "gdn").is_dir():
        raise FileNotFoundError(f"no nkilib/experimental/gdn under {path}")
    install_as_nki(legacy=False)
    for name in [n for n in sys.modules if n == "nkilib" or n.startswith("nkilib.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    return importlib.import_module("nkilib.experimental.gdn")


# -------------------------------------------------------------------------------------------- comparison logic
def max_error(got, want) -> tuple[float, float]:
    """(largest |got - want|, largest |want|), in float64."""
    got = np.asarray(torch.as_tensor(np.asarray(got, np.float64) if not isinstance(got, torch.Tensor) else got,
                                     dtype=torch.float64))
    want = np.asarray(torch.as_tensor(want, dtype=torch.float64))
    return float(np.abs(got - want).max()), float(np.abs(want).max())


def fmt_error(err: tuple[float, float]) -> str:
    return f"{err[0]:.2e} (of {err[1]:.2f}, {err[0] / max(err[1], 1e-30):.1e} relative)"


@dataclass
class Comparison:
    """Theirs against ours under the cost model: each side a list of traces (launches run one after the other, their
    times add) and a time in us that is not a trace (a floor, given as a function of the cost parameters)."""

    name: str
    theirs: list
    ours: list
    ours_floor: object = None  # callable(params) -> us, or None
    spills: tuple = ()  # SPILLS keys of their launches here

    def times(self, params=cost.DEFAULT_PARAMS) -> tuple[float, float]:
        theirs = sum(t.report(params).total_us for t in self.theirs)
        ours = sum(t.report(params).total_us for t in self.ours)
        if self.ours_floor is not None:
            ours += self.ours_floor(params)
        return theirs, ours

    def ratio(self, params=cost.DEFAULT_PARAMS) -> float:
        theirs, ours = self.times(params)
        return theirs / ours


@dataclass
class Ranges:
    """A figure at the middle of the cost model's parameters and its range over them."""

    mid: float
    low: float
    high: float
    movers: list = field(default_factory=list)  # (parameter, value at its low end, at its high end), largest first


def sweep(figure, parameters=None) -> Ranges:
    """`figure(params) -> float` over the cost parameters: the hull of one-parameter-at-a-time extremes (the
    envelope: each parameter at whichever end lowers, then raises, the figure), all low and all high."""
    varied = [p for p in (parameters if parameters is not None else cost.PARAMETERS) if p.low != p.high]
    mid = figure(cost.DEFAULT_PARAMS)
    ends = {p.field: (figure(cost.DEFAULT_PARAMS.with_value(p.field, p.low)),
                      figure(cost.DEFAULT_PARAMS.with_value(p.field, p.high))) for p in varied}
    candidates = [mid]
    for pick in (lambda p: p.low, lambda p: p.high):
        params = cost.DEFAULT_PARAMS
        for p in varied:
            params = params.with_value(p.field, pick(p))
        candidates.append(figure(params))
    for better in (min, max):
        params = cost.DEFAULT_PARAMS
        for p in varied:
            lo, hi = ends[p.field]
            params = params.with_value(p.field, p.low if better(lo, hi) == lo else p.high)
        candidates.append(figure(params))
    movers = sorted(((f, lo, hi) for f, (lo, hi) in ends.items() if abs(hi - lo) > 1e-9 * max(abs(mid), 1)),
                    key=lambda m: -abs(m[2] - m[1]))
    return Ranges(mid, min(candidates), max(candidates), movers[:3])


def projection_floor_us(params=cost.DEFAULT_PARAMS) -> float:
    """The DeltaNet in_proj (q|k|v, z, a, b) of the 2B layer: its bf16 weights read once at the model's DMA rate."""
    nbytes = HIDDEN * (C + NV * DV + 2 * NV) * 2
    return nbytes / cost.dma_bandwidth(TRN2, params) * 1e6


# ------------------------------------------------------------------------------------------- inputs, references
def _rng(seed):
    return np.random.default_rng(seed)


def decode_inputs(batch: int, seed: int = 0) -> dict:
    """Raw decode inputs at the 2B layer in our layouts (activations bf16, states fp32, weights as the model holds
    them): the token's in_proj outputs, the gate parameters, the conv weights and the rows' initial states."""
    r = _rng(seed)
    return {
        "mixed": r.standard_normal((batch, C)).astype(BF16),
        "z": r.standard_normal((batch, NV * DV)).astype(BF16),
        "a": r.standard_normal((batch, NV)).astype(BF16),
        "b": r.standard_normal((batch, NV)).astype(BF16),
        "A_log": np.log(r.uniform(1, 16, NV)).astype(np.float32),
        "dt_bias": r.standard_normal(NV).astype(np.float32),
        "conv_weight": (0.5 * r.standard_normal((C, KW))).astype(np.float32),
        "conv_state": r.standard_normal((batch, C, KW)).astype(BF16),  # the last KW tokens (theirs keeps KW)
        "norm_weight": (1 + 0.1 * r.standard_normal(DV)).astype(np.float32),
        "state": (0.1 * r.standard_normal((batch, NV, DK, DV))).astype(np.float32),
    }


def _t(x, dtype=torch.float64):
    return torch.from_numpy(np.asarray(x).astype(np.float32)).to(dtype)


def gated_norm(o, z, w):
    """The model's DeltaNet output norm (modeling/layers.py GatedRMSNorm: w * rmsnorm(o) * silu(z)), float64."""
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)
    return w * o * torch.nn.functional.silu(z)


def decode_reference(x: dict, mixed=None, z=None, a=None, b=None):
    """Our reference of a decode step from `x` (float64): the conv over the last KW - 1 tokens and this one, SiLU,
    q/k l2 norm (q scaled by dk^-0.5), the gates, the recurrent step; returns (o before the norm [B, nv, dv],
    gated-norm output [B, nv, dv], new state, the conv output [B, C]). `mixed`, `z`, `a`, `b` replace x's (the block
    computes them from the hidden state)."""
    mixed = _t(x["mixed"]) if mixed is None else mixed
    z = _t(x["z"]) if z is None else z
    a = _t(x["a"]) if a is None else a
    b = _t(x["b"]) if b is None else b
    B = mixed.shape[0]
    window = torch.cat([_t(x["conv_state"])[:, :, 1:], mixed[:, :, None]], dim=-1)  # [B, C, KW]
    conv = torch.nn.functional.silu((window * _t(x["conv_weight"])[None]).sum(-1))
    q, k, v = torch.split(conv, [NK * DK, NK * DK, NV * DV], dim=-1)
    q = fused.l2norm(q.reshape(B, NK, 1, DK)) * DK ** -0.5
    k = fused.l2norm(k.reshape(B, NK, 1, DK))
    v = v.reshape(B, NV, 1, DV)
    g, beta = fused.gates(a, b, _t(x["A_log"]), _t(x["dt_bias"]))
    o, state = recurrent_gated_delta_rule_step(q, k, v, g[:, :, None], beta[:, :, None], _t(x["state"]))
    o = o[:, :, 0]
    return o, gated_norm(o, z.reshape(B, NV, DV), _t(x["norm_weight"])), state, conv


def prefill_inputs(tokens: int, seed: int = 0) -> dict:
    """Raw prefill inputs at the 2B layer in our layouts (q, k, v after the conv and SiLU, before the norms; raw a, b;
    an initial state)."""
    r = _rng(seed)
    return {
        "q": r.standard_normal((1, NK, tokens, DK)).astype(BF16),
        "k": r.standard_normal((1, NK, tokens, DK)).astype(BF16),
        "v": r.standard_normal((1, NV, tokens, DV)).astype(BF16),
        "a": r.standard_normal((1, tokens, NV)).astype(BF16),
        "b": r.standard_normal((1, tokens, NV)).astype(BF16),
        "A_log": np.log(r.uniform(1, 16, NV)).astype(np.float32),
        "dt_bias": r.standard_normal(NV).astype(np.float32),
        "state": (0.1 * r.standard_normal((1, NV, DK, DV))).astype(np.float32),
    }


def prefill_reference(x: dict):
    """(q, k normalized (q not scaled), g, beta [1, nv, T], o, final state), float64, by our chunked reference."""
    q = fused.l2norm(_t(x["q"]))
    k = fused.l2norm(_t(x["k"]))
    g, beta = fused.gates(_t(x["a"]), _t(x["b"]), _t(x["A_log"]), _t(x["dt_bias"]))  # [1, T, nv]
    g, beta = g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous()
    o, state = chunk_gated_delta_rule(q * DK ** -0.5, k, _t(x["v"]), g, beta, _t(x["state"]))
    return q, k, g, beta, o, state


# ------------------------------------------------------------------------------------------------ our kernels
def _quiet(compute):
    """compute=False launches carry the emulator's NaN fill through the arithmetic: no warnings from that."""
    return contextlib.nullcontext() if compute else np.errstate(invalid="ignore")


def ours_decode(x: dict, compute=True):
    """Our decode kernel on `x`: (o [B, nv, dv], conv state [B, C, KW - 1], state), and its trace."""
    with _quiet(compute):
        out, _ = estimate(gated_delta_rule_tkg, x["mixed"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                          x["conv_weight"].astype(BF16), np.ascontiguousarray(x["conv_state"][:, :, 1:]), x["state"],
                          target="trn2", compute=compute)
    return out, cost.last_trace()


def ours_prefill(x: dict, lnc: int, compute=True):
    tokens = x["q"].shape[2]
    with _quiet(compute):
        out, _ = estimate(gated_delta_rule_cte, x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                          x["state"], np.full((1, 1), tokens, np.int32), solve_masks(), "auto", target="trn2",
                          compute=compute, grid=lnc)
    return out, cost.last_trace()


# ---------------------------------------------------------------------------------------------- their kernels
SPILLS: dict = {}  # kernel launch name -> SBUF bytes per partition over trn2's capacity (the last launch's)


def _theirs(name, kernel, *args, grid=None, compute=True, **kwargs):
    """Launch one of their kernels with SBUF overflow recorded, not raised (`capacity="spill"`: the cost model does
    not charge the spill traffic, so the time of a launch that overflows is a lower bound)."""
    with _quiet(compute):
        out, report = estimate(kernel, *args, target="trn2", compute=compute, grid=grid, capacity="spill", **kwargs)
    SPILLS[name] = report.over_capacity_bytes.get("sbuf", 0)
    return out, cost.last_trace()


def _expand(x, batch):
    """[B, nk * d] -> [B * nv, d]: their flat, GQA-expanded head layout (v-head fastest)."""
    return np.ascontiguousarray(x.reshape(batch, NK, -1).repeat(NV // NK, axis=1).reshape(batch * NV, -1))


def theirs_tkg(gdn, x: dict, conv, compute=True, lnc=1):
    """`gdn_tkg` on the conv output `conv` [B, C] (bf16, as their conv kernel returns it): (out [B*nv, dv] after the
    gated norm, state [B*nv, dk, dv]), and its trace."""
    B = conv.shape[0]
    q, k, v = np.split(conv, [NK * DK, 2 * NK * DK], axis=1)
    args = (_expand(q, B), _expand(k, B), np.ascontiguousarray(v.reshape(B * NV, DV)),
            x["b"].astype(np.float32).reshape(B * NV), x["a"].astype(np.float32).reshape(B * NV), x["A_log"],
            x["dt_bias"], np.ascontiguousarray(x["z"].reshape(B * NV, DV)), x["norm_weight"],
            np.ascontiguousarray(x["state"].reshape(B * NV, DK, DV)))
    return _theirs(f"gdn_tkg b{B} LNC={lnc}", gdn.gdn_tkg, *args, grid=lnc, compute=compute)


def theirs_conv(gdn, x: dict, compute=True):
    """`gdn_conv1d_decode`: (conv output [B, C, 1], new window [B, C, KW]) and its trace."""
    B = x["mixed"].shape[0]
    return _theirs(f"gdn_conv1d_decode b{B}", gdn.gdn_conv1d_decode, np.ascontiguousarray(x["mixed"][:, :, None]),
                   x["conv_state"], x["conv_weight"], compute=compute)


def block_weights(seed: int = 1) -> dict:
    """in_proj weights of the 2B layer as [H, out] bf16 (nn.Linear.weight.T), and a hidden state per row."""
    r = _rng(seed)
    w = lambda n: (r.standard_normal((HIDDEN, n)) / np.sqrt(HIDDEN)).astype(BF16)  # noqa: E731
    return {"qkv": w(C), "z": w(NV * DV), "a": w(NV), "b": w(NV)}


def theirs_block(gdn, x: dict, hidden, w: dict, compute=True):
    return _theirs(f"gdn_block_tkg b{hidden.shape[0]}", gdn.gdn_block_tkg, hidden, w["qkv"], w["z"], w["a"], w["b"],
                   x["conv_weight"], x["conv_state"], x["A_log"], x["dt_bias"], x["norm_weight"], x["state"],
                   compute=compute)


def theirs_cte(gdn, q, k, v, g, beta, state, lnc: int, compute=True):
    """`gdn_cte` (Schur, its default) with an initial state: (o [1, nv, T, dv], final state) and its trace."""
    return _theirs(f"gdn_cte {q.shape[2]} LNC={lnc}", gdn.gdn_cte, q, k, v, g, beta, DK ** -0.5,
                   mask_pack=gdn.build_mask_pack(), recurrent_state=state, grid=lnc, compute=compute)


# ------------------------------------------------------------------------------------------------------- checks
def check_decode(gdn, batch: int) -> dict:
    """Errors of theirs (conv + tkg, and the block) and ours against the reference, at `batch` rows."""
    x = decode_inputs(batch)
    o_ref, normed_ref, state_ref, conv_ref = decode_reference(x)
    res = {}
    (conv_out, window), _ = theirs_conv(gdn, x)
    res["gdn_conv1d_decode: conv output"] = max_error(conv_out[:, :, 0], conv_ref)
    (out, state), _ = theirs_tkg(gdn, x, conv_out[:, :, 0])
    over = SPILLS[f"gdn_tkg b{batch} LNC=1"]
    tag = f" (over SBUF by {over / 1024:.0f} KiB per partition)" if over else ""
    res[f"gdn_tkg (after their conv){tag}: gated-norm output"] = max_error(out.reshape(batch, NV, DV), normed_ref)
    res["gdn_tkg (after their conv): state"] = max_error(state.reshape(batch, NV, DK, DV), state_ref)
    (o, conv_state, state), _ = ours_decode(x)
    res["ours (tkg): o before the norm"] = max_error(o, o_ref)
    res["ours (tkg): gated-norm output (norm in torch)"] = max_error(
        gated_norm(torch.from_numpy(np.asarray(o, np.float64)), _t(x["z"]).reshape(batch, NV, DV),
                   _t(x["norm_weight"])), normed_ref)
    res["ours (tkg): state"] = max_error(state, state_ref)
    w = block_weights()
    hidden = _rng(2).standard_normal((batch, 1, HIDDEN)).astype(BF16)
    h = _t(hidden)[:, 0]
    proj = {name: h @ _t(w[name]) for name in w}
    _, block_normed, block_state, _ = decode_reference(x, mixed=proj["qkv"], z=proj["z"], a=proj["a"], b=proj["b"])
    (core, new_window, new_state), _ = theirs_block(gdn, x, hidden, w)
    over = SPILLS[f"gdn_block_tkg b{batch}"]
    tag = f" (over SBUF by {over / 1024:.0f} KiB per partition)" if over else ""
    res[f"gdn_block_tkg{tag}: gated-norm output"] = max_error(core.reshape(batch, NV, DV), block_normed)
    res["gdn_block_tkg: state"] = max_error(new_state, block_state)
    return res


def check_prefill(gdn, tokens: int) -> dict:
    x = prefill_inputs(tokens)
    q, k, g, beta, o_ref, state_ref = prefill_reference(x)
    bf = lambda t: t.to(torch.float32).numpy().astype(BF16)  # noqa: E731
    res = {}
    (o, state), _ = theirs_cte(gdn, bf(q), bf(k), x["v"], g.to(torch.float32).numpy(), beta.to(torch.float32).numpy(),
                               x["state"].copy(), lnc=2)
    res[f"gdn_cte, {tokens} tokens: o"] = max_error(o, o_ref)
    res[f"gdn_cte, {tokens} tokens: state"] = max_error(state, state_ref)
    (o, state), _ = ours_prefill(x, lnc=2)
    res[f"ours (cte), {tokens} tokens: o"] = max_error(o, o_ref)
    res[f"ours (cte), {tokens} tokens: state"] = max_error(state, state_ref)
    return res


# ---------------------------------------------------------------------------------------------------- costs
def decode_comparisons(gdn, batches=(1, 8)) -> list[Comparison]:
    out = []
    for batch in batches:
        x = decode_inputs(batch)
        conv = np.zeros((batch, C), BF16)
        _, ours = ours_decode(x, compute=False)
        _, conv_trace = theirs_conv(gdn, x, compute=False)
        _, tkg = theirs_tkg(gdn, x, conv, compute=False)
        hidden = np.zeros((batch, 1, HIDDEN), BF16)
        _, block = theirs_block(gdn, x, hidden, block_weights(), compute=False)
        _, tkg2 = theirs_tkg(gdn, x, conv, compute=False, lnc=2)
        tkg1 = (f"gdn_conv1d_decode b{batch}", f"gdn_tkg b{batch} LNC=1")
        out += [Comparison(f"decode b{batch}: gdn_conv1d_decode + gdn_tkg / ours", [conv_trace, tkg], [ours],
                           spills=tkg1),
                Comparison(f"decode b{batch}: gdn_tkg alone / ours", [tkg], [ours], spills=tkg1[1:]),
                Comparison(f"decode b{batch}: gdn_tkg alone at LNC=2 (two cores) / ours (one core)", [tkg2], [ours],
                           spills=(f"gdn_tkg b{batch} LNC=2",)),
                Comparison(f"decode b{batch}: gdn_block_tkg / (ours + projection floor)", [block], [ours],
                           projection_floor_us, spills=(f"gdn_block_tkg b{batch}",))]
    return out


def prefill_comparisons(gdn, tokens_list=(1024, 4096), lncs=(2, 1)) -> list[Comparison]:
    out = []
    for tokens in tokens_list:
        x = prefill_inputs(tokens)
        z = np.zeros
        for lnc in lncs:
            _, ours = ours_prefill(x, lnc, compute=False)
            _, theirs = theirs_cte(gdn, z((1, NK, tokens, DK), BF16), z((1, NK, tokens, DK), BF16),
                                   z((1, NV, tokens, DV), BF16), z((1, NV, tokens), np.float32),
                                   z((1, NV, tokens), np.float32), z((1, NV, DK, DV), np.float32), lnc, compute=False)
            out.append(Comparison(f"prefill {tokens}, LNC={lnc}: gdn_cte / ours", [theirs], [ours],
                                  spills=(f"gdn_cte {tokens} LNC={lnc}",)))
    return out


def table(comparisons: list[Comparison], ranges: bool = True) -> list[str]:
    def fmt(v):
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"

    rows = ["| comparison (trn2, one rank) | theirs (us) | ours (us) | theirs / ours | range | moved most by |",
            "| --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        theirs, ours = c.times()
        if ranges:
            r = sweep(c.ratio)
            spread = f"{fmt(r.low)} - {fmt(r.high)}"
            movers = "; ".join(f"`{f}` {fmt(lo)} -> {fmt(hi)}" for f, lo, hi in r.movers)
        else:
            spread = movers = "-"
        over = max((SPILLS.get(k, 0) for k in c.spills), default=0)
        note = f" (theirs over SBUF by {over / 1024:.0f} KiB per partition: a lower bound)" if over else ""
        rows.append(f"| {c.name}{note} | {fmt(theirs)} | {fmt(ours)} | {fmt(theirs / ours)} | {spread} | {movers} |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nkilib", default=os.environ.get("OPTIMUM_QWEN35_NKILIB"),
                        help="directory holding the NKI Library's `nkilib` package (or a checkout's root)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096], help="prefill lengths for the costs")
    parser.add_argument("--check-tokens", type=int, default=512, help="prefill length of the error check (0: none)")
    parser.add_argument("--no-ranges", action="store_true", help="mid parameters only")
    args = parser.parse_args()
    if not args.nkilib:
        parser.error("--nkilib PATH is required (the NKI Library is not part of this repository)")
    gdn = load_library(args.nkilib)
    print(f"NKI Library GDN kernels from {pathlib.Path(gdn.__file__).parent}")
    t0 = time.time()
    print("\nErrors against our torch reference (float64), 2B layer (16/16 heads, dk = dv = 128), bf16 activations, "
          "random inputs, nonzero initial state:")
    for batch in (1, 8):
        for name, err in check_decode(gdn, batch).items():
            print(f"  decode b{batch}, {name}: {fmt_error(err)}")
    if args.check_tokens:
        for name, err in check_prefill(gdn, args.check_tokens).items():
            print(f"  prefill, {name}: {fmt_error(err)}")
    print(f"  [{time.time() - t0:.0f} s]")
    t0 = time.time()
    comparisons = decode_comparisons(gdn) + prefill_comparisons(gdn, args.tokens)
    print(f"\ntraced in {time.time() - t0:.0f} s; projection floor {projection_floor_us():.1f} us at mid parameters")
    t0 = time.time()
    print("\n" + "\n".join(table(comparisons, ranges=not args.no_ranges)))
    print(f"\n[{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    main()
