"""The state layout: one ordered list of tensors, layer by layer, every tensor indexed by sequence slot.

    full attention layer -> K, V            [slots, kv_heads_per_rank, max_length, head_dim]  model dtype
    DeltaNet layer       -> conv state      [slots, conv_channels_per_rank, kernel - 1]       model dtype
                            recurrent state [slots, value_heads_per_rank, dk, dv]              fp32

Only the full-attention layers have a KV cache. Graphs take the state in and give it back after the logits (output
i + 1 is state i, which is how the Neuron backend aliases them): token generation writes one K/V row per active slot
at its position and one conv/recurrent state per active slot; context encoding writes its prompt's positions and its
slots' states. Nothing else changes.

How a write happens is the backend's choice (`Slots(in_place=..., graph_form=...)`, from the layer factory's
`state_in_place` and `state_graph_form`):
- in place (the CPU runtime, `TorchLayers`): `index_copy_` / `index_put_` into the given tensors, which are returned;
  a decode step costs what it reads, not a copy of every cache;
- in place in the device-graph form (TorchNeuron, `TorchNeuronLayers`: `graph_form=True`): `index_put_` into the given
  tensors, with the functional form's int32 indices and index forms (no argmax, no gather along T of a 4-D tensor,
  which lowers with rank-5 index tensors), so the graph holds no int64 and no rank 5;
- functional (the Neuron graphs, `NxDLayers`): `index_copy` / `index_put` return new tensors, the inputs are left as
  they were. torch-xla's lowering finds a graph input by the tensor's data (`LoweringContext.tensor_parameter_id`),
  and a tensor written in place is no longer an input there, so its alias to an output could not be resolved; a
  functional update is an input that stays an input, and a scatter whose result is the aliased output, which the
  compiler updates in the input's own buffer.

`seq_ids[b]` names the slot of batch row b; -1 marks an inactive row (a static-batch graph run with fewer
sequences than rows): it reads slot 0, and writes nothing. `fresh[b]` marks a row that starts a new sequence (its
first position is 0): it reads zero DeltaNet states, whatever its slot held before.

Every write is one `index_copy` / `index_put` with as many indices as batch rows. So that a static graph
needs no branch on which rows are active, an inactive row repeats the write of the first active row (same
place, same value: duplicates agree, so the write is well defined), and when no row is active every row
writes slot 0 (what they all read), which then keeps its value from before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, Qwen35Config
from .parallel import ShardedDims


class Slots:
    """Which slot each batch row reads and writes, computed once per graph call (static shapes), and how it writes.

    seq_ids [B] (-1: inactive row); fresh [B] bool or None: rows starting a sequence (zero initial DeltaNet states);
    in_place: write into the given state tensors (True) or return updated copies (False); graph_form: the device
    graphs' index forms (always with in_place=False)."""

    def __init__(self, seq_ids: torch.Tensor, fresh: torch.Tensor | None = None, in_place: bool = True,
                 graph_form: bool = False):
        # Index tensors: int64 on the CPU runtime (`index_copy_` takes no other), int32 in the graph form (the Neuron
        # graphs: int32 as NxD's own models index, no s64 in the HLO).
        self.graph_form = graph_form or not in_place
        self.index_dtype = torch.int32 if self.graph_form else torch.int64
        seq_ids = seq_ids.to(self.index_dtype)
        self.in_place = in_place
        self.seq_ids = seq_ids  # [B]: -1 marks an inactive row (the fused kernels take it as is)
        self.read = seq_ids.clamp(min=0)  # [B]: inactive rows read slot 0, harmlessly
        active = seq_ids >= 0
        self.fresh = None if fresh is None else fresh & active  # an inactive row reads its slot 0 as it is
        # A max reduce, not any(): torch-xla lowers any() to an `or` reduce, which neuronx-cc's Reduce (Min, Max, Add,
        # Mul) does not list.
        self.any_active = active.to(torch.int32).amax(0) > 0
        batch = seq_ids.shape[0]
        rows = torch.arange(batch, device=seq_ids.device, dtype=self.index_dtype)
        # The row whose write each row makes: itself when active, else the first active row (row 0 if none). In
        # the graphs a min, not an argmax (whose int64 result is an s64 in the HLO); on CPU the argmax (fewer ops).
        if not self.graph_form:
            first = active.to(self.index_dtype).argmax()
        else:
            # amin(0), not amin(): torch-xla 2.8 reduces nothing for an empty dim list.
            first = torch.where(self.any_active, torch.where(active, rows, batch).amin(0), 0)
        self.writer = torch.where(active, rows, first)
        self.slot = self.read.index_select(0, self.writer)  # [B]: the slot each row writes

    def gather(self, state: torch.Tensor) -> torch.Tensor:
        """[slots, ...] -> [B, ...]: each row's slot."""
        return state.index_select(0, self.read)

    def gather_initial(self, state: torch.Tensor) -> torch.Tensor:
        """[slots, ...] -> [B, ...]: each row's slot, zeros for fresh rows (a DeltaNet state to start from). A new
        tensor, which the caller may update in place."""
        rows = self.gather(state)
        if self.fresh is None:
            return rows
        fresh = self.fresh.view(-1, *([1] * (rows.dim() - 1)))
        if self.in_place:
            # rows is a new tensor (index_select): zeroed where fresh in place, without a zeros tensor and a select
            # into a third one (two more state-sized tensors per DeltaNet layer and decode step on CPU: issue 31).
            return rows.masked_fill_(fresh, 0)
        return torch.where(fresh, torch.zeros_like(rows), rows)

    def write(self, state: torch.Tensor, rows: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
        """The slot of each active row b becomes rows[b]; every other slot keeps its value. Returns the state:
        the same tensor, written in place, or (in_place=False) an updated copy, the input left as it was.

        With no active row every row writes slot 0 (`slot`), which keeps its value from before: in place, slot 0
        is saved and put back (one row, not a select over every row: a decode step's slot states are most of what
        it moves); functionally, the rows written are slot 0's own: `initial` (the rows `gather_initial` read, which
        are slot 0's then) when given, else read again."""
        rows = rows.to(state.dtype).index_select(0, self.writer)
        if self.graph_form:
            # In place, `initial` may have been updated by its reader since: read slot 0's rows again.
            initial = initial if not self.in_place else None
            unchanged = (initial if initial is not None else self.gather(state)).to(state.dtype).index_select(0, self.writer)
            rows = torch.where(self.any_active.view(*([1] * rows.dim())), rows, unchanged)
            if self.in_place:  # index_put_: int32 indices (index_copy_ takes int64 only)
                return state.index_put_((self.slot,), rows)
            return state.index_put((self.slot,), rows)  # not index_copy: torch-xla's takes int64 indices only
        slot_0 = state[:1].clone()
        state.index_copy_(0, self.slot, rows)
        state[:1] = torch.where(self.any_active, state[:1], slot_0)
        return state

    def write_positions(self, cache: torch.Tensor, new: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor):
        """cache [slots, H, S, D] gets new [B, H, T, D] (T <= S) at positions starts[b] + t of each active row's slot,
        for t < lengths[b] (starts[b] + lengths[b] <= S); no other position changes. Returns the cache (in place, or
        an updated copy: see `write`).

        Each row writes the window of T positions [w, w + T) holding its block, w = min(start, S - T), keeping
        the old value at the window's positions outside the block: T rows per slot, always in range."""
        B, H, T, D = new.shape
        S = cache.shape[2]
        starts, lengths = starts.to(self.index_dtype), lengths.to(self.index_dtype)
        steps = torch.arange(T, device=cache.device, dtype=self.index_dtype)
        window = starts.clamp(max=S - T)[:, None] + steps  # [B, T] cache positions
        source = window - starts[:, None]  # the block token feeding each window position
        valid = (source >= 0) & (source < lengths[:, None])
        heads = torch.arange(H, device=cache.device, dtype=self.index_dtype)
        token = source.clamp(0, T - 1)
        # The writing row's block token at each window position [B, H, T, D].
        if not self.graph_form:  # CPU: one gather along T (fewer ops than the form below)
            moved = new.gather(2, token[:, None, :, None].expand(B, H, T, D)).index_select(0, self.writer)
        else:
            # Rows of new viewed [B * H * T, D]: an index_select, not a gather along T of the 4-D tensor (which XLA
            # lowers with rank-5 index tensors).
            token = token.index_select(0, self.writer)
            flat = (self.writer[:, None, None] * H + heads[None, :, None]) * T + token[:, None, :]  # [B, H, T]
            moved = new.reshape(B * H * T, D).index_select(0, flat.reshape(-1)).view(B, H, T, D)
        valid = valid.index_select(0, self.writer) & self.any_active
        index = (
            self.slot[:, None, None],
            heads[None, :, None],
            window.index_select(0, self.writer)[:, None, :],
        )  # broadcast to [B, H, T]
        values = torch.where(valid[:, None, :, None], moved.to(cache.dtype), cache[index])
        return cache.index_put_(index, values) if self.in_place else cache.index_put(index, values)


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def state_specs(
    config: Qwen35Config, dims: ShardedDims, slots: int, max_length: int, dtype: torch.dtype
) -> list[StateSpec]:
    specs = []
    for i, layer_type in enumerate(config.layer_types):
        if layer_type == FULL_ATTENTION:
            kv_shape = (slots, dims.num_kv_heads, max_length, config.head_dim)
            specs += [StateSpec(f"layers.{i}.key_cache", kv_shape, dtype), StateSpec(f"layers.{i}.value_cache", kv_shape, dtype)]
        else:
            conv_shape = (slots, dims.linear_conv_dim, config.linear_conv_kernel_dim - 1)
            rec_shape = (slots, dims.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
            specs += [
                StateSpec(f"layers.{i}.conv_state", conv_shape, dtype),
                StateSpec(f"layers.{i}.recurrent_state", rec_shape, torch.float32),
            ]
    return specs


def allocate_state(specs: list[StateSpec], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs]
