"""The README's Python example runs as written (on a tiny checkpoint instead of a Hub snapshot)."""

import re
from pathlib import Path

from . import oracle

README = Path(__file__).parents[1] / "README.md"
# The example runs in fp32; the float64 oracle (tests/oracle.py) bounds its logits at the parity tolerance.
LOGIT_ATOL = 1e-4


def test_readme_python_example_runs(tmp_path, capsys):
    """It runs, and what it computes is right: the logits are the model's (the oracle's, to fp32 rounding) at every
    position, each generated token is the argmax after the ones before it, generation stops at the first EOS, and it
    prints the decoded tokens."""
    from tests.kit import build_tiny_checkpoint

    block = re.search(r"```python\n(from transformers import AutoTokenizer\nfrom optimum_qwen35.runtime import Qwen35Runtime.*?)```", README.read_text(), re.S).group(1)
    build_tiny_checkpoint(tmp_path / "ckpt", "tiny-nv2x")
    assert 'path = "tiny-qwen3.5/"' in block  # the folder the README's `build-tiny` command writes
    code = block.replace('"tiny-qwen3.5/"', repr(str(tmp_path / "ckpt")))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    prompts, logits, new_tokens = namespace["prompts"], namespace["logits"], namespace["new_tokens"]
    eos = namespace["tokenizer"].eos_token_id
    weights = oracle.read_text_weights(tmp_path / "ckpt")
    assert len(logits) == len(new_tokens) == len(prompts) == 2
    for prompt, got, tokens in zip(prompts, logits, new_tokens):
        want = oracle.logits(weights, prompt + tokens[:-1])  # teacher-forced through the generated tokens
        assert got.shape == (len(prompt), want.shape[-1])
        assert (got.double() - want[: len(prompt)]).abs().max().item() <= LOGIT_ATOL
        steps = want[len(prompt) - 1 :]
        top2 = steps.topk(2, dim=-1).values
        for step, (token, row, (a, b)) in enumerate(zip(tokens, steps, top2)):
            if a - b < LOGIT_ATOL:  # a near-tie: fp32 may pick either; nothing after it is comparable
                break
            assert token == int(row.argmax()), f"step {step}: generated {token}, argmax {int(row.argmax())}"
        assert eos not in tokens[:-1] and (len(tokens) == 32 or tokens[-1] == eos)
    assert capsys.readouterr().out.strip() == str(namespace["tokenizer"].batch_decode(new_tokens))


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    """The first: a virtual environment, torch's CPU build from PyTorch's CPU index (PyPI's Linux torch is the CUDA
    build), this package and the rest from PyPI, the demo. The second needs PyPI alone (nox installs torch)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip().splitlines() == [
        "python -m venv ~/venvs/qwen35 && source ~/venvs/qwen35/bin/activate",
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e . "
        "&& python -m optimum_qwen35 demo",
    ]
    assert blocks[1].strip() == "pip install nox && nox"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "n==2" in ci  # .ci/run executes the README's second bash block


def test_readme_sections_in_order_and_the_docs_index_lists_every_page():
    """intro -> the two commands -> requirements -> support table -> install -> quick start -> docs index -> numbers,
    errors, tests, layout (optimum-neuron's README's order); one index line per docs/*.md page."""
    text = README.read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections == ["What works where", "Install", "Quick start: use it as optimum-neuron models are used",
                        "Documentation", "Numbers", "Errors", "Tests", "Layout"]
    assert text.index("```bash") < text.index("**Requirements**") < text.index("## What works where")
    index = text[text.index("## Documentation"):text.index("## Numbers")]
    listed = re.findall(r"^- `(docs/[^`]+\.md)`: \S", index, re.M)
    pages = sorted(str(p.relative_to(README.parent)) for p in (README.parent / "docs").glob("*.md"))
    assert sorted(listed) == pages and len(listed) == len(set(listed))
    assert "huggingface-cli" not in text  # deprecated: `hf download`
