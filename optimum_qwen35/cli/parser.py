"""What every command of `optimum-qwen35` shares: argparse with one-line errors and both spellings of each flag,
the argument types, and the one-line failure."""

from __future__ import annotations

import argparse
import re
import sys

DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


class Parser(argparse.ArgumentParser):
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


def fail(error: BaseException | str, status: int, prog: str = "optimum-qwen35") -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return status
