"""The Neuron backend's parts that run without the Neuron SDK (`optimum_qwen35/backends/nxd/adapter.py`, `state_dict.py`).

What is checked here, on CPU: each rank's weights (names, shapes, dtypes, values) against the CPU runtime's shards
and the decoder `TorchLayers` builds, A_log / dt_bias / conv channels split with their heads; the held state order
and alias map; the fp32 re-cast after optimum-neuron's load-time cast; the padding and position conventions; the
traced forward's body (`adapter.step`) run with the CPU layer factory against transformers' logits (context encoding,
teacher-forced token generation, inactive rows, a 1-token prompt at position 0 in a used slot, a batch-1
context encoding into one slot); the compiler flags; and that nothing imports the SDK before a Neuron target asks.
What cannot run without the SDK is listed in docs/neuron_backend.md, not stubbed here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from optimum_qwen35.checkpoint.convert import CheckpointError, decoder_name, expected_shapes, stored_dtype
from optimum_qwen35.checkpoint.reader import CheckpointReader
from optimum_qwen35.checkpoint.shard import convert_and_shard, deltanet_rank_heads, shard_dim
from optimum_qwen35.config import FULL_ATTENTION, Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.parallel import ShardedDims
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.modeling.precision import NeuronPrecision
from optimum_qwen35.modeling.state import state_specs
from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.backends.nxd import state_dict as nsd
from optimum_qwen35.runtime.eager import load_decoder

from .conftest import FIXTURES, LAYOUTS, load_reference, reference_prompts
from .test_shard import EXPECTED_DEGREES, REAL_HEADS, ShapeOnlyLayers, reduced_config

LOGIT_ATOL = 1e-4  # fp32, as tests/test_parity.py


class TP:
    """The fields of an NxDNeuronConfig the conversion reads."""

    def __init__(self, tp_degree):
        self.tp_degree = tp_degree


def checkpoint_state_dict(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder with `model.language_model.` stripped, as optimum-neuron 0.4.5's
    `get_state_dict` hands them to `convert_hf_to_neuron_state_dict` (`pretrained_model.py` L265-276)."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    prefix = nsd.STATE_DICT_MODEL_PREFIX
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def neuron_rank_tensors(raw, config, t, dtype=torch.float32) -> list[dict[str, torch.Tensor]]:
    whole = nsd.convert_hf_to_neuron_state_dict(dict(raw), config, TP(t))
    if config.tie_word_embeddings:
        nsd.tie_lm_head(whole)
    return [nsd.rank_state_dict(whole, t, r, dtype) for r in range(t)]


# ------------------------------------------------------------------------------------------ weights per rank
@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-nv2x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_weights_equal_the_cpu_runtime_shards(layout, dtype):
    """The same tensors as the CPU runtime's `convert_and_shard` (read through another path: the lazy reader),
    plus the rank tensor and the lm_head's own copy of the tied embedding."""
    folder = FIXTURES / layout
    config = Qwen35Config.from_pretrained(folder)
    raw = checkpoint_state_dict(folder)
    for t in config.valid_tp_degrees():
        for rank, got in enumerate(neuron_rank_tensors(raw, config, t, dtype)):
            want = dict(convert_and_shard(CheckpointReader(folder), config, t, rank, dtype))
            assert set(got) == set(want) | {nsd.RANK_KEY, "lm_head.weight"}
            for name, tensor in want.items():
                assert got[name].dtype == stored_dtype(name, dtype) and got[name].is_contiguous(), name
                assert torch.equal(got[name], tensor), f"{layout} t={t} rank {rank}: {name}"
            assert torch.equal(got["lm_head.weight"], got["embed_tokens.weight"])
            assert got[nsd.RANK_KEY].dtype == torch.int32 and got[nsd.RANK_KEY].tolist() == [rank]


