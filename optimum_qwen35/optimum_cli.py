"""`optimum-cli export neuron` where the Neuron SDK is not installed.

optimum-cli registers `export neuron` only when torch-neuronx imports, so without the SDK it answers
"unrecognized arguments: neuron" and nothing else. optimum-cli loads every `optimum/commands/register/*.py` of any
installed distribution; a regular install of this package puts one there (`register_optimum_qwen35.py`, written by
setup.py, importing this module), which registers, only where torch-neuronx is absent, an `export neuron` that says
why it cannot run and prints the `optimum-qwen35 export --target cpu` command that exports the same model on this
machine (same flags). With the SDK it registers nothing: optimum-neuron's own command runs. Light: standard library
and optimum's command base classes only (optimum-cli imports it at start-up).
"""

from __future__ import annotations

import importlib.util
import shlex
import sys

# The flags of `optimum-cli export neuron` that `optimum-qwen35 export` takes too (the rest are compiler options).
SHARED_FLAGS = {"--model", "-m", "--task", "--batch_size", "--sequence_length", "--tensor_parallel_size",
                "--torch_dtype", "--instance_type", "--revision"}


def neuron_sdk_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def message(arguments: list[str]) -> str:
    """The one line printed instead of an export: why, and the command to run instead."""
    kept, i = [], 0
    while i < len(arguments):
        name = arguments[i].split("=", 1)[0]
        if name in SHARED_FLAGS and "=" not in arguments[i] and i + 1 < len(arguments):
            if name != "--instance_type":
                kept += arguments[i : i + 2]
            i += 2
            continue
        if name in SHARED_FLAGS and name != "--instance_type":
            kept.append(arguments[i])
        i += 1
    # The output folder: optimum-cli's last positional argument (other flags are compiler options, left out).
    last = len(arguments) - 1
    if last >= 0 and not arguments[last].startswith("-") and (last == 0 or not arguments[last - 1].startswith("-")):
        kept.append(arguments[last])
    command = " ".join(["optimum-qwen35", "export", *map(shlex.quote, kept), "--target", "cpu"])
    return (
        "optimum-cli export neuron: error: the Neuron SDK (torch-neuronx, neuronx-distributed) is not installed, so "
        "optimum-neuron registers no `export neuron` here; on a Neuron instance install it from AWS's package index "
        f"(pip install \"optimum-qwen35[neuronx]\"); on this machine export Qwen3.5 for the cpu target: {command}"
    )


def _commands():
    if neuron_sdk_available():
        return []
    from optimum.commands.base import BaseOptimumCLICommand, CommandInfo  # noqa: PLC0415
    from optimum.commands.export.base import ExportCommand  # noqa: PLC0415

    class NeuronExportWithoutSDK(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name="neuron", help="export to Neuron (needs the Neuron SDK; says what to run without it)")

        @staticmethod
        def parse_args(parser):
            parser.prefix_chars = "\0"  # take every argument as given: the message repeats the user's own flags
            parser.add_argument("arguments", nargs="*")

        def run(self):
            print(message(self.args.arguments), file=sys.stderr)
            sys.exit(2)

    return [(NeuronExportWithoutSDK, ExportCommand)]


REGISTER_COMMANDS = _commands()
