"""`optimum-cli export neuron` where optimum-neuron's own command is not there.

optimum-cli gets `export neuron` from optimum-neuron, which registers it only when torch-neuronx imports. So it is
missing in two places: optimum-neuron without the Neuron SDK (the NxD stack on a machine without Neuron devices), and
the TorchNeuron stack (Python 3.12+, optimum 2.x's base CLI, no optimum-neuron; torch-neuronx may be there, as
TorchNeuron's package has that name). optimum-cli loads every `optimum/commands/register/*.py` of any installed
distribution; an install of this package puts one there (`register_optimum_qwen35.py`, written by setup.py,
importing this module), which registers, unless optimum-neuron's own command is there, an `export neuron` taking
optimum-neuron's flags: with `--instance_type cpu` it exports Qwen3.5 for the cpu target (`optimum-qwen35 export`);
with `--instance_type trn2` for TorchNeuron, whose export needs no SDK (the device compiles it on first load). trn1,
inf2 or no instance type: with optimum-neuron, one line saying that the SDK is missing and giving the cpu command
(checked first as the export would check it); without it, one line naming the NxD stack they need. Light at
start-up: standard library and optimum's command base classes only (optimum-cli imports it for every command).
"""

from __future__ import annotations

import importlib.util
import shlex
import sys

PROG = "optimum-cli export neuron"
# optimum-neuron 0.4.5's flags that `optimum-qwen35 export` takes, by their name there (`--num_cores` is its
# deprecated spelling of `--tensor_parallel_size`).
VALUE_FLAGS = {"--model": "--model", "-m": "--model", "--task": "--task", "--batch_size": "--batch_size",
               "--sequence_length": "--sequence_length", "--tensor_parallel_size": "--tensor_parallel_size",
               "--num_cores": "--tensor_parallel_size", "--torch_dtype": "--torch_dtype",
               "--instance_type": "--target", "--weights_dtype": "--weights_dtype"}
# Its compiler options: nothing to do for the cpu target (no neuronx-cc), so left out of the cpu command.
COMPILER_VALUE_FLAGS = {"--auto_cast", "--compiler_workdir"}
COMPILER_SWITCHES = {"-O1", "-O2", "-O3", "--disable_neuron_cache", "--inline-weights-neff", "--disable-validation"}
# Switches passed on as they are: `--overwrite`, which the export's own "folder not empty" error names.
SWITCHES = {"--overwrite": "--overwrite", "--fp8_lm_head": "--fp8_lm_head"}
NEURON_INSTANCE_TYPES = ("trn1", "inf2", "trn1n", "trn2")
DTYPES = ("bfloat16", "float32")
# `--auto_cast_type` (optimum-neuron's README and most Neuron model cards export decoders with `bf16`): the export's
# dtype; its other types (fp16, tf32, mixed) are no dtype Qwen3.5 exports in.
AUTO_CAST_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
HELP = f"""usage: {PROG} --model MODEL [--instance_type {{cpu,{','.join(NEURON_INSTANCE_TYPES)}}}]
       [--task text-generation] [--batch_size N] [--sequence_length N] [--tensor_parallel_size N]
       [--torch_dtype {{{','.join(DTYPES)}}} | --auto_cast_type {{{','.join(AUTO_CAST_DTYPES)}}}] [--weights_dtype fp8]
       [--fp8_lm_head] [--overwrite] OUTPUT

Export Qwen3.5 with optimum-neuron's flags (optimum-qwen35; the Neuron SDK is not installed here).
`--instance_type cpu` exports for this machine's CPU; `trn2` for TorchNeuron (no SDK needed to export: a trn2/trn3
instance compiles it on first load); trn1, inf2 and trn1n need the Neuron SDK, and without it the command says so and
gives the cpu command.

arguments:
  -m, --model MODEL          a Qwen3.5 checkpoint folder or Hugging Face Hub id
  OUTPUT                     the export folder to write
  --instance_type TYPE       cpu; trn2 (TorchNeuron); trn1, inf2, trn1n (need the Neuron SDK)
  --task text-generation     the task (auto is text-generation)
  --batch_size N             compiled batch size: sequences served at once (default 1)
  --sequence_length N        compiled length: prompt + new tokens (default min(max positions, 4096))
  --tensor_parallel_size N   ranks to split the model over (--num_cores is its older name)
  --torch_dtype DTYPE        bfloat16 or float32 (default: the checkpoint's)
  --auto_cast_type TYPE      bf16 or fp32: the export's dtype, as --torch_dtype bfloat16 / float32
  --weights_dtype fp8        FP8 weights (Qwen's 128x128 blocks; a bf16 checkpoint is quantized); every target
  --fp8_lm_head              with --weights_dtype fp8: lm_head in FP8 too (Qwen's format keeps it bf16)
  --overwrite                replace an existing export in OUTPUT
  -h, --help                 show this help and exit

Accepted and unused (no neuronx-cc runs at export): --auto_cast, --compiler_workdir, -O1, -O2, -O3,
--disable_neuron_cache, --inline-weights-neff, --disable-validation. More: `optimum-qwen35 export --help`.
"""


