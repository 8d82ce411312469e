"""The DeltaNet kernels are sized for trn2 (224 KiB of SBUF per partition), the target of their cost goals.

Importing optimum-neuron on a machine without Neuron sets NEURON_PLATFORM_TARGET_OVERRIDE=trn1, which the
emulator would follow: these tests name their target instead. On trn1/inf2 (192 KiB) the prefill kernel at
the 2B layer's 16 heads per rank does not fit (docs/kernels.md, limits).
"""

import pytest


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("OPTIMUM_QWEN35_NKI_TARGET", "trn2")
