"""The Neuron target: Qwen3.5 on optimum-neuron 0.4.5's neuronx-distributed (NxD) backend.

The model math is `optimum_qwen35.modeling` (the one definition); this package only supplies what a Neuron
graph needs around it:

    adapter.py     (no Neuron SDK) the traced forward's body, the state order and aliasing, the fp32 re-cast
                   of the recurrent state, the padding/position conventions, the compiler flags, the kernels' LNC
    state_dict.py  (no Neuron SDK) checkpoint -> the TP layout of `checkpoint/shard.py` -> each rank's tensors;
                   a vision export's mark in its config and its tower's tensors per rank
    fp8.py         (no Neuron SDK) an export with FP8 weights: which weights, their scales' shapes, each rank's
                   float8 tensors fitted to trn1 / inf2 / trn2's float8_e4m3
    runner.py      (optimum-neuron) the graph runner of the host loop (runtime/host_loop.py) over the traced model,
                   for prompts holding images
    layers.py      (SDK) the layer factory over neuronx-distributed's parallel layers
    traced.py      (SDK) the traced modules (the decoder, the vision tower of one image bucket), the graphs' tags
    builders.py    (SDK) the graph builders and model instances (text, logits, image, vision, speculative graphs)
    model.py       (SDK) the NxDModelForCausalLM subclass and its decoder wrapper

Importing this package imports nothing; `layers`, `traced`, `builders` and `model` import the Neuron SDK and are
imported only by the Neuron targets of `optimum_qwen35.optimum_neuron.Qwen35NeuronModelForCausalLM`. See
docs/neuron_backend.md for what has never run with the SDK or on a device.
"""
