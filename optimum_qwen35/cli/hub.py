"""`optimum-qwen35 push`, `pull`, `cache` and `neff-cache`: exports and compile caches on the Hugging Face Hub."""

from __future__ import annotations

import argparse
from pathlib import Path

from optimum_qwen35.cli.parser import DTYPES, Parser, int_list, positive_int


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
        buckets[kind.strip()] = int_list(sizes)
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


def add_commands(sub) -> None:
    """push, pull, cache and neff-cache, on the subcommands `sub` of the main parser."""
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
    cache = p.add_subparsers(dest="cache_command", required=True, parser_class=Parser)
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
    neff = p.add_subparsers(dest="neff_cache_command", required=True, parser_class=Parser)
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
        p.add_argument("--tensor-parallel-size", type=positive_int, required=True, help="the TP degree")
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
