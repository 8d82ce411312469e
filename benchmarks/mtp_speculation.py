"""Speculative decoding with the MTP head (issue 39 item 5): acceptance length per k and the decode speed-up against
plain greedy decoding, measured on CPU side by side in one run; then, labelled a projection, the trn2 speed-up per
size at batch 1 and 8 from the bytes a step moves.

    OMP_NUM_THREADS=1 python benchmarks/mtp_speculation.py [--repeats 5] [--new 48] [--prompts 4]

**Measured.** The tiny checkpoints' random MTP heads accept nothing, so the head is fitted to its own main model
first (optimum_qwen35/tiny/mtp_fit.py: tiny-2b, hidden 128, 8 layers, vocab 512; seeded, ~20-30 s of CPU). A bigger model
(0.8B widths) was not used: fitting its head on one thread would take minutes to tens of minutes. The
prompts are of two kinds: *in-sample*, a prompt the head was fitted on plus the first tokens of its continuation (the
head was fitted on what follows: acceptance there is high by design, an upper end), and *fresh*, seeded random
prompts it never saw (a tiny random model's continuations are not predictable: acceptance about 1, the lower end).
Each repeat runs every k = 0..4 once, one prompt per call (batch 1), one torch thread; time is the process's CPU
time (`time.process_time`), and every k's tokens are checked equal to k = 0's. The speed-up per repeat is k = 0's
time over k's; the table gives the median and [min, max] over repeats. This tiny model is not weight-bound on CPU:
a step's time is mostly Python and per-op overhead, and the eager verify runs its attention and DeltaNet parts
one position at a time (docs/speculative_decoding.md): the CPU speed-up says what the host loop costs, not what
trn2 would see.

**Projection (not a measurement).** Bytes per rank at TP 1 (ratios hardly move with TP: weights and states split
alike), bf16 weights and K/V, fp32 DeltaNet recurrent state, a 4096-position K/V cache read whole per row:

- plain step (batch B): every matmul weight once (MoE: the expected distinct experts of B tokens under uniform
  routing, the shared expert, the fp32 router), the lm_head, the K/V read and one position written, each row's
  DeltaNet states read and written, fp32 logits out;
- verify of k + 1 positions: the weights once (MoE: distinct experts of B (k + 1) tokens), the K/V read once and
  k + 1 positions written, the DeltaNet states read once and written after every position (k + 1 copies: what the
  verify graph returns), k + 1 positions' logits;
- commit: each row's chosen states read and written;
- the head: k calls per round (k - 1 drafts and the catch-up; the first draft comes from the previous catch-up),
  each its fc, its attention layer and MLP / MoE, the lm_head (the whole vocabulary: the package drafts over it),
  its own K/V cache read.

speed-up = acceptance length x plain bytes / round bytes; the issue's target is verify <= 1.3 x plain at batch 1.
Time per byte is assumed equal for every call (memory-bound): per-call latency (launch, the ~49 collectives of a
TP step, the head's few) is left out, which flatters the round (k + 2 calls against 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from optimum_qwen35.runtime import Qwen35Runtime  # noqa: E402
from optimum_qwen35.tiny.mtp_fit import fitted_checkpoint  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "tiny-2b"
KS = (1, 2, 3, 4)
BUCKETS, MAX_LENGTH = [16, 32], 128

# Sizes for the projection: the 0.8B's real config changed by ANCHORS' table (as benchmarks/neuron_real_shapes.py's
# SIZES), and the published 35B-A3B config.
SIZES = {
    "2B": ("qwen3.5-0.8b", {"hidden_size": 2048, "intermediate_size": 6144}),
    "27B": ("qwen3.5-0.8b", {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
                             "num_key_value_heads": 4, "intermediate_size": 17408, "linear_num_value_heads": 48,
                             "tie_word_embeddings": False}),
    "35B-A3B": ("qwen3.5-35b-a3b", {}),
}
CACHE = 4096


# ------------------------------------------------------------------------------------------------ measured (CPU)
def prompts_for(folder: Path, n: int, seed: int = 1) -> dict[str, list[list[int]]]:
    """In-sample: fitted prompts (8 tokens) + the first 8 tokens of their greedy continuation; fresh: seeded random."""
    fit = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:n]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=n, max_length=MAX_LENGTH, buckets=BUCKETS)
    continued = model.generate(fit, max_new_tokens=8)
    model.close()
    vocab = json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    fresh = torch.randint(3, vocab, (n, 16), generator=g).tolist()
    return {"in-sample": [p + c for p, c in zip(fit, continued)], "fresh": fresh}


def measure(folder: Path, prompts: list[list[int]], new: int, repeats: int) -> dict[int, dict]:
    """Per k (0 = plain): CPU seconds per repeat, acceptance length; tokens checked equal to plain's."""
    model = Qwen35Runtime.from_pretrained(folder, batch_size=1, max_length=MAX_LENGTH, buckets=BUCKETS, mtp=True)
    out = {k: {"seconds": [], "acceptance": None} for k in (0, *KS)}
    plain = model.generate(prompts, max_new_tokens=new)  # warm-up, and the reference tokens
    for _ in range(repeats):
        for k in out:
            start = time.process_time()
            got = model.generate(prompts, max_new_tokens=new, num_speculative_tokens=k)
            out[k]["seconds"].append(time.process_time() - start)
            if got != plain:
                raise AssertionError(f"k={k}: speculative tokens differ from plain greedy decoding")
            if k:
                out[k]["acceptance"] = model.speculation.acceptance_length
    model.close()
    return out


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def measured_table(results: dict[str, dict[int, dict]], new: int, n: int) -> list[str]:
    lines = [f"Measured (CPU, tiny-2b with its MTP head fitted, fp32, batch 1, {n} prompts x {new} new tokens per "
             "call, one torch thread, process CPU time; median [min, max] over repeats; tokens equal to plain greedy):",
             "| prompts | k | acceptance length | CPU s per call | speed-up vs k = 0 |", "|---|---|---|---|---|"]
    for kind, r in results.items():
        base = r[0]["seconds"]
        lines.append(f"| {kind} | 0 (plain) | 1 | {spread(base, '{:.3f}')} | 1 |")
        for k in KS:
            ratio = [b / s for b, s in zip(base, r[k]["seconds"])]
            lines.append(f"| {kind} | {k} | {r[k]['acceptance']:.2f} | {spread(r[k]['seconds'], '{:.3f}')} | "
                         f"{spread(ratio)} |")
    return lines


