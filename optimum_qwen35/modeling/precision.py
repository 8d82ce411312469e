"""The precision policy: one place that says how half-precision models compute, supplied by the backend.

The policy, whatever the backend:
- weights, and the operands of every matmul, in the model dtype (bf16): never an fp32 copy of a weight
  made per call;
- matmul products accumulated in fp32 where the hardware does (TensorE into fp32 PSUM; on CPU, oneDNN's
  bf16 GEMM with avx512_bf16 / AMX, and the bf16 attention kernel, accumulate in fp32);
- fp32 for the recurrent state and the delta rule, the gates (`A_log`, `dt_bias`), the norms (`upcast`
  below), RoPE, the softmax, the residual stream and the logits.

What changes between backends is only the *form* a matmul with bf16 operands and an fp32 accumulator
takes. The layer factory supplies it (`TorchLayers.precision`); the model asks it for the three matmuls
whose precision is a choice — the attention core, the lm_head, and the cast of fp32 values (norm outputs)
into operands — and applies `upcast` for what always runs in fp32. A Neuron layer factory supplies its own
(bf16 operands with fp32 PSUM results, which neuronx-cc's auto-cast must then leave alone).

`TorchPrecision`, the CPU form, was picked by measurement (docs/model.md, "Numerics"):
- attention: `F.scaled_dot_product_attention` with the boolean mask and `enable_gqa`: for bf16 it computes
  q.k in fp32, softmax in fp32, rounds the probabilities to bf16 and accumulates probs.v in fp32 (exactly
  the policy), without materializing repeated K/V heads or fp32 copies of q, k, v; for one query (decode),
  two bmm over the grouped heads with fp32 q and K, faster there than SDPA's CPU kernel;
- lm_head: a bf16 GEMM (fp32 accumulation inside) whose result is then made fp32, instead of an fp32
  copy of the whole embedding-sized weight per call (most of a bf16 decode step at a 248k vocabulary).
  The logits are rounded once to bf16 (relative 2^-9) before becoming fp32. A head prepacked for CPU inference
  (`parallel.Linear.pack`) runs this same form itself, from its re-blocked weight.
fp32 and float64 models compute everything in their own dtype (no cast at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision dtypes; fp32 and float64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: what norms, gates, RoPE and the softmax compute in."""
    return x.to(accumulation_dtype(x.dtype))


# Parameters held in the accumulation dtype whatever the model dtype: the DeltaNet gates' A_log and dt_bias
# (g = -exp(A_log) * softplus(a + dt_bias) in fp32; a bf16 A_log would move every decay rate by up to 2^-9
# relative before the exp). The checkpoint conversion keeps them so (checkpoint/convert.py `stored_dtype`).
FP32_PARAMETERS = ("linear_attn.A_log", "linear_attn.dt_bias", "mlp.gate.weight")
# (`mlp.gate.weight`: the MoE router, modeling/moe.py: routing decided on fp32 logits, as the MoE policy asks.)