@pytest.mark.parametrize("layout", ["tiny-moe", "tiny-moe-top1"])
def test_moe_rank_weights_are_the_cpu_runtime_shards_with_the_experts_in_nxds_layout(layout):
    """Both on-disk expert forms (tiny-moe per expert, tiny-moe-top1 fused), every valid degree (experts split
    whole, padded when 6 do not divide by 4): each rank's tensors are the CPU runtime's shard, the routed experts
    transposed under `.weight` as neuronx-distributed's `Experts` holds them (gate_up [E_r, H, 2 I_r], each expert's
    gate columns before its up columns; down [E_r, I_r, H])."""
    folder = FIXTURES / layout
    config = Qwen35Config.from_pretrained(folder)
    raw = checkpoint_state_dict(folder)
    for t in config.valid_tp_degrees():
        whole = nsd.convert_hf_to_neuron_state_dict(dict(raw), config, TP(t))
        if config.tie_word_embeddings:
            nsd.tie_lm_head(whole)
        for rank in range(t):
            got = nsd.rank_state_dict(whole, t, rank, torch.float32, config)
            want = dict(convert_and_shard(CheckpointReader(folder), config, t, rank, torch.float32))
            names, experts = set(), 0
            for name, tensor in want.items():
                suffix = next((x for x in nsd.NXD_EXPERT_NAMES if name.endswith(x)), None)
                if suffix is not None:
                    name, tensor, experts = name[: -len(suffix)] + nsd.NXD_EXPERT_NAMES[suffix], tensor.transpose(1, 2), experts + 1
                names.add(name)
                assert torch.equal(got[name], tensor), f"{layout} t={t} rank {rank}: {name}"
            assert experts == 2 * config.num_hidden_layers
            tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
            assert set(got) == names | {nsd.RANK_KEY} | tied
            gate_up = got["layers.0.mlp.experts.gate_up_proj.weight"]
            assert gate_up.shape[1] == config.hidden_size and gate_up.is_contiguous()


@pytest.mark.parametrize("size", sorted(REAL_HEADS))
def test_rank_weights_fit_the_decoder_at_every_degree(size):
    """Names and shapes of every rank = the decoder's parameters (real head counts; tied and untied); every
    sharded tensor's layout is t x the per-rank size, the global size NxDLayers gives neuronx-distributed."""
    config = reduced_config(size)
    g = torch.Generator().manual_seed(0)
    raw = {name: torch.randn(shape, generator=g) for name, shape in expected_shapes(config).items()}
    raw["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3)  # dropped: not the text decoder
    raw["mtp.fc.weight"] = torch.zeros(3)
    for t in EXPECTED_DEGREES[size]:
        with torch.device("meta"):
            decoder = Qwen35Decoder(config, t, ShapeOnlyLayers(t, 0))
        params = {n: tuple(p.shape) for n, p in decoder.state_dict().items() if n != "embed_tokens.rank"}
        whole = nsd.convert_hf_to_neuron_state_dict(dict(raw), config, TP(t))
        if config.tie_word_embeddings:
            nsd.tie_lm_head(whole)
        for rank in range(t):
            got = nsd.rank_state_dict(whole, t, rank)
            assert {n: tuple(v.shape) for n, v in got.items() if n != nsd.RANK_KEY} == params
        for name, shape in params.items():
            dim = shard_dim(name)
            if dim is not None:
                assert whole[name].shape[dim] == t * shape[dim], name


@pytest.mark.parametrize("size", ["2B", "27B"])
def test_deltanet_gates_and_conv_channels_travel_with_their_heads(size):
    """A_log, dt_bias (per value head) and conv_weight (per q/k/v channel) of rank r are its heads' entries,
    built head by head here, not with the layout code."""
    config = reduced_config(size)
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, key_dim = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_key_dim
    raw = {name: torch.randn(shape) for name, shape in expected_shapes(config).items()}
    layer = next(i for i, kind in enumerate(config.layer_types) if kind != FULL_ATTENTION)
    p = f"layers.{layer}.linear_attn."
    for t in EXPECTED_DEGREES[size]:
        whole = nsd.convert_hf_to_neuron_state_dict(dict(raw), config, TP(t))
        for rank in range(t):
            got = nsd.rank_state_dict(whole, t, rank)
            key_heads, value_heads = deltanet_rank_heads(config, t, rank)
            assert len(key_heads) == nk // t and len(value_heads) == nv // t
            for name in ("A_log", "dt_bias"):
                assert torch.equal(got[p + name], torch.stack([raw[p + name][h] for h in value_heads]))
            conv = raw[p + "conv1d.weight"][:, 0, :]
            rows = [h * dk + i for h in key_heads for i in range(dk)]
            rows += [key_dim + h * dk + i for h in key_heads for i in range(dk)]
            rows += [2 * key_dim + h * dv + i for h in value_heads for i in range(dv)]
            assert torch.equal(got[p + "conv_weight"], conv[rows])


def test_conversion_refuses_a_checkpoint_that_does_not_match():
    config = reduced_config("2B")
    raw = {name: torch.zeros(shape) for name, shape in expected_shapes(config).items()}
    del raw["layers.0.linear_attn.A_log"]
    raw["layers.0.linear_attn.dt_bias"] = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"missing \(1\): layers.0.linear_attn.A_log(.|\n)*wrong shape \(1\): layers.0.linear_attn.dt_bias"):
        nsd.convert_hf_to_neuron_state_dict(raw, config, TP(2))
    with pytest.raises(ValueError, match="does not split this model"):
        nsd.convert_hf_to_neuron_state_dict(raw, config, TP(3))


