# The `kernels/` folder of this repository is installed as `optimum_qwen35.kernels`: a top-level `kernels`
# module would shadow the Hugging Face `kernels` package that transformers probes for.
from setuptools import find_packages, setup

packages = find_packages(include=["optimum_qwen35", "optimum_qwen35.*"])
packages += ["optimum_qwen35.kernels"] + [f"optimum_qwen35.kernels.{p}" for p in find_packages("kernels")]

setup(packages=packages, package_dir={"optimum_qwen35.kernels": "kernels"})
