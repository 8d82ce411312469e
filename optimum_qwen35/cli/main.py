"""`optimum-qwen35 <command>` (or `python -m optimum_qwen35 <command>`): the parser of every command, and one line
for every error."""

from __future__ import annotations

import os

from optimum_qwen35.cli import checkpoint, export, hub
from optimum_qwen35.cli.parser import Parser, fail
from optimum_qwen35.errors import Qwen35Error
from optimum_qwen35.patches import VERBOSE_ENV


def parser(prog: str | None = None) -> Parser:
    """`prog`: what `export`'s errors start with when another front end runs it (optimum_cli.py)."""
    main_parser = Parser(prog="optimum-qwen35", description="Qwen3.5 on AWS Trainium/Inferentia (optimum-neuron's "
                         "NxD stack or TorchNeuron), and on the CPU.")
    main_parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    main_parser.add_argument(
        "--verbose", action="store_true",
        help="show what other libraries print (optimum-neuron's device probe, the Hub client's retries)",
    )
    sub = main_parser.add_subparsers(dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND")
    checkpoint.add_commands(sub)
    export.add_command(sub, prog)
    hub.add_commands(sub)
    return main_parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`prog`: the command the user typed when another front end runs `export` (`optimum-cli export neuron`,
    optimum_cli.py): the export's usage errors and its one-line errors start with it."""
    args = parser(prog).parse_args(argv)
    prog = prog or "optimum-qwen35"
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    try:
        return args.func(args)
    except Qwen35Error as error:
        if args.debug:
            raise
        return fail(error, error.exit_status, prog)
    except KeyboardInterrupt:
        return fail(KeyboardInterrupt("interrupted"), 130, prog)
    except OSError as error:  # the disk or the system refused (full, no permission): the user can act on it
        if args.debug:
            raise
        return fail(error, 1, prog)
    except Exception as error:
        if args.debug:
            raise
        if isinstance(error, ImportError) and (error.name or "").startswith("optimum.neuron"):
            # (ModuleNotFoundError: a command of optimum-neuron's own, the compile-cache registry, on the other stack)
            return fail(f"`{args.command}` needs optimum-neuron, not installed here: {export.NXD_STACK}", 1, prog)
        # a bug: still one line, and how to get the traceback
        return fail(f"unexpected {type(error).__name__}: {error} (a bug: rerun with --debug and report the traceback)", 1, prog)