def test_conversion_takes_checkpoint_keys_with_or_without_optimum_neurons_prefix_strip():
    config = reduced_config("9B")
    g = torch.Generator().manual_seed(1)
    relative = {name: torch.randn(shape, generator=g) for name, shape in expected_shapes(config).items()}
    full = {("lm_head.weight" if n == "lm_head.weight" else "model.language_model." + n): v for n, v in relative.items()}
    default_strip = {("lm_head.weight" if n == "lm_head.weight" else "language_model." + n): v for n, v in relative.items()}
    want = nsd.convert_hf_to_neuron_state_dict(relative, config, TP(2))
    for variant in (full, default_strip):
        got = nsd.convert_hf_to_neuron_state_dict(variant, config, TP(2))
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_traced_module_reads_the_transformers_text_config(layout, tmp_path):
    """The traced module gets optimum-neuron's config: the text config of transformers (4.57 with this package's
    registered classes, or 5 with its own), as given to export and as read back from an export's config.json."""
    from transformers import AutoConfig

    from optimum_qwen35 import register_transformers_configs

    register_transformers_configs()
    want = Qwen35Config.from_pretrained(FIXTURES / layout)
    text = AutoConfig.from_pretrained(FIXTURES / layout).get_text_config()
    assert nsd.qwen_config(text) == want
    text.save_pretrained(tmp_path)
    assert nsd.qwen_config(AutoConfig.from_pretrained(tmp_path)) == want


# ------------------------------------------------------------------------------------------ held state
def test_held_state_order_and_alias_map():
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-2b")
    specs = state_specs(config, ShardedDims.from_config(config, 2), slots=3, max_length=64, dtype=torch.bfloat16)
    layout = adapter.StateLayout(specs)
    attention = [i for i, kind in enumerate(config.layer_types) if kind == FULL_ATTENTION]
    deltanet = [i for i, kind in enumerate(config.layer_types) if kind != FULL_ATTENTION]
    names = [s.name for s in layout.held_specs]
    assert names == [f"layers.{i}.{n}" for i in attention for n in ("key_cache", "value_cache")] + [
        f"layers.{i}.{n}" for i in deltanet for n in ("conv_state", "recurrent_state")
    ]
    assert layout.num_kv == 2 * len(attention)
    # Held state j is updated in place by graph output 1 + j (output 0: the logits).
    assert layout.alias_map() == {j: 1 + j for j in range(len(specs))}
    tensors = [torch.full((1,), float(i)) for i in range(len(specs))]
    assert layout.to_decoder(layout.to_held(tensors)) == tensors
    assert [s.name for s in layout.held_specs] == [specs[i].name for i in layout.output_order]
    assert {s.dtype for s in layout.held_specs if s.name.endswith("recurrent_state")} == {torch.float32}
    assert {s.dtype for s in layout.held_specs if not s.name.endswith("recurrent_state")} == {torch.bfloat16}