class ArgumentError(ValueError):
    pass


def optimum_neuron_installed() -> bool:
    return importlib.util.find_spec("optimum.neuron") is not None


def optimum_neuron_command_registered() -> bool:
    """optimum-neuron registers its `export neuron` where torch-neuronx imports (optimum-neuron's
    commands/register/register_export.py); torch-neuronx alone (TorchNeuron, no optimum-neuron) registers nothing."""
    return optimum_neuron_installed() and importlib.util.find_spec("torch_neuronx") is not None


def translate(arguments: list[str]) -> tuple[list[str], str | None, list[str]]:
    """optimum-cli's arguments -> (`optimum-qwen35 export` arguments without --target, the instance type, the
    user's arguments with the compiler options left out). ArgumentError for anything the cpu export cannot take."""
    export, kept, instance_type, out, i, auto_cast = [], [], None, None, 0, None
    while i < len(arguments):
        name, eq, inline = arguments[i].partition("=")
        if name in VALUE_FLAGS or name in COMPILER_VALUE_FLAGS or name == "--auto_cast_type":
            if eq:
                value, used = inline, arguments[i : i + 1]
            elif i + 1 < len(arguments):
                value, used = arguments[i + 1], arguments[i : i + 2]
            else:
                raise ArgumentError(f"{name} needs a value")
            i += len(used)
            if name in COMPILER_VALUE_FLAGS:
                continue
            if name == "--auto_cast_type":
                if value not in AUTO_CAST_DTYPES:
                    raise ArgumentError(
                        f"--auto_cast_type {value}: Qwen3.5 exports in bfloat16 or float32 (--auto_cast_type bf16 or "
                        "fp32, or --torch_dtype bfloat16 or float32)"
                    )
                auto_cast = value
                continue
            if name == "--instance_type":
                instance_type = value
                continue
            if name == "--task" and value == "auto":
                value = "text-generation"
            if name == "--torch_dtype" and value not in DTYPES:
                raise ArgumentError(f"--torch_dtype {value}: Qwen3.5 exports in {' or '.join(DTYPES)}")
            export += [VALUE_FLAGS[name], value]
            kept += used
        elif name in COMPILER_SWITCHES:
            i += 1
        elif name in SWITCHES and not eq:
            export.append(SWITCHES[name])
            kept.append(name)
            i += 1
        elif name.startswith("-"):
            raise ArgumentError(f"{name} is not an option of Qwen3.5's export (see `optimum-qwen35 export --help`)")
        elif out is not None:
            raise ArgumentError(f"one output folder, got {out!r} and {name!r}")
        else:
            out = arguments[i]
            i += 1
    if auto_cast is not None:
        dtype = AUTO_CAST_DTYPES[auto_cast]
        if "--torch_dtype" not in export:
            export += ["--torch_dtype", dtype]
            kept += ["--torch_dtype", dtype]
        elif export[export.index("--torch_dtype") + 1] != dtype:
            given = export[export.index("--torch_dtype") + 1]
            raise ArgumentError(f"--auto_cast_type {auto_cast} ({dtype}) and --torch_dtype {given} disagree: give one")
    if "--model" not in export:
        raise ArgumentError("the following arguments are required: -m/--model")
    if out is None:
        raise ArgumentError("the following arguments are required: output (the export folder)")
    return [*export, out], instance_type, [*kept, out]


def cpu_command(kept: list[str]) -> str:
    return " ".join([PROG, *map(shlex.quote, kept), "--instance_type", "cpu"])


