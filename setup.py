# The `kernels/` folder of this repository is installed as `optimum_qwen35.kernels`: a top-level `kernels`
# module would shadow the Hugging Face `kernels` package that transformers probes for.
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

packages = find_packages(include=["optimum_qwen35", "optimum_qwen35.*"])
packages += ["optimum_qwen35.kernels"] + [f"optimum_qwen35.kernels.{p}" for p in find_packages("kernels")]

# `optimum_qwen35.pth` goes to site-packages itself: it makes every interpreter (optimum-cli's export
# subprocess, vLLM's workers) register Qwen3.5 once it imports transformers or optimum.neuron. A regular
# install carries it; an editable install (pip install -e) does not (see docs/optimum_neuron.md).
STARTUP_FILE = "optimum_qwen35.pth"
# optimum-cli loads every optimum/commands/register/*.py (a PEP 420 namespace): this one makes `optimum-cli export
# neuron` say what to run where the Neuron SDK is missing (optimum_qwen35/optimum_neuron/optimum_cli.py). Regular installs only, like
# the start-up file: an editable install's finder would map the whole namespace to one folder.
OPTIMUM_CLI_FILE = os.path.join("optimum", "commands", "register", "register_optimum_qwen35.py")
OPTIMUM_CLI_SOURCE = "from optimum_qwen35.optimum_neuron.optimum_cli import REGISTER_COMMANDS  # noqa: F401  (optimum-qwen35)\n"


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


setup(packages=packages, package_dir={"optimum_qwen35.kernels": "kernels"}, cmdclass={"build_py": BuildPyWithStartupFile})