def test_state_dtypes_restored_after_optimum_neurons_load_cast():
    """optimum-neuron's `load_module` casts every floating tensor of the module to the model dtype
    (`decoder_builders.py` L106-117); the held state gets its dtypes back on the same Parameter objects."""
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-nv2x")
    layout = adapter.StateLayout(state_specs(config, ShardedDims.from_config(config, 1), 2, 32, torch.bfloat16))
    module = torch.nn.Module()
    module.past_key_values = torch.nn.ParameterList(
        torch.nn.Parameter(torch.zeros(s.shape, dtype=s.dtype), requires_grad=False) for s in layout.held_specs
    )
    before = list(module.past_key_values)
    load_cast(module, torch.bfloat16)
    assert {p.dtype for p in module.past_key_values} == {torch.bfloat16}
    adapter.restore_state_dtypes(module.past_key_values, layout.held_specs)
    assert [p.dtype for p in module.past_key_values] == [s.dtype for s in layout.held_specs]
    assert all(a is b for a, b in zip(before, module.past_key_values))
    with pytest.raises(ValueError, match="held state tensors"):
        adapter.restore_state_dtypes(list(module.past_key_values)[1:], layout.held_specs)


@pytest.mark.parametrize("in_place,graph_form", [(True, False), (True, True), (False, True)],
                         ids=["in-place", "in-place-graph-form", "functional"])
def test_fresh_rows_read_zero_states_and_writes_touch_only_active_slots(in_place, graph_form):
    """A row at position 0 (optimum-neuron's 1-token prompt in the token-generation graph) starts from zero
    DeltaNet states whatever its slot held; a write changes only the active rows' slots; a functional write leaves
    its input as it was and returns a new tensor."""
    from optimum_qwen35.modeling.state import Slots

    state = torch.rand(4, 3, 5) + 1
    seq_ids = torch.tensor([2, 0, -1], dtype=torch.int32)  # slot 2 starts, slot 0 continues, an inactive row
    slots = Slots(seq_ids, fresh=torch.tensor([True, False, True]), in_place=in_place, graph_form=graph_form)
    assert slots.index_dtype == (torch.int32 if graph_form else torch.int64)
    initial = slots.gather_initial(state)
    assert torch.equal(initial[0], torch.zeros(3, 5)) and torch.equal(initial[1], state[0])
    before = state.clone()
    out = slots.write(state, initial + 7)
    assert (out is state) == in_place
    if not in_place:
        assert torch.equal(state, before)
    assert torch.equal(out[2], torch.full((3, 5), 7.0)) and torch.equal(out[0], before[0] + 7)
    assert torch.equal(out[1], before[1]) and torch.equal(out[3], before[3])
    # No active row: nothing changes (every row writes slot 0 with slot 0's own value).
    idle = Slots(torch.tensor([-1, -1], dtype=torch.int32), in_place=in_place, graph_form=graph_form)
    out = idle.write(before.clone(), torch.zeros(2, 3, 5))
    assert torch.equal(out, before)


def test_write_positions_in_place_and_functional_agree():
    """The forms of `Slots.write_positions` (in place: a gather along T, int64 indices; functional, the Neuron
    graphs': an index_select over the block's rows, int32 indices; in place in that graph form, TorchNeuron's) write
    the same values: windows shifted at the cache's end, rows shorter than the block, an inactive row, and no active
    row."""
    from optimum_qwen35.modeling.state import Slots

    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 2, 16, 8, generator=generator)
    new = torch.randn(3, 2, 8, 2, generator=generator).transpose(2, 3)  # [B, H, T, D], not contiguous
    cases = [([2, 0, 3], [0, 13, 9], [8, 3, 5]), ([1, -1, 0], [4, 0, 12], [2, 8, 4]), ([-1, -1, -1], [0, 0, 0], [8] * 3)]
    for seq_ids, starts, lengths in cases:
        args = (new, torch.tensor(starts), torch.tensor(lengths))
        seq_ids = torch.tensor(seq_ids, dtype=torch.int32)
        in_place = Slots(seq_ids, in_place=True).write_positions(cache.clone(), *args)
        functional = Slots(seq_ids, in_place=False).write_positions(cache.clone(), *args)
        graph_form = cache.clone()
        written = Slots(seq_ids, in_place=True, graph_form=True).write_positions(graph_form, *args)
        assert torch.equal(in_place, functional) and torch.equal(graph_form, functional) and written is graph_form
        assert (in_place != cache).any() == bool((seq_ids >= 0).any())


