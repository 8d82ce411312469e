"""The project's NKI kernels use only NKI 0.3's API: what the emulator accepts beyond it runs here and fails on a
device. Instruction keywords are checked by the emulator itself (tests/emulator/test_isa.py); this module checks the
tensor members the kernels touch."""

import ast
import os
import pathlib
import subprocess

import pytest

from optimum_qwen35.kernels.emulator.tensors import NOT_IN_NKI_03, NkiTensor

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "gated_delta_rule"
NKI_KERNEL_FILES = ("cte.py", "tkg.py")  # the @nki.jit kernels (fused.py and reference.py are torch)
MODULES = {"nki", "nl", "nisa"}  # nl.broadcast_to(...) is NKI 0.3's function, not the tensor member


def members_used(path):
    """(line, name) of every attribute read in the file on something other than the NKI modules."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in MODULES):
            yield node.lineno, node.attr


@pytest.mark.parametrize("name", NKI_KERNEL_FILES)
def test_kernels_use_no_tensor_member_nki_lacks(name):
    bad = [(line, attr) for line, attr in members_used(KERNELS / name) if attr in NOT_IN_NKI_03]
    assert not bad, f"{name}: members of the emulator's NkiTensor that NKI 0.3 does not have: {bad}"


def test_the_scan_sees_a_member_nki_lacks(tmp_path):
    kernel = tmp_path / "k.py"
    kernel.write_text("def f(t, nl):\n    a = nl.broadcast_to(t, (4, 4))\n    return t.broadcast_to((4, 4))\n")
    assert [attr for _, attr in members_used(kernel) if attr in NOT_IN_NKI_03] == ["broadcast_to"]


SDK_REPO = os.environ.get("OPTIMUM_QWEN35_NKI_DOCS_REPO", "/work/.mirror/aws-neuron+aws-neuron-sdk/repo")


def test_the_list_is_what_the_emulator_has_beyond_the_sdk():
    """NOT_IN_NKI_03 is exactly the emulator's public NkiTensor members that the SDK's NkiTensor lacks (the SDK's
    nki/api/nki/language/__init__.py from a local aws-neuron-sdk snapshot; skipped without one)."""
    if not os.path.isdir(SDK_REPO):
        pytest.skip(f"no local snapshot {SDK_REPO}")
    source = subprocess.run(["git", "--git-dir", SDK_REPO, "show", "HEAD:nki/api/nki/language/__init__.py"],
                            capture_output=True, text=True).stdout
    if not source:
        pytest.skip("nki/api/nki/language/__init__.py is not in the snapshot")
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "NkiTensor")
    sdk = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    sdk |= {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign)}
    ours = {k for k in dir(NkiTensor) if not k.startswith("_")}
    assert ours - sdk == NOT_IN_NKI_03
