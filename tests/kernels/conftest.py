"""The DeltaNet kernels are sized for trn2 (224 KiB of SBUF per partition), the target of their cost goals.

Importing optimum-neuron on a machine without Neuron sets NEURON_PLATFORM_TARGET_OVERRIDE=trn1, which the
emulator would follow: these tests name their target instead (trn2 is also where the prefill kernel runs as an
LNC=2 launch, its two programs in turn on the emulator).
"""

import pytest


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("OPTIMUM_QWEN35_NKI_TARGET", "trn2")
