# The `kernels/` folder of this repository is installed inside the package, as subpackages of `optimum_qwen35.kernels`
# (whose own module, the dispatch, is optimum_qwen35/kernels/__init__.py): `kernels/gated_delta_rule` is
# `optimum_qwen35.kernels.gated_delta_rule`, and so on. kernels/ has no __init__.py: nothing imports it as a top-level
# `kernels`, and from the repository's root (on sys.path under pytest or `python -c`) it is only a namespace portion,
# which a regular `kernels` package anywhere on sys.path (Hugging Face's, which transformers imports) wins over.
import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

packages = find_packages(include=["optimum_qwen35", "optimum_qwen35.*"])
KERNEL_PACKAGES = {f"optimum_qwen35.kernels.{p}": os.path.join("kernels", *p.split(".")) for p in find_packages("kernels")}
packages += list(KERNEL_PACKAGES)

# `optimum_qwen35.pth` goes to site-packages itself: it makes every interpreter (optimum-cli's export
# subprocess, vLLM's workers) register Qwen3.5 once it imports transformers or optimum.neuron. Both a regular and an
# editable install (pip install -e, below) carry it (see docs/optimum_neuron.md).
STARTUP_FILE = "optimum_qwen35.pth"
# optimum-cli loads every optimum/commands/register/*.py (a PEP 420 namespace): this one makes `optimum-cli export
# neuron` work where optimum-neuron's own command is missing: no SDK, or no optimum-neuron (the TorchNeuron stack;
# optimum_qwen35/cli/optimum_cli.py). A file, not a
# package of this distribution: an editable install's finder would map the whole namespace to one folder.
OPTIMUM_CLI_FILE = os.path.join("optimum", "commands", "register", "register_optimum_qwen35.py")
OPTIMUM_CLI_SOURCE = "from optimum_qwen35.cli.optimum_cli import REGISTER_COMMANDS  # noqa: F401  (optimum-qwen35)\n"


class BuildPyWithStartupFile(build_py):
    def run(self):
        super().run()
        self.copy_file(STARTUP_FILE, os.path.join(self.build_lib, STARTUP_FILE), preserve_mode=False)
        target = os.path.join(self.build_lib, OPTIMUM_CLI_FILE)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(OPTIMUM_CLI_SOURCE)

    def get_outputs(self, include_bytecode=True):
        extra = [os.path.join(self.build_lib, f) for f in (STARTUP_FILE, OPTIMUM_CLI_FILE)]
        return super().get_outputs(include_bytecode) + extra


class EditableWheelWithStartupFile(editable_wheel):
    """`pip install -e` (PEP 660): setuptools' editable wheel maps the packages to this folder and leaves out what
    build_py writes beside them; the two files above are added to it and to its RECORD (pip uninstall removes them).
    Its own `__editable__.*.pth` sorts before `optimum_qwen35.pth`, so the package is importable when that one runs."""

    def run(self):
        super().run()
        wheel = max(Path(self.dist_dir).glob("*.whl"), key=lambda path: path.stat().st_mtime)  # the one just built
        add_to_wheel(wheel, {STARTUP_FILE: Path(STARTUP_FILE).read_bytes(),
                             OPTIMUM_CLI_FILE.replace(os.sep, "/"): OPTIMUM_CLI_SOURCE.encode()})


def add_to_wheel(wheel: Path, files: dict) -> None:
    """Rewrite the wheel with `files` (archive name -> bytes) added, each with its RECORD line (PEP 376, PEP 427)."""
    with zipfile.ZipFile(wheel) as old:
        entries = {info.filename: (info, old.read(info)) for info in old.infolist()}
    (record,) = [name for name in entries if name.endswith(".dist-info/RECORD")]
    lines = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
             for name, data in files.items()]
    info, data = entries.pop(record)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as new:
        for old_info, old_data in entries.values():
            new.writestr(old_info, old_data)
        for name, new_data in files.items():
            new.writestr(name, new_data)
        new.writestr(info, data.decode().rstrip("\n") + "\n" + "\n".join(lines) + "\n")


setup(packages=packages, package_dir=KERNEL_PACKAGES,
      cmdclass={"build_py": BuildPyWithStartupFile, "editable_wheel": EditableWheelWithStartupFile})
