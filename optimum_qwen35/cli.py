"""Command line: `python -m optimum_qwen35 <command>` (or `optimum-qwen35 <command>`).

Qwen3.5 on AWS Trainium/Inferentia through optimum-neuron, and on the CPU. `optimum-qwen35 --help` lists
the commands, `optimum-qwen35 <command> --help` their options.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from optimum_qwen35.errors import CheckpointError, ExportError, Qwen35Error, UsageError
from optimum_qwen35.export.writer import output_folder
from optimum_qwen35.patches import VERBOSE_ENV

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


def _int_list(text: str) -> list[int]:
    """A comma-separated list of integers (argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def check_export(args):
    """Everything `export` checks before the first graph is compiled: the destination, the arguments, the source.
    Returns the neuron config."""
    if args.task != "text-generation":
        raise UsageError(f"--task {args.task!r} is not supported: Qwen3.5 exports for text-generation")
    from optimum_qwen35.export.cpu import check_save_directory  # start-up time: this command only
    from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # (the same)

    try:
        check_save_directory(Path(args.out), args.overwrite, source=args.model)
    except ExportError as error:
        raise UsageError(str(error).replace("overwrite=True (--overwrite)", "--overwrite")) from error
    return Qwen35NeuronModelForCausalLM.get_neuron_config(
        args.model,
        revision=args.revision,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.torch_dtype,
        target=args.target,
    )


def cmd_export(args) -> int:
    from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # start-up time: this command only

    out = Path(args.out)
    neuron_config = check_export(args)
    model = Qwen35NeuronModelForCausalLM.export(
        args.model, neuron_config, revision=args.revision, vision=args.vision, image_buckets=args.image_buckets,
        neuron_backend=args.neuron_backend, mtp=args.mtp,
    )
    model.save_pretrained(out, overwrite=args.overwrite)
    backend = getattr(model, "backend", None)  # (the NxD class has none: optimum-neuron's own export)
    print(
        f"exported {args.model} for {neuron_config.target}{' (torchneuron backend)' if backend == 'torchneuron' else ''}"
        f" (batch {neuron_config.batch_size}, sequence length {neuron_config.sequence_length}, TP "
        f"{neuron_config.tp_degree}, {str(neuron_config.torch_dtype).removeprefix('torch.')}) to {out}"
    )
    return 0


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


def cmd_push(args) -> int:
    from optimum_qwen35.hub import push_to_hub  # start-up time: this command only

    result = push_to_hub(
        args.folder,
        args.repo_id,
        revision=args.revision,
        private=True if args.private else None,
        token=args.token,
        endpoint=args.endpoint,
        commit_message=args.commit_message,
    )
    if result.changed:
        print(
            f"pushed {len(result.uploaded)} file(s), deleted {len(result.deleted)} from {result.repo_id}"
            f"@{result.revision}: {result.commit_url}"
        )
    else:
        where = f"{result.repo_id}@{result.revision}"
        print(f"{where} already holds this export (commit {result.commit_sha}): nothing pushed")
    return 0


def cmd_pull(args) -> int:
    from optimum_qwen35.hub import resolve_export  # start-up time: this command only

    print(resolve_export(args.model, revision=args.revision, token=args.token, endpoint=args.endpoint))
    return 0


def cmd_cache_sync(args) -> int:
    from optimum_qwen35.hub import sync_registry  # start-up time: this command only

    result = sync_registry(
        args.folder,
        cache_repo=args.cache_repo,
        token=args.token,
        endpoint=args.endpoint,
        model_id=args.model_id,
        config=args.source_config,
    )
    print(f"registered in {result.cache_repo} (commit {result.commit_sha}):")
    for path in result.paths:
        print(f"  {path}")
    return 0


def cmd_cache_lookup(args) -> int:
    from optimum_qwen35.hub import lookup_registry  # start-up time: this command only

    entries = lookup_registry(
        args.model_id,
        cache_repo=args.cache_repo,
        target=args.target,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        tp_degree=args.tensor_parallel_size,
        torch_dtype=args.dtype,
    )
    if not entries:
        print(f"no cached configuration of {args.model_id} matches")
        return 0
    print("target  batch  sequence  tp  dtype")
    for e in entries:
        fields = ("target", "batch_size", "sequence_length", "tp_degree", "torch_dtype")
        print("  ".join(str(e.get(f)) for f in fields))
    return 0


def _buckets(text: str) -> dict[str, list[int]]:
    """`context=128,1024;token=1024` -> {"context": [128, 1024], "token": [1024]}."""
    buckets = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, sizes = part.partition("=")
        if not kind.strip() or not sizes:
            raise argparse.ArgumentTypeError(f"expected KIND=SIZE,SIZE;KIND=SIZE..., got {text!r}")
        buckets[kind.strip()] = _int_list(sizes)
    if not buckets:
        raise argparse.ArgumentTypeError(f"expected KIND=SIZE,SIZE;KIND=SIZE..., got {text!r}")
    return buckets


def _neff_cache_key(args):
    from optimum_qwen35.hub.compile_cache import CompileCacheKey  # start-up time: the neff-cache commands only

    return CompileCacheKey(
        model_id=args.model_id,
        revision=args.revision,
        instance_type=args.instance_type,
        tp_degree=args.tensor_parallel_size,
        dtype=args.dtype,
        buckets=args.buckets,
        torch_neuronx_version=args.torch_neuronx_version,
        torch_version=args.torch_version,
    )


def cmd_neff_cache_push(args) -> int:
    from optimum_qwen35.hub.compile_cache import push_compile_cache  # start-up time: this command only

    cache_dir = args.cache_dir or _default_neff_cache_dir()
    result = push_compile_cache(cache_dir, args.cache_repo, _neff_cache_key(args), token=args.token, endpoint=args.endpoint)
    if result.commit_sha is None:
        print(f"{result.cache_repo} already holds every file of {cache_dir} under {result.prefix}: nothing pushed")
    else:
        print(f"pushed {len(result.uploaded)} file(s) to {result.cache_repo}/{result.prefix} (commit {result.commit_sha})")
    return 0


def cmd_neff_cache_pull(args) -> int:
    from optimum_qwen35.hub.compile_cache import fetch_compile_cache  # start-up time: this command only

    cache_dir = args.cache_dir or _default_neff_cache_dir()
    result = fetch_compile_cache(cache_dir, args.cache_repo, _neff_cache_key(args), token=args.token, endpoint=args.endpoint)
    if not result.hit:
        print(f"{result.cache_repo} has no compile cache under {result.prefix}: the first run compiles")
    else:
        print(f"fetched {len(result.fetched)} file(s) into {cache_dir} ({len(result.present)} already there)")
    return 0


def cmd_neff_cache_list(args) -> int:
    from optimum_qwen35.hub.compile_cache import list_compile_caches  # start-up time: this command only

    entries = list_compile_caches(args.cache_repo, model_id=args.model_id, token=args.token, endpoint=args.endpoint)
    if not entries:
        print(f"no TorchNeuron compile cache in {args.cache_repo}" + (f" for {args.model_id}" if args.model_id else ""))
        return 0
    for e in entries:
        k = e.key
        buckets = ";".join(f"{kind}={','.join(map(str, sizes))}" for kind, sizes in k.buckets.items())
        print(
            f"{k.model_id}@{k.revision}  {k.instance_type}  tp {k.tp_degree}  {k.dtype}  {buckets}  torch {k.torch_version}"
            f"  torch-neuronx {k.torch_neuronx_version}  {e.files} file(s), {e.bytes} bytes  {e.prefix}"
        )
    return 0


def _default_neff_cache_dir() -> Path:
    from optimum_qwen35.hub.compile_cache import default_neff_cache_dir  # start-up time: the neff-cache commands only

    return default_neff_cache_dir()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2) that point at --help, and every long flag spelled both
    ways (`--tensor_parallel_size` as optimum-cli writes it, `--tensor-parallel-size` as argparse users do)."""

    def add_argument(self, *names, **kwargs):
        spelled = list(names)
        for name in names:
            if name.startswith("--"):
                for other in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
                    if other not in spelled:
                        spelled.append(other)
        return super().add_argument(*spelled, **kwargs)

    def error(self, message: str):
        message = re.sub(r"(--[\w-]+)/(--[\w-]+)", lambda m: m[1] if m[1].replace("_", "-") == m[2].replace("_", "-") else m[0], message)
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _fail(error: BaseException | str, status: int, prog: str = "optimum-qwen35") -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return status


def _add_export_arguments(p) -> None:
    p.add_argument("--model", "-m", required=True, help="a Qwen3.5 checkpoint folder or Hugging Face Hub id")
    p.add_argument("--revision", help="the Hub revision (branch, tag or commit) of --model")
    p.add_argument("--task", default="text-generation", help="the task (only text-generation)")
    p.add_argument("--batch_size", "--batch-size", type=int, default=1, help="compiled batch size: sequences served at once (default 1)")
    p.add_argument("--sequence_length", "--sequence-length", type=int, help="compiled length: prompt + new tokens (default min(max positions, 4096))")
    p.add_argument("--tensor_parallel_size", "--tensor-parallel-size", type=int, help="ranks to split the model over (default: 1 on cpu; on Neuron, the largest valid degree <= the machine's cores)")
    p.add_argument("--torch_dtype", "--dtype", choices=["bfloat16", "float32"], help="weights and activations dtype (default: the checkpoint's)")
    p.add_argument("--target", choices=["cpu", "trn1", "inf2", "trn2"], help="compilation target (default: cpu without the Neuron SDK)")
    p.add_argument("--neuron_backend", "--neuron-backend", choices=["nxd", "torchneuron"],
                   help="a Neuron target's backend (default: by target and what is installed; trn2 without any Neuron "
                   "SDK: torchneuron, an export that needs no SDK; docs/torchneuron.md)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in OUT")
    p.add_argument("--vision", action="store_true", help="also export the vision tower's graphs (cpu target, TP 1; docs/vision.md)")
    p.add_argument("--image_buckets", "--image-buckets", type=_int_list,
                   help="with --vision: image buckets in 16x16-pixel patches, comma-separated (default 256,1024,4096)")
    p.add_argument("--mtp", action="store_true",
                   help="also export the multi-token-prediction head's graphs, for generate(..., num_speculative_tokens=k) "
                   "(any tensor_parallel_size; every backend; docs/speculative_decoding.md)")
    p.add_argument("out", help="the export folder to write")


def export_parser() -> argparse.ArgumentParser:
    """`optimum-qwen35 export`'s arguments alone (optimum-cli's `export neuron` translates into them)."""
    p = _Parser(prog="optimum-qwen35 export")
    _add_export_arguments(p)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`prog`: the command the user typed when another front end runs `export` (`optimum-cli export neuron`,
    optimum_cli.py): the export's usage errors and its one-line errors start with it."""
    parser = _Parser(prog="optimum-qwen35", description="Qwen3.5 on AWS Trainium/Inferentia through optimum-neuron, and on the CPU.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument(
        "--verbose", action="store_true",
        help="show what other libraries print (optimum-neuron's device probe, the Hub client's retries)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, title="commands", metavar="COMMAND")

    p = sub.add_parser("demo", help="chat with an embedded tiny random checkpoint (no network, no Neuron)")
    p.add_argument("--prompt", default="Give me a short introduction to large language models.", help="the user message")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, help="how many tokens to generate at most (default 32)")
    p.add_argument("--layout", default="tiny-2b", choices=["tiny-2b", "tiny-nv2x", "tiny-nv3x"], help="which tiny layout to build")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weights and activations dtype (default float32; `generate` defaults to bfloat16)",
    )
    p.add_argument("--out", help="keep the tiny checkpoint in this folder (default: a temporary one)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out, whole")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "export",
        **({"prog": prog} if prog else {}),
        help="compile a checkpoint into an optimum-neuron export folder (the flags of `optimum-cli export neuron`)",
        description="Compile a Qwen3.5 checkpoint for a target and save the export folder that "
        "`NeuronModelForCausalLM.from_pretrained` (and Qwen35NeuronModelForCausalLM) loads.",
    )
    _add_export_arguments(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="greedy generation from a checkpoint folder on the CPU graphs")
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder (a Hub snapshot)")
    p.add_argument("--prompt", required=True, help="the user message (chat template applied unless --raw)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="how many tokens to generate at most (default 64)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations dtype (default bfloat16; `demo` defaults to float32)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("shard", help="convert a checkpoint and save one safetensors file per tensor-parallel rank")
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint folder")
    p.add_argument("--tensor-parallel-size", type=_positive_int, required=True, help="number of ranks")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model or export in OUT, whole")
    p.add_argument("out", help="the folder to write the rank shards to")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("build-tiny", help="write a tiny random Qwen3.5 checkpoint")
    p.add_argument("out", help="the folder to write the checkpoint to")
    p.add_argument("--layout", default="tiny-2b", choices=["tiny-2b", "tiny-nv2x", "tiny-nv3x"], help="head layout: nv = nk, 2 nk or 3 nk")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="on-disk dtype of the weights")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT, whole")
    p.set_defaults(func=cmd_build_tiny)

    token_help = "Hugging Face token (default: HF_TOKEN or the stored login)"
    endpoint_help = "the Hub URL (default: HF_ENDPOINT, else https://huggingface.co)"
    p = sub.add_parser("push", help="push an exported folder to a Hub model repo in one commit")
    p.add_argument("folder", help="the exported folder (config.json, neuron_config.json, graphs)")
    p.add_argument("repo_id", help="the Hub model repo, 'namespace/name' (created if missing)")
    p.add_argument("--revision", help="the branch to push to (created from main if missing; default: main)")
    p.add_argument(
        "--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)"
    )
    p.add_argument("--token", help=token_help)
    p.add_argument("--commit-message", help="the commit message (default: describes the export)")
    p.add_argument("--endpoint", help=endpoint_help)
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", help="download an exported model from the Hub and print its local folder")
    p.add_argument("model", help="a Hub repo id of an export, or a local export folder")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--token", help=token_help)
    p.add_argument("--endpoint", help=endpoint_help)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("cache", help="the optimum-neuron compile-cache registry (needs optimum-neuron)")
    cache = p.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    p = cache.add_parser("sync", help="register an export in the compile-cache repo")
    p.add_argument("folder", help="the exported folder")
    p.add_argument("--cache-repo", help="the cache repo (default: CUSTOM_CACHE_REPO, else optimum-neuron's)")
    p.add_argument("--model-id", help="the Hub id to file the entry under (default: the export's checkpoint_id)")
    p.add_argument(
        "--source-config",
        help="the config (folder or config.json) the architecture digest is computed from (default: the export's)",
    )
    p.add_argument("--token", help=token_help)
    p.add_argument("--endpoint", help=endpoint_help)
    p.set_defaults(func=cmd_cache_sync)
    p = cache.add_parser("lookup", help="list the registered configurations of a Hub model")
    p.add_argument("model_id", help="the Hub id of the source model")
    p.add_argument("--cache-repo", help="the cache repo (default: CUSTOM_CACHE_REPO, else optimum-neuron's)")
    p.add_argument("--target", help="only this target (cpu, trn1, trn2)")
    p.add_argument("--batch-size", type=int, help="only this batch size")
    p.add_argument("--sequence-length", type=int, help="only this sequence length")
    p.add_argument("--tensor-parallel-size", type=int, help="only this tensor parallel degree")
    p.add_argument("--dtype", choices=sorted(DTYPES) + ["float16"], help="only this dtype")
    p.set_defaults(func=cmd_cache_lookup)

    p = sub.add_parser("neff-cache", help="TorchNeuron's compile cache (NEFFs) on the Hub: push, pull, list")
    neff = p.add_subparsers(dest="neff_cache_command", required=True, parser_class=_Parser)
    cache_dir_help = "the local TorchNeuron cache folder (default: TORCH_NEURONX_NEFF_CACHE_DIR, else /tmp/neff_cache)"
    for name, func, text in (
        ("push", cmd_neff_cache_push, "upload a local cache folder under the configuration's key, in one commit"),
        ("pull", cmd_neff_cache_pull, "download the cache of a configuration into the local cache folder"),
    ):
        p = neff.add_parser(name, help=text)
        p.add_argument("--cache-repo", required=True, help="the cache repo (must exist)")
        p.add_argument("--cache-dir", type=Path, help=cache_dir_help)
        p.add_argument("--model-id", required=True, help="the Hub id of the source model")
        p.add_argument("--revision", required=True, help="the source model's commit the export was made from")
        p.add_argument("--instance-type", required=True, help="the instance type, e.g. trn2.48xlarge")
        p.add_argument("--tensor-parallel-size", type=_positive_int, required=True, help="the TP degree")
        p.add_argument("--dtype", choices=sorted(DTYPES), required=True, help="the export dtype")
        p.add_argument("--buckets", type=_buckets, required=True, help="the compiled buckets, e.g. 'context=128,1024;token=1024'")
        p.add_argument("--torch-neuronx-version", help="default: the installed torch-neuronx (required without it)")
        p.add_argument("--torch-version", help="default: the installed torch")
        p.add_argument("--token", help=token_help)
        p.add_argument("--endpoint", help=endpoint_help)
        p.set_defaults(func=func)
    p = neff.add_parser("list", help="list the TorchNeuron caches filed in a cache repo")
    p.add_argument("--cache-repo", required=True, help="the cache repo")
    p.add_argument("--model-id", help="only this source model")
    p.add_argument("--token", help=token_help)
    p.add_argument("--endpoint", help=endpoint_help)
    p.set_defaults(func=cmd_neff_cache_list)

    args = parser.parse_args(argv)
    if args.verbose:


        os.environ[VERBOSE_ENV] = "1"
    try:
        return args.func(args)
    except Qwen35Error as error:
        if args.debug:
            raise
        return _fail(error, error.exit_status, prog or "optimum-qwen35")
    except KeyboardInterrupt:
        return _fail(KeyboardInterrupt("interrupted"), 130, prog or "optimum-qwen35")
    except OSError as error:  # the disk or the system refused (full, no permission): the user can act on it
        if args.debug:
            raise
        return _fail(error, 1, prog or "optimum-qwen35")
    except Exception as error:  # a bug: still one line, and how to get the traceback
        if args.debug:
            raise
        return _fail(f"unexpected {type(error).__name__}: {error} (a bug: rerun with --debug and report the traceback)", 1, prog or "optimum-qwen35")


if __name__ == "__main__":
    sys.exit(main())
