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


class BuildPyWithStartupFile(build_py):
    def run(self):
        super().run()
        self.copy_file(STARTUP_FILE, os.path.join(self.build_lib, STARTUP_FILE), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, STARTUP_FILE)]


setup(packages=packages, package_dir={"optimum_qwen35.kernels": "kernels"}, cmdclass={"build_py": BuildPyWithStartupFile})