# ------------------------------------------------------------------------------------------ input conventions
def test_right_padding_with_position_one_gives_back_each_rows_length():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    positions = adapter.positions_from_attention_mask(mask)
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 1, 1], [0, 1, 1, 1, 1]]
    ids, positions = adapter.pad_context_inputs(torch.ones_like(mask), positions, 8, pad_token_id=0)
    assert ids[:, 5:].eq(0).all() and positions[:, 5:].eq(1).all()
    assert adapter.context_attention_mask(positions).tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
    ]
    # A continued chunk (first position > 0) counts its own tokens.
    assert adapter.context_lengths(torch.tensor([[40, 41, 42, 1, 1], [40, 1, 1, 1, 1]])).tolist() == [3, 1]
    # A 1-token prompt padded into a wider batch reads as two tokens, as optimum-neuron then continues it at
    # position max + 1 = 2 (`increase_position_ids`): pad included, consistently.
    one = adapter.positions_from_attention_mask(torch.tensor([[1, 0, 0, 0]]))
    assert adapter.context_lengths(one).tolist() == [2]


# ------------------------------------------------------------------------------------------ the traced forward
def allocate(layout: adapter.StateLayout) -> list[torch.Tensor]:
    return [torch.zeros(s.shape, dtype=s.dtype) for s in layout.held_specs]


def context_batch(prompts: list[list[int]], length: int):
    """Right-padded ids and optimum-neuron's positions for `prompts`, padded to the compiled context length."""
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.int32)
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return adapter.pad_context_inputs(ids, adapter.positions_from_attention_mask(mask).to(torch.int32), length, pad_token_id=0)


def run(decoder, layout, held, ids, positions, seq_ids):
    given = None if decoder.state_in_place else [h.clone() for h in held]
    out = adapter.step(decoder, layout, held, ids, positions, torch.tensor(seq_ids, dtype=torch.int32))
    if given is not None:  # functional updates: the inputs are left as they were
        assert all(torch.equal(h, g) for h, g in zip(held, given))
    assert len(out) == 1 + len(held)
    logits, new = out[0], out[1:]
    assert logits.dtype == torch.float32 and logits.shape == (ids.shape[0], 1, decoder.config.vocab_size)
    for tensor, spec in zip(new, layout.held_specs):
        assert tuple(tensor.shape) == spec.shape and tensor.dtype == spec.dtype, spec.name
    return logits[:, 0], list(new)


def tokens(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int32)[:, None]


class NeuronFormLayers(TorchLayers):
    """The CPU layers with the precision policy and the state updates of `NxDLayers` (explicit attention core,
    functional state updates)."""

    precision = NeuronPrecision()
    state_in_place = False


@pytest.mark.parametrize("layers", [None, NeuronFormLayers()], ids=["torch-precision", "neuron-precision"])
@pytest.mark.parametrize("layout_name", ["tiny-2b", "tiny-nv2x"])
def test_traced_forward_matches_transformers_logits(layout_name, layers):
    """`adapter.step` with the CPU layer factory: context encoding of right-padded prompts, then teacher-forced token
    generation, an inactive row, a 1-token prompt at position 0 in a used slot, a batch-1 prefill of one slot.
    Also with the Neuron form of the precision policy, so the attention core the Neuron graphs trace is checked."""
    ref = {len(p): (p, torch.from_numpy(logits)) for p, logits in reference_prompts(load_reference(layout_name))}
    decoder = load_decoder(FIXTURES / layout_name, layers=layers)
    layout = adapter.StateLayout(decoder.state_specs(2, 128))
    held = allocate(layout)
    long, short = ref[63], ref[3]

    def check(got, prompt_len, position):
        torch.testing.assert_close(got, ref[prompt_len][1][position], rtol=0, atol=LOGIT_ATOL)

    # Context encoding of 60 and 2 tokens, right-padded to 64 with position 1.
    ids, positions = context_batch([long[0][:60], short[0][:2]], 64)
    logits, held = run(decoder, layout, held, ids, positions, [0, 1])
    check(logits[0], 63, 59)
    check(logits[1], 3, 1)
    # Token generation, teacher-forced; then slot 0 alone (row 1 inactive: it must write nothing).
    logits, held = run(decoder, layout, held, tokens([long[0][60], short[0][2]]), tokens([60, 2]), [0, 1])
    check(logits[0], 63, 60)
    check(logits[1], 3, 2)
    slot1 = [h[1].clone() for h in held]
    logits, held = run(decoder, layout, held, tokens([long[0][61], 5]), tokens([61, 9]), [0, -1])
    check(logits[0], 63, 61)
    assert all(torch.equal(h[1], s) for h, s in zip(held, slot1))

    # 1-token prompts, as optimum-neuron runs them: the token-generation graph at position 0, in used slots.
    one, two = ref[1], ref[2]
    logits, held = run(decoder, layout, held, tokens([two[0][0], one[0][0]]), tokens([0, 0]), [1, 0])
    check(logits[0], 2, 0)
    check(logits[1], 1, 0)
    logits, held = run(decoder, layout, held, tokens([two[0][1], 0]), tokens([1, 0]), [1, -1])
    check(logits[0], 2, 1)

    # Continuous batching: a batch-1 context encoding writes its slot only.
    slot0 = [h[0].clone() for h in held]
    ids, positions = context_batch([short[0]], 64)
    logits, held = run(decoder, layout, held, ids, positions, [1])
    check(logits[0], 3, 2)
    assert all(torch.equal(h[0], s) for h, s in zip(held, slot0))


