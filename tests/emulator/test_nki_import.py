"""The import switch: real `nki` when usable, the emulator otherwise, or when asked."""

import importlib
import sys
import types

import pytest

from optimum_qwen35.kernels import nki_import
from optimum_qwen35.kernels.emulator import nki as emulated


@pytest.fixture
def clean_nki(monkeypatch):
    for name in ("nki", "nki.language", "nki.isa"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    importlib.reload(nki_import)


def test_env_var_forces_the_emulator(clean_nki):
    clean_nki.setenv(nki_import.ENV_VAR, "1")
    mod = importlib.reload(nki_import)
    assert mod.USING_EMULATOR and mod.nki is emulated and mod.nl is emulated.language and mod.nisa is emulated.isa


def test_placeholder_pypi_package_is_not_taken_for_nki(clean_nki, tmp_path):
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('print("WRONG PACKAGE")\n')  # PyPI's placeholder has no nki.language
    clean_nki.syspath_prepend(str(tmp_path))
    clean_nki.delenv(nki_import.ENV_VAR, raising=False)
    mod = importlib.reload(nki_import)
    assert mod.USING_EMULATOR and mod.nki is emulated
    clean_nki.setenv(nki_import.ENV_VAR, "0")
    with pytest.raises(ImportError, match="no usable `nki`"):
        importlib.reload(nki_import)


def test_placeholder_that_raises_on_import_is_ignored(clean_nki, tmp_path):
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise RuntimeError("WRONG PACKAGE: install from the Neuron repository")\n')
    clean_nki.syspath_prepend(str(tmp_path))
    clean_nki.delenv(nki_import.ENV_VAR, raising=False)
    assert importlib.reload(nki_import).USING_EMULATOR


def test_a_real_looking_nki_is_preferred_unless_the_emulator_is_forced(clean_nki):
    real = types.ModuleType("nki")
    real.jit = lambda f=None, **kw: f
    real.__path__ = []
    language = types.ModuleType("nki.language")
    language.ndarray = object()
    isa = types.ModuleType("nki.isa")
    isa.nc_matmul = object()
    real.language, real.isa = language, isa
    for name, mod in (("nki", real), ("nki.language", language), ("nki.isa", isa)):
        clean_nki.setitem(sys.modules, name, mod)
    clean_nki.delenv(nki_import.ENV_VAR, raising=False)
    mod = importlib.reload(nki_import)
    assert not mod.USING_EMULATOR and mod.nki is real and mod.nl is language and mod.nisa is isa
    assert mod.use_emulator() is emulated and mod.USING_EMULATOR and mod.nisa is emulated.isa
