"""The README's Python example runs as written (on a tiny checkpoint instead of a Hub snapshot)."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path):
    from optimum_qwen35.testing import build_tiny_checkpoint

    block = re.search(r"```python\n(from transformers import AutoTokenizer\nfrom optimum_qwen35.runtime.cpu .*?)```", README.read_text(), re.S).group(1)
    build_tiny_checkpoint(tmp_path / "ckpt", "tiny-nv2x")
    code = block.replace('"path/to/checkpoint"', repr(str(tmp_path / "ckpt")))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["logits"]) == 2 and namespace["logits"][0].shape[0] == len(namespace["prompts"][0])
    assert all(len(t) >= 1 for t in namespace["new_tokens"])


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip() == "pip install torch==2.13.0 -e . && python -m optimum_qwen35 demo"
    assert blocks[1].strip() == "pip install nox && nox"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "n==2" in ci  # .ci/run executes the README's second bash block