def load_cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """What optimum-neuron's `load_module` does to the module it builds (`decoder_builders.py` L110-115)."""
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def test_rotary_frequencies_survive_the_load_cast():
    """The trap: bf16 positions and frequencies would be off by more than 0.1 at these positions."""
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-2b")
    want = Qwen35Decoder(config).rotary(torch.tensor([[0, 255, 301, 4095]]), torch.bfloat16)
    decoder = Qwen35Decoder(config)
    load_cast(decoder, torch.bfloat16)
    assert decoder.rotary.inv_freq.dtype == torch.float32 and decoder.rotary.inv_freq64.dtype == torch.float64
    got = decoder.rotary(torch.tensor([[0, 255, 301, 4095]]), torch.bfloat16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("layers", [None, NeuronFormLayers()], ids=["torch-precision", "neuron-precision"])
def test_traced_forward_keeps_the_state_dtypes_in_bfloat16(layers):
    """A bf16 model, cast and restored as the model instance does: K/V and conv state stay bf16, the recurrent state
    fp32, the logits fp32, through both graphs."""
    ref = {len(p): (p, torch.from_numpy(logits)) for p, logits in reference_prompts(load_reference("tiny-nv2x"))}
    decoder = load_decoder(FIXTURES / "tiny-nv2x", layers=layers)
    load_cast(decoder, torch.bfloat16)
    layout = adapter.StateLayout(decoder.state_specs(2, 64))
    assert {s.dtype for s in layout.held_specs} == {torch.bfloat16, torch.float32}
    prompt = ref[63][0]
    ids, positions = context_batch([prompt[:40], prompt[:7]], 64)
    logits, held = run(decoder, layout, allocate(layout), ids, positions, [0, 1])  # run() checks every dtype
    expected = ref[63][1]
    # bf16 weights and activations against transformers' fp32: measured 0.04 .. 0.08 here.
    assert max((logits[0] - expected[39]).abs().max(), (logits[1] - expected[6]).abs().max()) < 0.25
    logits, held = run(decoder, layout, held, tokens([prompt[40], prompt[7]]), tokens([40, 7]), [0, 1])
    assert max((logits[0] - expected[40]).abs().max(), (logits[1] - expected[7]).abs().max()) < 0.25


# ------------------------------------------------------------------------------------------ flags and config
def test_compiler_args():
    trn1, trn2 = adapter.compiler_args("trn1", 1), adapter.compiler_args("trn2", 2)
    for args in (trn1, trn2):
        assert args.split()[0] == "--auto-cast=none" and "--model-type=transformer" in args and " -O2 " in args
    assert trn1.endswith("--lnc=1 --target trn1") and trn2.endswith("--lnc=2 --target trn2")
    assert "--target" not in adapter.compiler_args(None, 1)


def test_neuron_config_checks():
    class Config:
        speculation_length, on_device_sampling, output_logits = 0, False, False

    adapter.check_neuron_config(Config())
    bad = Config()
    bad.speculation_length, bad.on_device_sampling = 4, True
    with pytest.raises(ValueError, match=r"speculation_length=4 \(must be 0\), on_device_sampling=True"):
        adapter.check_neuron_config(bad)


def test_no_neuron_sdk_import_until_a_neuron_target_asks():
    code = (
        "import sys, importlib.util\n"
        "import optimum_qwen35.backends.nxd, optimum_qwen35.backends.nxd.adapter, optimum_qwen35.backends.nxd.state_dict\n"
        "if importlib.util.find_spec('optimum') is not None and importlib.util.find_spec('optimum.neuron') is not None:\n"
        "    import optimum_qwen35.optimum_neuron.modeling\n"
        "    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('neuronx_distributed', 'torch_neuronx', 'torch_xla', 'nki', 'neuronxcc'))\n"
        "assert not loaded, loaded\n"
        "assert 'optimum_qwen35.backends.nxd.model' not in sys.modules and 'optimum_qwen35.backends.nxd.layers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_gate_parameters_back_to_fp32_after_the_load_cast():
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-2b")
    decoder = Qwen35Decoder(config)
    load_cast(decoder, torch.bfloat16)
    params = dict(decoder.named_parameters())
    gate_names = [n for n in params if n.endswith(("A_log", "dt_bias"))]
    assert gate_names and all(params[n].dtype == torch.bfloat16 for n in gate_names)
    adapter.restore_fp32_parameters(decoder)
    params_after = dict(decoder.named_parameters())
    for name, param in params_after.items():
        assert param is params[name], "the same Parameter objects (their weight slots stay as built)"
        assert param.dtype == (torch.float32 if name in gate_names else torch.bfloat16), name


def test_nxd_layers_define_everything_the_model_reads_from_its_layer_factory():
    """The model reads `layers.<name>` (methods, the precision policy, the kernel backend); `NxDLayers` cannot be
    imported without the SDK, so its source is read: each name must be defined there (a missing `precision` once
    made the traced module fail to build)."""
    import ast
    import re
    from pathlib import Path

    import optimum_qwen35

    package = Path(optimum_qwen35.__file__).parent
    read = set()
    for file in (package / "modeling").glob("*.py"):
        source = file.read_text()
        read |= set(re.findall(r"\blayers\.(?!py\b)([a-z_]+)\b", source)) | set(re.findall(r'getattr\(layers, "([a-z_]+)"', source))
    tree = ast.parse((package / "backends" / "nxd" / "layers.py").read_text())
    (nxd,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "NxDLayers"]
    defined = set()
    for node in ast.walk(nxd):
        if isinstance(node, ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defined.add(name.id)
                    elif isinstance(name, ast.Attribute) and isinstance(name.value, ast.Name) and name.value.id == "self":
                        defined.add(name.attr)
    assert {"column_linear", "row_linear", "embedding", "lm_head", "precision", "kernel_backend"} <= read
    assert read <= defined, f"NxDLayers lacks {sorted(read - defined)}"


def test_the_neuron_package_does_not_import_the_optimum_model_module():
    """One import direction: `optimum_neuron/modeling.py` hands the Neuron targets to `backends/nxd/model.py` (lazily);
    nothing in `backends/nxd/` imports `optimum_neuron/modeling.py` or `optimum_neuron/registration.py` back (it takes
    the neuron config builder from `optimum_neuron/neuron_config.py`, which imports neither)."""
    import ast
    from pathlib import Path

    import optimum_qwen35

    package = Path(optimum_qwen35.__file__).parent
    for path in [*sorted((package / "backends" / "nxd").glob("*.py")), package / "optimum_neuron" / "neuron_config.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 1 and path.parent.name == "optimum_neuron":
                module = f"optimum_neuron.{module}"  # a sibling of neuron_config.py
            imported = [module] + [f"{module}.{alias.name}" for alias in node.names]
            assert not [m for m in imported if m.endswith(("optimum_neuron.modeling", "optimum_neuron.registration"))], (path.name, imported)
