"""Command line: `python -m optimum_qwen35 <command>` (or `optimum-qwen35 <command>`).

    demo        build the embedded tiny Qwen3.5 checkpoint and chat with it on the CPU graphs
    generate    greedy generation from a Qwen3.5 checkpoint folder on the CPU graphs
    shard       convert a checkpoint and save one safetensors file per tensor-parallel rank
    build-tiny  write a tiny random Qwen3.5 checkpoint in the real on-disk format
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .errors import CheckpointError, Qwen35Error, UsageError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _load_tokenizer(model_dir: Path):
    """The folder's own tokenizer, read locally (never from the network)."""
    from transformers import AutoTokenizer

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
    import torch
    from tqdm.auto import tqdm

    from . import validation
    from .runtime.cpu import Qwen35ForCausalLM

    from .config import Qwen35Config

    model_dir = validation.model_folder(model_dir, "generate")  # before anything is loaded
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
    model = Qwen35ForCausalLM.from_pretrained(
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
    print(f"prompt ({len(ids)} tokens): {prompt!r}")
    print(f"reply ({len(new_tokens)} tokens): {tokenizer.decode(new_tokens, skip_special_tokens=True)!r}")
    decode_s = done - first_token_at[0]
    print(
        f"load {loaded - start:.2f}s, time to first token {first_token_at[0] - loaded:.3f}s, "
        f"decode {max(len(new_tokens) - 1, 0) / decode_s if decode_s > 0 else float('nan'):.1f} tok/s "
        f"(CPU, {dtype}, batch 1)"
    )
    return 0


def cmd_demo(args) -> int:
    from .testing import build_tiny_checkpoint

    from .output import output_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out) if args.out else Path(tmp) / "tiny-qwen3.5"
        with output_folder(folder, overwrite=args.overwrite) as partial:
            build_tiny_checkpoint(partial, args.layout)
        print(f"built a tiny random Qwen3.5 checkpoint ({args.layout}) at {folder}: its replies are noise by design")
        return _generate(folder, args.prompt, args.max_new_tokens, args.dtype, raw=False)


def cmd_generate(args) -> int:
    return _generate(Path(args.model), args.prompt, args.max_new_tokens, args.dtype, raw=args.raw)


def cmd_shard(args) -> int:
    import torch

    from .checkpoint.shard import save_sharded

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = save_sharded(args.model, None, args.tensor_parallel_size, args.out, dtype, overwrite=args.overwrite)
    print(f"saved {args.tensor_parallel_size} rank shards to {out}")
    return 0


def cmd_build_tiny(args) -> int:
    from .testing import build_tiny_checkpoint

    from .output import output_folder

    with output_folder(args.out, overwrite=args.overwrite) as partial:
        build_tiny_checkpoint(partial, args.layout, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2) that point at --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _fail(error: BaseException | str, status: int) -> int:
    print(f"optimum-qwen35: error: {error}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="optimum-qwen35", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("demo", help="chat with an embedded tiny random checkpoint (no network, no Neuron)")
    p.add_argument("--prompt", default="Give me a short introduction to large language models.")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--layout", default="tiny-2b", choices=["tiny-2b", "tiny-nv2x", "tiny-nv3x"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--out", help="keep the tiny checkpoint in this folder (default: a temporary one)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out, whole")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="greedy generation on the CPU graphs")
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder (a Hub snapshot)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("shard", help="save per-rank tensor-parallel shards")
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", type=_positive_int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model or export in OUT, whole")
    p.add_argument("out")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("build-tiny", help="write a tiny random Qwen3.5 checkpoint")
    p.add_argument("out")
    p.add_argument("--layout", default="tiny-2b", choices=["tiny-2b", "tiny-nv2x", "tiny-nv3x"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT, whole")
    p.set_defaults(func=cmd_build_tiny)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Qwen35Error as error:
        if args.debug:
            raise
        return _fail(error, error.exit_status)
    except KeyboardInterrupt:
        return _fail(KeyboardInterrupt("interrupted"), 130)
    except OSError as error:  # the disk or the system refused (full, no permission): the user can act on it
        if args.debug:
            raise
        return _fail(error, 1)
    except Exception as error:  # a bug: still one line, and how to get the traceback
        if args.debug:
            raise
        return _fail(f"unexpected {type(error).__name__}: {error} (a bug: rerun with --debug and report the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
