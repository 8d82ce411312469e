"""`optimum-qwen35 demo`, `generate`, `shard` and `build-tiny`: the commands that run on a checkpoint folder."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from optimum_qwen35.cli.parser import DTYPES, positive_int
from optimum_qwen35.errors import CheckpointError, UsageError
from optimum_qwen35.export.writer import output_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
LAYOUTS = ["tiny-2b", "tiny-nv2x", "tiny-nv3x"]


def _load_tokenizer(model_dir: Path):
    """The folder's own tokenizer, read locally (never from the network)."""
    from transformers import AutoTokenizer  # start-up time: this command only

    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): generate needs the checkpoint's "
            "tokenizer next to config.json; copy them from the original checkpoint"
        )
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # a damaged tokenizer file surfaces as many exception types
        raise CheckpointError(f"could not load the tokenizer in {model_dir} ({type(e).__name__}: {e})") from e


def _generate(model_dir: Path, prompt: str, max_new_tokens: int, dtype: str, raw: bool) -> int:
    import torch  # start-up time: this command only
    from tqdm.auto import tqdm  # start-up time: this command only

    from optimum_qwen35 import validation  # start-up time: this command only
    from optimum_qwen35.runtime import Qwen35Runtime  # start-up time: this command only

    from optimum_qwen35.config import Qwen35Config  # start-up time: this command only

    if (Path(model_dir) / "neuron_config.json").is_file():  # before model_folder's "no weights" (they are in checkpoint/)
        raise UsageError(
            f"{model_dir} is an export folder (neuron_config.json): generate runs a checkpoint folder; load the export "
            f"with NeuronModelForCausalLM.from_pretrained({str(model_dir)!r}), or pass the checkpoint it was exported from"
        )
    model_dir = validation.model_folder(model_dir, "generate")  # before anything is loaded
    if (model_dir / "tp_shards.json").is_file():
        from optimum_qwen35.checkpoint.sharded_files import read_manifest  # start-up time: this command only

        degree = read_manifest(model_dir)["tp_degree"]
        if degree != 1:
            raise UsageError(
                f"{model_dir} holds rank shards for tensor_parallel_size={degree}; generate runs one process "
                "(tensor_parallel_size 1): pass the source checkpoint folder, or `optimum-qwen35 shard "
                "--tensor_parallel_size 1` of it"
            )
    Qwen35Config.from_pretrained(model_dir)  # a folder of another model is refused before its tokenizer loads
    tokenizer = _load_tokenizer(model_dir)
    if raw:
        ids = tokenizer(prompt)["input_ids"]
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"the tokenizer in {model_dir} has no chat template: pass --raw to use the prompt as it is")
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise UsageError("the prompt is empty after tokenization: pass a non-empty --prompt")
    max_length = len(ids) + max_new_tokens
    start = time.perf_counter()
    model = Qwen35Runtime.from_pretrained(
        model_dir, batch_size=1, max_length=max_length, dtype=getattr(torch, dtype), buckets=[len(ids)]
    )
    loaded = time.perf_counter()
    progress = tqdm(total=max_new_tokens, desc="generating", unit="tok", leave=False)
    first_token_at = []

    def on_step(step, tokens):
        if step == 0:
            first_token_at.append(time.perf_counter())
        progress.update(1)

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokenizer.get_vocab()]
    new_tokens = model.generate([ids], max_new_tokens=max_new_tokens, eos_token_id=eos, streamer=on_step)[0]
    progress.close()
    done = time.perf_counter()
    print(f"prompt ({len(ids)} tokens{'' if raw else ', chat template included'}): {prompt!r}")
    print(f"reply ({len(new_tokens)} tokens): {tokenizer.decode(new_tokens, skip_special_tokens=True)!r}")
    decode_s = done - first_token_at[0]
    print(
        f"load {loaded - start:.2f}s, time to first token {first_token_at[0] - loaded:.3f}s, "
        f"decode {max(len(new_tokens) - 1, 0) / decode_s if decode_s > 0 else float('nan'):.1f} tok/s "
        f"(CPU, {dtype}, batch 1)"
    )
    return 0


def cmd_demo(args) -> int:
    from optimum_qwen35.tiny import build_tiny_checkpoint  # start-up time: this command only

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out) if args.out else Path(tmp) / "tiny-qwen3.5"
        with output_folder(folder, overwrite=args.overwrite) as partial:
            build_tiny_checkpoint(partial, args.layout)
        print(f"built a tiny random Qwen3.5 checkpoint ({args.layout}) at {folder}: its replies are noise by design")
        return _generate(folder, args.prompt, args.max_new_tokens, args.dtype, raw=False)


def cmd_generate(args) -> int:
    return _generate(Path(args.model), args.prompt, args.max_new_tokens, args.dtype, raw=args.raw)


def cmd_shard(args) -> int:
    import torch  # start-up time: this command only

    from optimum_qwen35.checkpoint.sharded_files import save_sharded  # start-up time: this command only

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = save_sharded(args.model, None, args.tensor_parallel_size, args.out, dtype, overwrite=args.overwrite)
    print(f"saved {args.tensor_parallel_size} rank shards to {out}")
    return 0


def cmd_build_tiny(args) -> int:
    from optimum_qwen35.tiny import build_tiny_checkpoint  # start-up time: this command only

    with output_folder(args.out, overwrite=args.overwrite) as partial:
        build_tiny_checkpoint(partial, args.layout, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.out}")
    return 0


def add_commands(sub) -> None:
    """demo, generate, shard and build-tiny, on the subcommands `sub` of the main parser."""
    p = sub.add_parser("demo", help="chat with an embedded tiny random checkpoint (no network, no Neuron)")
    p.add_argument("--prompt", default="Give me a short introduction to large language models.", help="the user message")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="how many tokens to generate at most (default 32)")
    p.add_argument("--layout", default="tiny-2b", choices=LAYOUTS, help="which tiny layout to build")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weights and activations dtype (default float32; `generate` defaults to bfloat16)",
    )
    p.add_argument("--out", help="keep the tiny checkpoint in this folder (default: a temporary one)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out, whole")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="greedy generation from a checkpoint folder on the CPU graphs")
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder (a Hub snapshot)")
    p.add_argument("--prompt", required=True, help="the user message (chat template applied unless --raw)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="how many tokens to generate at most (default 64)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations dtype (default bfloat16; `demo` defaults to float32)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("shard", help="convert a checkpoint and save one safetensors file per tensor-parallel rank")
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder")
    p.add_argument("--tensor-parallel-size", type=positive_int, required=True, help="number of ranks")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model or export in OUT, whole")
    p.add_argument("out", help="the folder to write the rank shards to")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("build-tiny", help="write a tiny random Qwen3.5 checkpoint")
    p.add_argument("out", help="the folder to write the checkpoint to")
    p.add_argument("--layout", default="tiny-2b", choices=LAYOUTS, help="head layout: nv = nk, 2 nk or 3 nk")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="on-disk dtype of the weights")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT, whole")
    p.set_defaults(func=cmd_build_tiny)
