"""The project's NKI kernels use only NKI 0.3's API: what the emulator accepts beyond it runs here and fails on a
device. The emulator refuses instruction keywords NKI does not take (tests/emulator/test_isa.py); this module checks
the tensor members the kernels touch, and compares both with the Neuron SDK's own API files where a local snapshot of
aws-neuron/aws-neuron-sdk is present (skipped without one)."""

import ast
import inspect
import os
import pathlib
import subprocess

import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import isa, nki, runtime
from optimum_qwen35.kernels.emulator.tensors import NOT_IN_NKI_03, NkiTensor

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "gated_delta_rule"
NKI_KERNEL_FILES = ("cte.py", "tkg.py")  # the @nki.jit kernels (fused.py and reference.py are torch)
MODULES = {"nki", "nl", "nisa"}  # nl.broadcast_to(...) is NKI 0.3's function, not the tensor member
SDK_REPO = os.environ.get("OPTIMUM_QWEN35_NKI_DOCS_REPO", "/work/.mirror/aws-neuron+aws-neuron-sdk/repo")


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


def sdk_api(path):
    """The parsed module `path` of the SDK snapshot's HEAD (nki/api/nki/...), or a skip."""
    if not os.path.isdir(SDK_REPO):
        pytest.skip(f"no local snapshot {SDK_REPO}")
    source = subprocess.run(["git", "--git-dir", SDK_REPO, "show", f"HEAD:{path}"], capture_output=True,
                            text=True).stdout
    if not source:
        pytest.skip(f"{path} is not in the snapshot")
    return ast.parse(source)


def test_the_list_is_what_the_emulator_has_beyond_the_sdk():
    """NOT_IN_NKI_03 is exactly the emulator's public NkiTensor members that the SDK's NkiTensor lacks."""
    module = sdk_api("nki/api/nki/language/__init__.py")
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "NkiTensor")
    sdk = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    sdk |= {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign)}
    ours = {k for k in dir(NkiTensor) if not k.startswith("_")}
    assert ours - sdk == NOT_IN_NKI_03


def test_every_instruction_takes_the_keywords_of_the_sdk_api():
    """Each emulated nki.isa instruction accepts the keywords of the SDK's nki.isa and refuses one it does not list."""
    module = sdk_api("nki/api/nki/isa/__init__.py")
    api = {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in module.body
           if isinstance(f, ast.FunctionDef)}
    nl, nisa = nki.language, nki.isa
    checked = 0
    with runtime.use(runtime.Context("trn2")):
        for name, params in sorted(api.items()):
            ours = getattr(isa, "_" + name, getattr(isa, name, None))
            if ours is None or "dst" not in params or not hasattr(nisa, name):
                continue
            signature = inspect.signature(ours)
            named = [p for p, v in signature.parameters.items() if v.kind is not inspect.Parameter.VAR_KEYWORD]
            assert not [p for p in params if p not in named], f"{name}: NKI parameters the emulator lacks"
            # the unknown keyword is refused before any argument is looked at (the others are placeholders)
            required = {p: None for p, v in signature.parameters.items()
                        if v.default is inspect.Parameter.empty and v.kind is v.POSITIONAL_OR_KEYWORD and p != "dst"}
            dst = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.sbuf)
            dst.write(np.zeros((8, 4), np.float32))
            with pytest.raises(TypeError, match="not_an_nki_keyword"):
                getattr(nisa, name)(dst=dst, **required, not_an_nki_keyword=1)
            checked += 1
    assert checked >= 15
