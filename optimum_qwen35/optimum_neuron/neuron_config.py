"""The export's `neuron_config.json` as optimum-neuron's own `NxDNeuronConfig` (the NxD stack).

Reading, writing and checking the file need no optimum-neuron (`neuron_model/neuron_config.py`, re-exported here);
this module makes the config object optimum-neuron's class, as optimum-neuron's runners and vLLM worker expect.
"""

from __future__ import annotations

import os

from optimum_qwen35.neuron_model import neuron_config as neutral
from optimum_qwen35.neuron_model.neuron_config import (  # noqa: F401  (this module's former contents, re-exported)
    CPU_TARGET,
    NEURON_TARGETS,
    TARGETS,
    check_expected,
    check_shape,
    neuron_config_fields,
    neuronxcc_version,
    normalize_dtype,
    normalize_target,
    optimum_neuron_version,
    read_fields,
    save,
    to_dict,
)


def nxd_neuron_config(checkpoint_id, checkpoint_revision, target, batch_size, sequence_length, tp_degree, dtype):
    """The `NxDNeuronConfig` of a Qwen3.5 export, for any target (the cpu one and the Neuron ones alike)."""
    from optimum.neuron.models.inference.backend.config import NxDNeuronConfig  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK

    return NxDNeuronConfig(
        **neuron_config_fields(checkpoint_id, checkpoint_revision, target, batch_size, sequence_length, tp_degree, dtype)
    )


def load(folder: str | os.PathLike):
    """Read and check `neuron_config.json` (`read_fields`) as a plain NxDNeuronConfig."""
    from optimum.neuron.models.inference.backend.config import NxDNeuronConfig  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK

    return neutral.load(folder, NxDNeuronConfig)
