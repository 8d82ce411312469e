"""The decoder built over neuronx-distributed's layers (`NxDLayers`, the Neuron export's layer factory) run on
torch-xla's CPU device behind the runtime's graph-runner interface, so that the host loop (`Qwen35Runtime`:
prefill, generate, speculative decoding, prefix caching) drives the Neuron form of every graph.

Each call runs one flat-argument graph module (modeling/decoder.py, modeling/speculative_graphs.py) on XLA tensors
and ends with one `torch_xla.sync()`: one XLA graph execution whose inputs are the call's inputs and the state,
and whose outputs are the results and the new state (state_in_place=False: updated copies, as the aliased Neuron
graphs return them). The state lives on the device between calls. What this is not: the NxD export's builders
(state held as aliased parameters, `tests.kit.neuron_xla.build_graphs`) or neuronx-cc; prefix snapshots go through
the host (what a Neuron runtime would do with device-to-host copies of the state buffers).
"""

from __future__ import annotations

import collections

import torch
import torch_xla

from optimum_qwen35.backends.nxd.layers import NxDLayers
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.speculative_graphs import CommitGraph, ContextHiddenGraph, MTPGraph, VerifyGraph
from optimum_qwen35.runtime.eager import EagerGraphs
from optimum_qwen35.runtime.prefix_cache import restore_blocks, take_block


def nxd_decoder(eager: Qwen35Decoder, dtype: torch.dtype) -> Qwen35Decoder:
    """The decoder over `NxDLayers` at TP 1 (inside `traced_parallel_state(1)`) holding `eager`'s weights, on CPU."""
    decoder = Qwen35Decoder(eager.config, 1, NxDLayers(1, dtype), mtp=eager.mtp is not None)
    params = {n: t for n, t in eager.state_dict().items() if n != "embed_tokens.rank"}
    missing, unexpected = decoder.load_state_dict(params, strict=False)
    # Not checkpoint weights: the embedding's rank tensor (`use_spmd_rank`, arange(1) at TP 1) and
    # neuronx-distributed's unsharded `master_weight` copies, which the forward never reads.
    left = [n for n in missing if not n.endswith(("rank_util.rank", ".master_weight"))]
    assert not unexpected and not left, (left, unexpected)
    return decoder.eval()


class XlaRunner(EagerGraphs):
    """`EagerGraphs`' calls, each one XLA graph execution of the decoder's flat graph module (see the module's
    docstring). `executions` counts them by kind."""

    def __init__(self, decoder: Qwen35Decoder, batch_size: int, max_length: int):
        super().__init__(decoder.to(torch_xla.device()), batch_size, max_length)
        self.device = torch_xla.device()
        self.state = [t.to(self.device) for t in self.state]
        self.mtp_state = [t.to(self.device) for t in self.mtp_state]
        self.executions = collections.Counter()

    def _run(self, kind: str, module, *inputs) -> tuple:
        with torch.no_grad():
            out = module(*(t.to(self.device) for t in inputs))
        torch_xla.sync()
        self.executions[kind] += 1
        return out

    def _module(self, kind: str, key_length, make):
        key = (kind, key_length)
        if key not in self._graphs:
            self._graphs[key] = make()
        return self._graphs[key]

    def context(self, length, all_logits, key_length, *inputs):
        logits, *self.state[:] = self._run("context", self._graph("context", length, all_logits, key_length),
                                           *inputs, *self.state)
        return logits.cpu()

    def token(self, key_length, *inputs):
        logits, *self.state[:] = self._run("token", self._graph("token", 1, False, key_length), *inputs, *self.state)
        return logits.cpu()

    def context_hidden(self, length, key_length, *inputs):
        module = self._module("context_hidden", key_length, lambda: ContextHiddenGraph(self.decoder, key_length))
        logits, hidden, *self.state[:] = self._run("context_hidden", module, *inputs, *self.state)
        return logits.cpu(), hidden.cpu()

    def verify(self, key_length, ids, positions, lengths, seq_ids):
        module = self._module("verify", key_length, lambda: VerifyGraph(self.decoder, key_length))
        out = self._run("verify", module, ids, positions, lengths, seq_ids, *self.state)
        n = len(self.state)
        self._verified, self.state[:] = list(out[2 : len(out) - n]), out[len(out) - n :]
        return out[0].cpu(), out[1].cpu()

    def commit(self, seq_ids, accepted):
        assert self._verified is not None, "commit without a verify before it"
        module = self._module("commit", None, lambda: CommitGraph(self.decoder))
        self.state[:] = self._run("commit", module, seq_ids, accepted, *self._verified, *self.state)
        self._verified = None

    def mtp(self, key_length, ids, hidden, positions, lengths, seq_ids):
        module = self._module("mtp", key_length, lambda: MTPGraph(self.decoder, key_length))
        logits, out, *self.mtp_state[:] = self._run("mtp", module, ids, hidden, positions, lengths, seq_ids,
                                                    *self.mtp_state)
        return logits.cpu(), out.cpu()

    # Prefix-cache snapshots through the host: the slot's rows copied out, and written back into the device state.
    def take_block(self, slot, start, end):
        return take_block([t.cpu() for t in self.state], [s.name for s in self.state_specs], slot, start, end)

    def restore_blocks(self, slot, snapshots, block_size):
        host = [t.cpu() for t in self.state]
        restore_blocks(host, [s.name for s in self.state_specs], slot, snapshots, block_size)
        self.state[:] = [t.to(self.device) for t in host]
