"""The fused seams as `torch.library` custom ops (optimum_qwen35/kernels/custom_ops.py).

TorchDynamo records each seam as one node of its op, with no graph break (`torch.compile(fullgraph=True)` with a
backend that counts the captured graph's nodes), `torch.export` too; the op's results equal the eager seam's on the
backend the call names (the torch reference, the NKI kernels on the emulator); its fake implementation gives the
shapes and dtypes the real one does; `torch.library.opcheck` passes.
"""

import operator

import pytest
import torch

from optimum_qwen35 import kernels
from optimum_qwen35.kernels import custom_ops

from .test_gated_delta_rule_cte import make as make_prefill
from .test_gated_delta_rule_tkg import make as make_decode
from .test_gated_delta_rule_verify import make as make_verify

DECODE = torch.ops.optimum_qwen35.deltanet_decode.default
PREFILL = torch.ops.optimum_qwen35.deltanet_prefill.default
VERIFY = torch.ops.optimum_qwen35.deltanet_verify.default


class Capture:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self):
        """The captured calls, leaving out the tuple indexing of an op's results."""
        return [node.target for gm in self.graphs for node in gm.graph.nodes
                if node.op == "call_function" and node.target is not operator.getitem]


def decode_step(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent):
    return kernels.deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent,
                                   backend="torch", donate_initial=True)


def verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent):
    return kernels.deltanet_verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent,
                                   backend="torch")


def prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths):
    return kernels.deltanet_prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, backend="torch")


def decode_inputs(dtype=torch.float32):
    return make_decode(2, 2, 4, 16, 32, dtype, seed=11, zero_rows=(1,))


def verify_inputs(dtype=torch.float32):
    return make_verify(2, 3, 2, 4, 16, 32, dtype, seed=13, zero_rows=(1,))


def prefill_inputs(dtype=torch.float32):
    inputs = make_prefill(2, 2, 4, 16, 16, 70, dtype, seed=12, zero_rows=(0,))
    return {**inputs, "lengths": torch.tensor([70, 33])}


@pytest.mark.parametrize("seam, inputs, op", [(decode_step, decode_inputs, DECODE), (verify, verify_inputs, VERIFY),
                                               (prefill, prefill_inputs, PREFILL)], ids=["decode", "verify", "prefill"])
def test_dynamo_captures_each_seam_as_one_op_node(seam, inputs, op):
    torch._dynamo.reset()
    capture = Capture()
    args = inputs()
    compiled = torch.compile(seam, backend=capture, fullgraph=True)
    got = compiled(**{k: v.clone() for k, v in args.items()})
    assert len(capture.graphs) == 1
    assert capture.ops() == [op]
    want = seam(**{k: v.clone() for k, v in args.items()})
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("seam, inputs, op", [(decode_step, decode_inputs, DECODE), (verify, verify_inputs, VERIFY),
                                               (prefill, prefill_inputs, PREFILL)], ids=["decode", "verify", "prefill"])
def test_export_records_each_seam_as_one_op_node(seam, inputs, op):
    class Seam(torch.nn.Module):
        def forward(self, *args):
            return seam(*args)

    args = tuple(inputs().values())
    exported = torch.export.export(Seam(), args)
    targets = [node.target for node in exported.graph.nodes
               if node.op == "call_function" and node.target is not operator.getitem]
    assert targets == [op]
    got = exported.module()(*[a.clone() for a in args])
    assert all(torch.equal(g, w) for g, w in zip(got, seam(*[a.clone() for a in args])))


@pytest.mark.parametrize("backend", ["torch", "nki"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_ops_run_the_named_backend_and_agree_with_their_fakes(backend, dtype):
    """Eager op calls give the backend's seam results; the fake implementation's shapes and dtypes are the real
    results'; opcheck (schema, fake, dispatch) passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    decode = decode_inputs(dtype)
    prefill_args = prefill_inputs(dtype)
    cases = [
        (custom_ops.deltanet_decode, kernels.implementation("deltanet_decode", backend), decode, {}),
        (custom_ops.deltanet_verify, kernels.implementation("deltanet_verify", backend), verify_inputs(dtype), {}),
        (custom_ops.deltanet_prefill, kernels.implementation("deltanet_prefill", backend), prefill_args, {}),
    ]
    for op, implementation, args, _ in cases:
        got = op(*[v.clone() for v in args.values()], backend, None)
        want = implementation(*[v.clone() for v in args.values()], lnc=None)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(v) for v in args.values()]
            shapes = op(*fakes, backend, None)
        assert [(s.shape, s.dtype) for s in shapes] == [(g.shape, g.dtype) for g in got]
        if backend == "torch":
            torch.library.opcheck(op, (*[v.clone() for v in args.values()], backend, None))


def test_float64_reference_dtypes_in_the_fakes():
    """A float64 model (the references' check runs) gets float64 outputs and states, fake and real alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for op, inputs in ((custom_ops.deltanet_decode, decode_inputs), (custom_ops.deltanet_verify, verify_inputs)):
        args = {k: (v.double() if k != "initial_recurrent" else v) for k, v in inputs().items()}
        got = op(*args.values(), "torch", None)
        with FakeTensorMode() as mode:
            fake = op(*[mode.from_tensor(v) for v in args.values()], "torch", None)
        assert [(f.shape, f.dtype) for f in fake] == [(g.shape, g.dtype) for g in got]
        assert got[0].dtype == got[2].dtype == torch.float64