def to_model_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module.to(dtype)`, except the FP32_PARAMETERS, which go to the accumulation dtype with their values (taken
    before the cast, so a bf16 model's fp32 gates are not bf16-rounded)."""
    gates = {name: p.data.to(accumulation_dtype(dtype)) for name, p in module.named_parameters() if name.endswith(FP32_PARAMETERS)}
    module.to(dtype)
    for name, param in module.named_parameters():
        if name in gates:
            param.data = gates[name]
    return module


class TorchPrecision:
    """The CPU (plain torch) form of the policy."""

    name = "torch"

    @staticmethod
    def operand(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 values (a norm's output, the residual stream) as the operand of a matmul with `weight`."""
        return x.to(weight.dtype)

    @staticmethod
    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """LayerNorm over the last dimension, in x's dtype (the vision tower's norms, given fp32)."""
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with operands in the weight's dtype, result in fp32 (float64 for float64 models)."""
        return F.linear(x.to(weight.dtype), weight).to(accumulation_dtype(weight.dtype))

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v for q [B, H, Tq, hd], k/v [B, KV, Tk, hd] (query head h reads KV head
        h // (H / KV)), mask [B or 1, 1, Tq, Tk] (True = visible; every row sees at least one key). Returns
        [B, H, Tq, hd] in v's dtype: scores, softmax and the accumulation of probs @ v in fp32, the
        probabilities rounded to v's dtype before that product."""
        if q.shape[2] == 1:
            return TorchPrecision._one_query_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    @staticmethod
    def _one_query_attention(q, k, v, mask, scale):
        """The decode case (one query per row), as two matmuls over the query heads grouped by their KV head: SDPA's
        CPU kernel is slower here (one thread, 8 heads, 4160 keys of dim 256: 5.6 ms fp32 and 15.7 ms bf16, against
        2.9 ms for this form). Same policy: fp32 scores (from fp32 copies of q and k: one K row per key, small next
        to the weights a decode step reads), fp32 softmax, probabilities in v's dtype for a GEMM accumulating in fp32."""
        B, H, _, hd = q.shape
        KV, Tk = k.shape[1], k.shape[2]
        q = upcast(q).reshape(B * KV, H // KV, hd)  # query head h reads KV head h // (H / KV)
        # bmm with a transposed operand (matmul of the 4-d tensors copied K to make it contiguous).
        scores = torch.bmm(q, upcast(k).reshape(B * KV, Tk, hd).transpose(1, 2)) * scale
        scores = scores.view(B, KV, H // KV, Tk).masked_fill(~mask, float("-inf"))  # mask broadcasts over heads
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.bmm(probs.view(B * KV, H // KV, Tk), v.reshape(B * KV, Tk, hd)).reshape(B, H, 1, hd)


class NeuronPrecision(TorchPrecision):
    """The Neuron (neuronx-cc, `--auto-cast=none`) form of the policy: plain matmuls, which XLA lowers to TensorE
    matmuls with bf16 operands accumulating in fp32 PSUM.

    - attention: the explicit form, as 3-D batched matmuls over (row, KV head): the query heads that share a KV
      head are stacked along the query axis ([B * KV, G * Tq, hd]), so K and V are read once per KV head, never
      copied per query head, and no matmul has a rank-4 operand (neuronx-cc fails on some rank-4 matmuls at
      head_dim 256, NCC_INLA001, which NxDI avoids the same way; `benchmarks/neuron_graphs.py` lowers both forms).
      SDPA's `enable_gqa` has no Neuron lowering. The scores come out of the bf16 matmul rounded to bf16 (torch-xla
      gives a bf16 x bf16 matmul a bf16 result: relative 2^-9, like the logits on CPU) and are made fp32 for the
      mask and the softmax; the probabilities are rounded to bf16 for probs @ v, as on CPU. fp32 and float64 models
      compute everything in their own dtype, as on CPU.
    - lm_head and operands: as `TorchPrecision` (a model-dtype GEMM whose result is made fp32; no fp32 copy of
      the weight).
    """

    name = "neuron"

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Same contract as `TorchPrecision.attention`."""
        B, H, Tq, hd = q.shape
        KV, Tk = k.shape[1], k.shape[2]
        # Query head h = kv * G + g reads KV head kv: a KV head's G query heads are contiguous in q.
        q3 = q.reshape(B * KV, (H // KV) * Tq, hd)
        scores = upcast(torch.bmm(q3, k.reshape(B * KV, Tk, hd).transpose(1, 2))) * scale  # [B * KV, G * Tq, Tk]
        # The fill value as a tensor of the scores' dtype: a Python float lowers to an f64 value (no fp64 on Neuron).
        lowest = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        scores = scores.view(B, H, Tq, Tk).masked_fill(~mask, lowest)
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B * KV, (H // KV) * Tq, Tk)
        return torch.bmm(probs, v.reshape(B * KV, Tk, hd)).view(B, H, Tq, hd)
