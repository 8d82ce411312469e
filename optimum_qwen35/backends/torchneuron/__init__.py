"""The TorchNeuron backend (trn2 / trn3, Neuron SDK 2.33+): the model's graphs compiled on the device by
`torch.compile(backend="neuron", fullgraph=True, dynamic=False)`, TorchNeuron's native PyTorch path.

The model definition is the cpu target's (`optimum_qwen35.modeling` with plain torch layers and functional
collectives); this package only supplies what a TorchNeuron graph needs around it:

    layers.py   (no SDK) the layer factory: the cpu target's, the whole block in one pass, the Neuron precision form
    device.py   (no SDK) whether TorchNeuron is installed, and its import with a one-line error without it
    runner.py   (no SDK to import) the graph runner of the host loop: one compiled graph per bucket, weights and
                state on the device, the state mutated in place (TorchNeuron keeps input mutations as aliases) and
                not also returned (`StateInPlaceGraph`)
    stablehlo_check.py, stablehlo_collectives.py, stablehlo_contract.py
                (torch-mlir, the `stablehlo` extra) the check of the graphs on CPU: a torch.compile backend following
                TorchNeuron's pipeline down to StableHLO, and the compiler contract (docs/torchneuron.md)

An export for this backend needs no SDK (export/layout.py: the cpu target's folders, a graphs.json without program
files): TorchNeuron compiles each graph on first use. docs/torchneuron.md says what has run (on CPU, through
`torch.compile` with a check backend down to StableHLO, or with torch's "eager" backend) and what has not (anything
with TorchNeuron, neuronx-cc or a device).
"""