# ------------------------------------------------------------------------------------------------ projection (trn2)
def text_config(size: str) -> dict:
    name, change = SIZES[size]
    config = json.loads((ROOT / "tests" / f"{name}.config.json").read_text())
    text = dict(config.get("text_config", config))
    text.update(change)
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return text


def layer_bytes(text: dict, kind: str, tokens: int, b: int = 2) -> float:
    """Weight bytes one call reads for one layer's mixer and MLP / MoE, `tokens` tokens in the call."""
    H = text["hidden_size"]
    heads, kv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv, dk, dv = (text[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    if kind == "full_attention":
        mixer = (H * heads * hd * 2 + 2 * H * kv * hd + heads * hd * H) * b
    else:
        qkv = 2 * nk * dk + nv * dv
        mixer = (H * (qkv + nv * dv + 2 * nv) + nv * dv * H + qkv * text["linear_conv_kernel_dim"]) * b
    if "num_experts" in text:
        E, k = text["num_experts"], text["num_experts_per_tok"]
        distinct = E * (1 - (1 - k / E) ** tokens)  # expected distinct experts, uniform routing
        mlp = (distinct * 3 * text["moe_intermediate_size"] + 3 * text["shared_expert_intermediate_size"]) * H * b
        mlp += E * H * 4 + H * b  # the router, held in fp32; the shared expert's gate
    else:
        mlp = 3 * text["intermediate_size"] * H * b
    return mixer + mlp


def state_bytes(text: dict) -> tuple[int, int]:
    """Per row: (K/V bytes of one position over the attention layers, DeltaNet conv + recurrent state bytes)."""
    kv_pos = dn = 0
    qkv = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
    qkv += text["linear_num_value_heads"] * text["linear_value_head_dim"]
    for kind in text["layer_types"]:
        if kind == "full_attention":
            kv_pos += 2 * text["num_key_value_heads"] * text["head_dim"] * 2
        else:
            dn += text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4
            dn += qkv * (text["linear_conv_kernel_dim"] - 1) * 2
    return kv_pos, dn


def round_bytes(text: dict, batch: int, k: int, acceptance: float, draft_vocab: int | None = None) -> dict[str, float]:
    """Bytes of a plain step, and of one speculative round's parts (module docstring); `draft_vocab`: the head scores
    that many lm_head rows (runtime/draft_vocab.py) instead of the whole vocabulary."""
    H, V = text["hidden_size"], text["vocab_size"]
    kv_pos, dn = state_bytes(text)
    lm_head = V * H * 2
    Vd = min(draft_vocab or V, V)

    def main(tokens_per_row):
        weights = sum(layer_bytes(text, kind, batch * tokens_per_row) for kind in text["layer_types"]) + lm_head
        kv = batch * (CACHE + tokens_per_row) * kv_pos
        deltanet = batch * dn * (1 + tokens_per_row)  # read once, written after every position
        return weights + kv + deltanet + batch * tokens_per_row * V * 4

    # The head: fc [H, 2H], one attention layer and its MLP / MoE, the lm_head; its one-layer K/V cache.
    head_kv = 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    def head(tokens_per_row):
        return (2 * H * H * 2 + layer_bytes(text, "full_attention", batch * tokens_per_row) + Vd * H * 2
                + batch * (CACHE + tokens_per_row) * head_kv + batch * tokens_per_row * Vd * 4)

    return {"plain": main(1), "verify": main(k + 1), "commit": 2 * batch * dn,
            "head": (k - 1) * head(1) + head(acceptance)}


def projection(acceptance: dict[int, float]) -> list[str]:
    lines = ["Projection (not a measurement): trn2, bf16, TP 1 bytes per step (ratios; per-call latency and "
             f"collectives left out), K/V cache {CACHE} positions; acceptance a per k as measured above (in-sample) "
             "and the issue's 2.5:",
             "| size | batch | k | verify / plain | round / plain (verify + commit + k head calls) | head's share of the "
             "round | speed-up at a(k) | speed-up at a = 2.5 | a for 1.8x |", "|---|---|---|---|---|---|---|---|---|"]
    for size in SIZES:
        text = text_config(size)
        for batch in (1, 8):
            for k in KS:
                r = round_bytes(text, batch, k, acceptance[k])
                total = (r["verify"] + r["commit"] + r["head"]) / r["plain"]
                share = r["head"] / (r["verify"] + r["commit"] + r["head"])
                # A round emits at most k + 1 tokens: a = 2.5 needs k >= 2, and 1.8x may need more than k + 1.
                if k + 1 >= 2.5:
                    at_25 = 2.5 * r["plain"] / sum(round_bytes(text, batch, k, 2.5)[p] for p in ("verify", "commit", "head"))
                    at_25 = f"{at_25:.2f}"
                else:
                    at_25 = "- (a <= k + 1)"
                need = 1.8 * total
                need = f"{need:.2f}" + (" (> k + 1: unreachable)" if need > k + 1 else "")
                lines.append(f"| {size} | {batch} | {k} | {r['verify'] / r['plain']:.2f} | {total:.2f} | {share:.0%} | "
                             f"{acceptance[k] / total:.2f} | {at_25} | {need} |")
    return lines


DRAFT_VOCABS = (None, 32768, 8192)


def draft_vocab_projection() -> list[str]:
    """Speed-up at a = 2.5 (and the acceptance 1.8x needs) per draft vocabulary size, batch 1, k = 2 and 3."""
    lines = ["Projection with a draft vocabulary (the head reads V_d lm_head rows; verification the whole head), trn2 "
             "bf16 TP 1 bytes, batch 1, acceptance a held at 2.5 whatever V_d (a smaller V_d lowers the real "
             "acceptance: measured on the tiny model above):",
             "| size | k | V_d | head's share of the round | round / plain | speed-up at a = 2.5 | a for 1.8x |",
             "|---|---|---|---|---|---|---|"]
    for size in ("2B", "27B"):
        text = text_config(size)
        for k in (2, 3):
            for vd in DRAFT_VOCABS:
                r = round_bytes(text, 1, k, 2.5, vd)
                total = (r["verify"] + r["commit"] + r["head"]) / r["plain"]
                share = r["head"] / (r["verify"] + r["commit"] + r["head"])
                name = "full" if vd is None else f"{vd // 1024}k"
                lines.append(f"| {size} | {k} | {name} | {share:.0%} | {total:.2f} | {2.5 / total:.2f} | {1.8 * total:.2f} |")
    return lines


def draft_vocab_acceptance(folder: Path, prompts: list[list[int]], new: int, sizes) -> dict:
    """Acceptance length per (V_d, k) on `prompts`, the ranking counted over the main model's greedy continuations of
    other seeded prompts; tokens checked equal to plain greedy's."""
    from optimum_qwen35.runtime.draft_vocab import rank_by_counts, rank_by_merges, use_draft_vocab

    vocab = json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=len(prompts), max_length=MAX_LENGTH, buckets=BUCKETS, mtp=True)
    corpus = torch.randint(3, vocab, (8, 8), generator=torch.Generator().manual_seed(7)).tolist()
    rankings = {"corpus": rank_by_counts(model.generate(corpus, max_new_tokens=64), vocab),
                "merges": rank_by_merges(folder / "tokenizer.json", vocab)}
    plain = model.generate(prompts, max_new_tokens=new)
    out = {}
    for name, ranking in rankings.items():
        for size in sizes:
            use_draft_vocab(model, ranking, size)
            for k in KS:
                if model.generate(prompts, max_new_tokens=new, num_speculative_tokens=k) != plain:
                    raise AssertionError(f"V_d={size} k={k}: speculative tokens differ from plain greedy decoding")
                out[name, size, k] = model.speculation.acceptance_length
    model.close()
    return out


def draft_vocab_table(acceptance: dict, vocab: int, new: int, n: int) -> list[str]:
    sizes = sorted({s for _, s, _ in acceptance}, key=lambda s: s or vocab)
    lines = [f"Measured acceptance length with a draft vocabulary (tiny-2b fitted head, fp32, {n} in-sample prompts "
             f"batched, {new} new tokens; vocabulary {vocab}: V_d 16 and 66 are 8k and 32k of 248,320 scaled alike; "
             "tokens equal to plain greedy):",
             "| ranking | V_d | " + " | ".join(f"k = {k}" for k in KS) + " |", "|---|---|" + "---|" * len(KS)]
    for name in ("corpus", "merges"):
        for size in sizes:
            row = " | ".join(f"{acceptance[name, size, k]:.2f}" for k in KS)
            lines.append(f"| {name} | {size or f'{vocab} (full)'} | {row} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=48, help="new tokens per prompt (in-sample: up to 80)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--fit-steps", type=int, default=100, help="training steps of the head (optimum_qwen35/tiny/mtp_fit.py)")
    parser.add_argument("--draft-vocab-only", action="store_true",
                        help="only the draft-vocabulary acceptance and projection (no timing)")
    args = parser.parse_args()
    if args.draft_vocab_only:
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            folder = fitted_checkpoint(FIXTURE, Path(tmp) / "fitted", steps=args.fit_steps)
            prompts = prompts_for(folder, args.prompts)["in-sample"]
            acceptance = draft_vocab_acceptance(folder, prompts, args.new, (16, 66, None))
        print("\n".join(draft_vocab_table(acceptance, 512, args.new, args.prompts)))
        print()
        print("\n".join(draft_vocab_projection()))
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.process_time()
        folder = fitted_checkpoint(FIXTURE, Path(tmp) / "fitted", steps=args.fit_steps)
        print(f"head fitted to tiny-2b in {time.process_time() - start:.1f} s of CPU time "
              f"(loss {json.loads((folder / 'mtp_fit.json').read_text())['loss']:.3f})")
        prompts = prompts_for(folder, args.prompts)
        results = {kind: measure(folder, p, args.new, args.repeats) for kind, p in prompts.items()}
    print("\n".join(measured_table(results, args.new, args.prompts)))
    print()
    print("\n".join(projection({k: results["in-sample"][k]["acceptance"] for k in KS})))
    print()
    print("\n".join(draft_vocab_projection()))


if __name__ == "__main__":
    main()
