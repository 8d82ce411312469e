"""The one place kernels get NKI from: the real ``nki`` package when it is installed, the CPU emulator otherwise.

Kernels write::

    from optimum_qwen35.kernels.nki_import import nki, nl, nisa, USING_EMULATOR

The real package is used when ``import nki`` gives the genuine NKI (>= 0.3, Neuron SDK 2.29+), unless the environment
variable ``OPTIMUM_QWEN35_NKI_EMULATOR=1`` asks for the emulator (or ``OPTIMUM_QWEN35_NKI_EMULATOR=0`` forbids it).
PyPI's ``nki`` is a placeholder ("WRONG PACKAGE") without ``nki.language``; it is detected and ignored.
Call :func:`use_emulator` before importing kernel modules to force the emulator from code (tests).
"""

from __future__ import annotations

import importlib
import os
import types

ENV_VAR = "OPTIMUM_QWEN35_NKI_EMULATOR"


def _real_nki():
    """The genuine NKI modules ``(nki, nki.language, nki.isa)``, or None when absent or a placeholder."""
    try:
        real = importlib.import_module("nki")
        if getattr(real, "IS_EMULATOR", False):  # the emulator installed as `nki` (install_as_nki)
            return None
        language = importlib.import_module("nki.language")
        isa = importlib.import_module("nki.isa")
    except Exception:  # ImportError, or the placeholder package raising on import
        return None
    if not callable(getattr(real, "jit", None)) or not hasattr(language, "ndarray") or not hasattr(isa, "nc_matmul"):
        return None
    return real, language, isa


def _emulated():
    from ..emulator import nki as emulated  # only where the real NKI package is absent

    return emulated, emulated.language, emulated.isa


def _select(force_emulator: bool | None = None):
    if force_emulator is None:
        flag = os.environ.get(ENV_VAR, "").strip().lower()
        force_emulator = True if flag in ("1", "true", "yes") else (False if flag in ("0", "false", "no") else None)
    if force_emulator:
        return (*_emulated(), True)
    real = _real_nki()
    if real is not None:
        return (*real, False)
    if force_emulator is False:
        raise ImportError(f"{ENV_VAR}=0 but no usable `nki` package (NKI >= 0.3, Neuron SDK 2.29+) is installed")
    return (*_emulated(), True)


nki, nl, nisa, USING_EMULATOR = _select()


def use_emulator(enabled: bool = True) -> types.ModuleType:
    """Switch this module's ``nki``/``nl``/``nisa`` to the emulator (or back to auto-detection with False).

    Kernel modules bind the names when they are imported, so call this before importing them (or reload them)."""
    global nki, nl, nisa, USING_EMULATOR
    nki, nl, nisa, USING_EMULATOR = _select(True if enabled else None)
    return nki


__all__ = ["nki", "nl", "nisa", "USING_EMULATOR", "use_emulator", "ENV_VAR"]
