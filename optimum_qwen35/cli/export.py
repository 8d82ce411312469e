"""`optimum-qwen35 export`: compile a checkpoint into an export folder, with the flags of `optimum-cli export neuron`.

Both stacks (README, "Which stack"): where optimum-neuron is installed (the NxD stack: Python 3.10-3.11), the export
goes through its `NeuronModelForCausalLM` subclass; where it is absent (the TorchNeuron stack: Python 3.12+, torch
2.13/2.14, transformers 5), through this package's own class. What needs the NxD stack there (trn1, inf2,
`--neuron_backend nxd`) is refused in one line before anything loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from optimum_qwen35.cli.parser import Parser, int_list
from optimum_qwen35.errors import ExportError, UsageError

TARGETS = ["cpu", "trn1", "trn1n", "inf2", "trn2"]
NXD_TARGETS = ("trn1", "trn1n", "inf2")
# optimum-neuron's `--auto_cast_type` (its README and most Neuron model cards export decoders with bf16): the export's
# dtype; its other types (fp16, tf32, mixed) are no dtype Qwen3.5 exports in.
AUTO_CAST_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
NXD_STACK = ("the NxD stack: Python 3.10 or 3.11 with optimum-neuron 0.4.5 (pip install \"optimum-qwen35[optimum]\"; "
             "on the instance the Neuron SDK too, `[neuronx]` from AWS's Neuron package index)")


def optimum_neuron_installed() -> bool:
    """optimum-neuron is what tells the two stacks apart (torch-neuronx is on both: TorchNeuron's package has its name)."""
    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.neuron") is not None


def nxd_stack_needed(what: str) -> UsageError:
    return UsageError(
        f"{what} needs {NXD_STACK}; this environment has no optimum-neuron (the TorchNeuron stack): export for "
        "--instance_type trn2 (TorchNeuron) or cpu here"
    )


def add_export_arguments(p) -> None:
    p.add_argument("--model", "-m", required=True, help="a Qwen3.5 checkpoint folder or Hugging Face Hub id")
    p.add_argument("--revision", help="the Hub revision (branch, tag or commit) of --model")
    p.add_argument("--task", default="text-generation", help="the task (only text-generation; auto means it)")
    p.add_argument("--batch_size", type=int, default=1, help="compiled batch size: sequences served at once (default 1)")
    p.add_argument("--sequence_length", type=int, help="compiled length: prompt + new tokens (default min(max positions, 4096))")
    p.add_argument("--tensor_parallel_size", "--num_cores", type=int, dest="tensor_parallel_size",
                   help="ranks to split the model over (default: 1 on cpu; on Neuron, the largest valid degree <= the "
                   "machine's cores; --num_cores is optimum-neuron's older name)")
    p.add_argument("--torch_dtype", "--dtype", choices=["bfloat16", "float32"], help="weights and activations dtype (default: the checkpoint's)")
    p.add_argument("--auto_cast_type", choices=sorted(AUTO_CAST_DTYPES),
                   help="optimum-neuron's spelling of the dtype: bf16 is --torch_dtype bfloat16, fp32 float32")
    p.add_argument("--target", "--instance_type", choices=TARGETS, dest="target",
                   help="compilation target, optimum-cli's --instance_type (default: cpu without the Neuron SDK; trn1, "
                   "trn1n and inf2 need the NxD stack)")
    p.add_argument("--neuron_backend", choices=["nxd", "torchneuron"],
                   help="a Neuron target's backend (default: by target and what is installed; trn2 without any Neuron "
                   "SDK: torchneuron, an export that needs no SDK; docs/torchneuron.md)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in OUT")
    p.add_argument("--vision", action="store_true", help="also export the vision tower's graphs (cpu target, TP 1; docs/vision.md)")
    p.add_argument("--image_buckets", type=int_list,
                   help="with --vision: image buckets in 16x16-pixel patches, comma-separated (default 256,1024,4096)")
    p.add_argument("--mtp", action="store_true",
                   help="also export the multi-token-prediction head's graphs, for generate(..., num_speculative_tokens=k) "
                   "(any tensor_parallel_size; every backend; docs/speculative_decoding.md)")
    p.add_argument("--draft_vocab_size", type=int,
                   help="with --mtp: the head drafts over this many token ids, the first of the checkpoint's "
                   "draft_vocab.json ranking (else its tokenizer's merge order); cpu target, TP 1; speculation stays "
                   "exact; docs/speculative_decoding.md")
    p.add_argument("--weights_dtype", choices=["fp8"],
                   help="fp8: the linear weights as float8 with Qwen's 128x128 block scales (an FP8 checkpoint's as they "
                   "are, a bf16 one's quantized at export); every target; docs/fp8.md")
    p.add_argument("--fp8_lm_head", action="store_true",
                   help="with --weights_dtype fp8: lm_head in FP8 too (Qwen's format keeps it bf16), untied from the "
                   "embedding; the small sizes' largest weight; docs/fp8.md")
    p.add_argument("out", help="the export folder to write")


def export_parser() -> Parser:
    """`optimum-qwen35 export`'s arguments alone (optimum-cli's `export neuron` translates into them)."""
    p = Parser(prog="optimum-qwen35 export")
    add_export_arguments(p)
    return p


def add_command(sub, prog: str | None = None) -> None:
    p = sub.add_parser(
        "export",
        **({"prog": prog} if prog else {}),
        help="compile a checkpoint into an export folder (the flags of `optimum-cli export neuron`)",
        description="Compile a Qwen3.5 checkpoint for a target and save the export folder that "
        "`NeuronModelForCausalLM.from_pretrained` loads. Takes optimum-cli's flags (--instance_type, --auto_cast_type, "
        "-m) and every long flag as --a_b and --a-b.",
    )
    add_export_arguments(p)
    p.set_defaults(func=cmd_export)


def export_dtype(args) -> str | None:
    """--torch_dtype, or --auto_cast_type's dtype; both given must agree."""
    if args.auto_cast_type is None:
        return args.torch_dtype
    dtype = AUTO_CAST_DTYPES[args.auto_cast_type]
    if args.torch_dtype is not None and args.torch_dtype != dtype:
        raise UsageError(f"--auto_cast_type {args.auto_cast_type} ({dtype}) and --torch_dtype {args.torch_dtype} disagree: give one")
    return dtype


def model_class():
    """The class that exports on this stack (`optimum_qwen35.NeuronModelForCausalLM`): optimum-neuron's subclass on
    the NxD stack, this package's own on the TorchNeuron stack."""
    from optimum_qwen35.neuron_model import neuron_model_class  # start-up time: export only

    return neuron_model_class()


def check_export(args):
    """Everything `export` checks before the first graph is compiled: the stack, the destination, the arguments, the
    source. Returns the neuron config."""
    if args.task == "auto":
        args.task = "text-generation"
    if args.task != "text-generation":
        raise UsageError(f"--task {args.task!r} is not supported: Qwen3.5 exports for text-generation")
    dtype = export_dtype(args)
    if not optimum_neuron_installed():
        if args.target in NXD_TARGETS:
            raise nxd_stack_needed(f"--instance_type {args.target}")
        if args.neuron_backend == "nxd":
            raise nxd_stack_needed("--neuron_backend nxd")
    from optimum_qwen35.export.cpu import check_save_directory  # start-up time: this command only

    try:
        check_save_directory(Path(args.out), args.overwrite, source=args.model)
    except ExportError as error:
        raise UsageError(str(error).replace("overwrite=True (--overwrite)", "--overwrite")) from error
    return model_class().get_neuron_config(
        args.model,
        revision=args.revision,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=dtype,
        target=args.target,
    )


def cmd_export(args) -> int:
    out = Path(args.out)
    neuron_config = check_export(args)
    model = model_class().export(
        args.model, neuron_config, revision=args.revision, vision=args.vision, image_buckets=args.image_buckets,
        neuron_backend=args.neuron_backend, mtp=args.mtp, **({"weights_dtype": args.weights_dtype} if args.weights_dtype else {}),
        **({"draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size is not None else {}),
        **({"fp8_lm_head": True} if args.fp8_lm_head else {}),
    )
    model.save_pretrained(out, overwrite=args.overwrite)
    backend = getattr(model, "backend", None)  # (the NxD class has none: optimum-neuron's own export)
    print(
        f"exported {args.model} for {neuron_config.target}{' (torchneuron backend)' if backend == 'torchneuron' else ''}"
        f" (batch {neuron_config.batch_size}, sequence length {neuron_config.sequence_length}, TP "
        f"{neuron_config.tp_degree}, {str(neuron_config.torch_dtype).removeprefix('torch.')}) to {out}"
    )
    return 0
