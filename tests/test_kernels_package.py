"""The repository's top-level `kernels/` folder shadows nothing: Hugging Face's `kernels` package (which transformers
imports where installed) stays importable from the repository's root, and transformers' Qwen3.5 imports there
(setup.py: kernels/ has no __init__.py; it is installed as subpackages of `optimum_qwen35.kernels`)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_at_root(code: str) -> str:
    """`python -c code` with the repository's root first on sys.path, as `python -c` from there has it."""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_kernels_folder_is_no_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "optimum_qwen35" / "kernels" / "__init__.py").exists()


@pytest.mark.reference
def test_transformers_qwen35_imports_from_the_repository_root_beside_hf_kernels():
    """From the root (the reference session installs Hugging Face's `kernels`): `import kernels` is Hugging Face's,
    transformers' Qwen3.5 modeling imports, and this package's kernels dispatch works beside it."""
    out = run_at_root(
        "import sys, kernels, transformers.models.qwen3_5.modeling_qwen3_5 as m\n"
        "assert sys.path[0] == '', sys.path[0]\n"
        "from optimum_qwen35 import kernels as ours\n"
        "from optimum_qwen35.kernels.gated_delta_rule import fused\n"
        "print(kernels.__file__); print(ours.get_backend(), sorted(ours.backend_names()))\n"
    )
    hf_file, backends = out.splitlines()
    assert Path(hf_file).resolve() != ROOT / "kernels" / "__init__.py" and "site-packages" in Path(hf_file).parts, hf_file
    assert backends == "torch ['nki', 'torch', 'torch_for_neuron']"
