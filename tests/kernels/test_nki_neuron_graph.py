"""The Neuron graphs' DeltaNet layers through the NKI kernels, as far as CPU can run them.

The traced forward's body (`neuron.adapter.step`) is run with the CPU layer factory naming the "nki" kernel backend,
as `Qwen35NxDDecoderModel` names it through `NxDLayers` (there the kernels are `nki.jit` launches on torch-xla
tensors; here they run on the emulator). It must give the torch references' logits and held state, through the
dispatch's NKI entry points (counted by the test kit's wrappers in the registry), without touching the process-wide
backend.
"""

import pytest
import torch

from optimum_qwen35 import kernels
from optimum_qwen35.kernels import nki_import
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.runtime.eager import load_decoder

from ..conftest import FIXTURES
from ..kit.kernel_calls import count_kernel_calls
from ..test_neuron_backend import allocate, context_batch, run, tokens


class FunctionalLayers(TorchLayers):
    """State updates as the Neuron graphs make them (updated copies; `run` checks the inputs are left as they were)."""

    state_in_place = False


@pytest.mark.parametrize("layers", [TorchLayers, FunctionalLayers], ids=["in-place", "functional"])
@pytest.mark.parametrize("layout_name", ["tiny-2b", "tiny-nv2x"])
def test_traced_forward_runs_the_nki_kernels_named_by_its_layer_factory(layout_name, layers):
    assert kernels.get_backend() == "torch"
    path = FIXTURES / layout_name
    with_nki = load_decoder(path, layers=layers(kernel_backend="nki"))
    with_torch = load_decoder(path, layers=layers(kernel_backend="torch"))
    deltanet_layers = sum(not layer.is_attention for layer in with_nki.layers)
    layout = adapter.StateLayout(with_nki.state_specs(2, 64))
    held_nki, held_torch = allocate(layout), allocate(layout)

    def both(ids, positions, seq_ids):
        nonlocal held_nki, held_torch
        logits_nki, held_nki = run(with_nki, layout, held_nki, ids, positions, seq_ids)
        logits_torch, held_torch = run(with_torch, layout, held_torch, ids, positions, seq_ids)
        torch.testing.assert_close(logits_nki, logits_torch, rtol=0, atol=1e-4)
        for got, want, spec in zip(held_nki, held_torch, layout.held_specs):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=spec.name)

    with count_kernel_calls("nki", "torch") as calls:
        # Context encoding of right-padded prompts (lengths 9 and 4) into slots 0 and 1.
        ids, positions = context_batch([list(range(3, 12)), [7, 8, 9, 10]], 16)
        both(ids, positions, [0, 1])
        assert calls["nki", "deltanet_prefill"] == calls["torch", "deltanet_prefill"] == deltanet_layers
        # Token generation, then with row 1 inactive (seq_id -1: writes nothing).
        both(tokens([12, 11]), tokens([9, 4]), [0, 1])
        slot1 = [h[1].clone() for h in held_nki]
        both(tokens([13, 5]), tokens([10, 7]), [0, -1])
        assert all(torch.equal(h[1], s) for h, s in zip(held_nki, slot1))
        assert calls["nki", "deltanet_decode"] == calls["torch", "deltanet_decode"] == 2 * deltanet_layers
    # The choice was this model's: the process-wide backend is still the reference.
    assert kernels.get_backend() == "torch"


def test_a_model_naming_no_backend_follows_the_process_wide_one():
    decoder = load_decoder(FIXTURES / "tiny-2b")
    layout = adapter.StateLayout(decoder.state_specs(1, 16))
    with count_kernel_calls("nki", "torch") as calls:
        ids, positions = context_batch([[3, 4, 5]], 8)
        run(decoder, layout, allocate(layout), ids, positions, [0])
    assert calls["torch", "deltanet_prefill"] > 0 and calls["nki", "deltanet_prefill"] == 0


@pytest.mark.parametrize("target", ["trn2", "trn3", "trn1", "inf2", None])
def test_kernel_backend_of_the_neuron_graphs(monkeypatch, target):
    # The graphs trace the references (in the compiler's form: the gate's softplus from exp / log) unless asked for
    # the kernels, on every target.
    for real_nki in (True, False):
        assert adapter.kernel_backend(None, target, real_nki) == "torch_for_neuron"
        assert adapter.kernel_backend("torch", target, real_nki) == "torch_for_neuron"
        with pytest.raises(ValueError, match="'nki' or 'torch'"):
            adapter.kernel_backend("emulator", target, real_nki)
    if target not in ("trn2", "trn3"):
        # NKI 0.3+ compiles for trn2 and later: trn1 / inf2 always run the torch form, real NKI or not.
        for real_nki in (True, False):
            with pytest.raises(ValueError, match="trn2 and later only"):
                adapter.kernel_backend("nki", target, real_nki)
        return
    # Without the real NKI (the emulator cannot run inside a traced graph): refused.
    with pytest.raises(ValueError, match="real NKI"):
        adapter.kernel_backend("nki", target, real_nki=False)
    # With it: the kernels (they return their states, which the graph aliases as it does the references').
    assert adapter.kernel_backend("nki", target, real_nki=True) == "nki"
    # By default the answer is `nki_import`'s probe: here the emulator; with the probe saying real NKI, the kernels.
    assert nki_import.USING_EMULATOR
    with pytest.raises(ValueError, match="real NKI"):
        adapter.kernel_backend("nki", target)
    monkeypatch.setattr(nki_import, "USING_EMULATOR", False)
    assert adapter.kernel_backend("nki", target) == "nki"


def test_kernel_lnc_of_the_neuron_graphs():
    """The LNC degree the graphs launch the kernels with: the neuron config's (what the graphs compile with) where
    set, else the target's default: 2 on trn2 / trn3, 1 on trn1 / inf2."""
    assert [adapter.kernel_lnc(t) for t in ("trn2", "trn3", "trn1", "inf2", None)] == [2, 2, 1, 1, 1]
    assert adapter.kernel_lnc("trn2", 1) == 1 and adapter.kernel_lnc("trn1", 2) == 2
