"""Command line: `python -m optimum_qwen35 <command>` (or `optimum-qwen35 <command>`).

Qwen3.5 on AWS Trainium/Inferentia on both stacks (optimum-neuron's NxD stack, TorchNeuron), and on the CPU.
`optimum-qwen35 --help` lists the commands, `optimum-qwen35 <command> --help` their options. One module per job:
main.py (the parser and the one-line errors), checkpoint.py (demo, generate, shard, build-tiny), export.py,
hub.py (push, pull, cache, neff-cache), optimum_cli.py (`optimum-cli export neuron` where optimum-neuron's own
command is not there).
"""

from optimum_qwen35.cli.export import check_export, export_parser
from optimum_qwen35.cli.main import main

__all__ = ["check_export", "export_parser", "main"]