def check_cpu_export(export: list[str]) -> None:
    """What `optimum-qwen35 export --target cpu` checks before compiling (folder, sizes, TP degree, source)."""
    from optimum_qwen35.cli.export import check_export, export_parser  # start-up time: optimum-cli imports this module for every command

    check_export(export_parser().parse_args([*export, "--target", "cpu"]))


def message(arguments: list[str]) -> str:
    """The one line printed without the SDK for a Neuron instance type (or none): why, and the cpu command; without
    optimum-neuron (the TorchNeuron stack), the stack trn1 and inf2 need."""
    _, instance_type, kept = translate(arguments)
    if not optimum_neuron_installed() and instance_type is not None:
        from optimum_qwen35.cli.export import NXD_STACK  # start-up time: optimum-cli imports this module for every command

        return (
            f"{PROG}: error: --instance_type {instance_type} needs {NXD_STACK}; this environment has no optimum-neuron "
            f"(the TorchNeuron stack): export for trn2 (TorchNeuron) or for this machine: {cpu_command(kept)}"
        )
    needs = f"--instance_type {instance_type}" if instance_type else "an export without --instance_type (for this Neuron instance)"
    return (
        f"{PROG}: error: {needs} needs the Neuron SDK (torch-neuronx, neuronx-distributed), not installed here: on a "
        "Neuron instance install it from AWS's package index (pip install \"optimum-qwen35[neuronx]\"); on this "
        f"machine export Qwen3.5 for the cpu target: {cpu_command(kept)}"
    )


def run(arguments: list[str]) -> int:
    from optimum_qwen35.cli import main  # start-up time: optimum-cli imports this module for every command
    from optimum_qwen35.errors import Qwen35Error  # start-up time: optimum-cli imports this module for every command

    if "-h" in arguments or "--help" in arguments:
        print(HELP, end="")
        return 0
    try:
        export, instance_type, _ = translate(arguments)
        if instance_type in ("cpu", "trn2"):
            auto_cast = next((a.partition("=")[2] or arguments[k + 1] for k, a in enumerate(arguments)
                              if a.partition("=")[0] == "--auto_cast_type"), None)
            if auto_cast is not None:  # (the suggested cpu command of a Neuron type carries --torch_dtype itself)
                dtype = AUTO_CAST_DTYPES[auto_cast]
                print(f"{PROG}: --auto_cast_type {auto_cast}: exporting in {dtype} (--torch_dtype {dtype})", file=sys.stderr)
            # trn2 without torch-neuronx: a TorchNeuron export (backends/selection.py), which needs no SDK.
            return main(["export", *export, "--target", instance_type], prog=PROG)
        if instance_type is not None and instance_type not in NEURON_INSTANCE_TYPES:
            raise ArgumentError(f"--instance_type {instance_type}: choose cpu or one of {', '.join(NEURON_INSTANCE_TYPES)}")
        check_cpu_export(export)  # the suggested command must be one that runs
    except (ArgumentError, Qwen35Error) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(message(arguments), file=sys.stderr)
    return 2


def _commands():
    # Nothing to register where optimum-neuron's command is there, or where optimum's CLI itself is not installed
    # (this package's register file alone makes `optimum.commands` a namespace package).
    if optimum_neuron_command_registered() or importlib.util.find_spec("optimum.commands.base") is None:
        return []
    from optimum.commands.base import BaseOptimumCLICommand, CommandInfo  # start-up time: optimum-cli imports this module for every command
    from optimum.commands.export.base import ExportCommand  # start-up time: optimum-cli imports this module for every command

    class NeuronExportWithoutSDK(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name="neuron", help="export Qwen3.5 (--instance_type cpu or trn2 here; trn1 and inf2 need the Neuron SDK)")

        @staticmethod
        def parse_args(parser):
            parser.prefix_chars = "\0"  # take every argument as given: translate() reads optimum-neuron's flags
            parser.add_argument("arguments", nargs="*")

        def run(self):
            sys.exit(run(self.args.arguments))

    return [(NeuronExportWithoutSDK, ExportCommand)]


class _RegisterOnce(list):
    """optimum-cli imports `register_optimum_qwen35` once per folder holding it (site-packages and a PYTHONPATH
    entry, say) and registers what each import lists; argparse refuses the second `neuron`. Listed once only."""

    def __iter__(self):
        items, self[:] = list(super().__iter__()), []
        return iter(items)


REGISTER_COMMANDS = _RegisterOnce(_commands())
