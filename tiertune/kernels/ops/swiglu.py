"""The gated activation of a GLU MLP, ``act(gate) * up``: SwiGLU (SiLU; Llama, Qwen, Mistral) and GeGLU with
the tanh-approximated GELU (Gemma). The MLP is ``down_proj(act(gate_proj(x)) * up_proj(x))``; this is its
middle.

``glu_reference`` is the oracle and the CPU path; ``GLUTriton`` runs one elementwise Triton kernel forward and
one backward, which recomputes the activation from the saved gate and up instead of keeping its output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend

ACTIVATIONS = ("silu", "gelu_tanh")

# transformers' ``hidden_act`` names (keys of ``ACT2FN``) that are one of ours. "gelu" is the exact erf GELU,
# not the tanh one, so it is absent; gelu_new and gelu_fast are the tanh GELU written out in the model's dtype,
# equal to ours up to rounding.
GLU_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"unsupported GLU activation {activation!r}: expected one of {', '.join(ACTIVATIONS)} "
            f"(transformers' hidden_act names map to these through GLU_ACTIVATIONS)"
        )


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` as eager transformers computes it: the activation rounded to the input dtype, then
    the product."""
    _check(activation)
    a = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return a * up


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, last dim)``, a view where possible; the kernels need only a unit column stride."""
    cols = t.shape[-1] if t.dim() else 1
    t2 = t.reshape(t.numel() // cols if cols else 0, cols)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class GLUTriton(torch.autograd.Function):
    """``act(gate) * up`` with Triton kernels (a GPU, or ``TRITON_INTERPRET=1``). Saves only gate and up.

    Inputs of any shape; gate and up must match in shape and dtype. A view with a contiguous last dimension
    (such as one half of a fused gate/up projection) is read in place; any other layout is copied first.
    """

    @staticmethod
    def forward(ctx, gate, up, activation):
        from tiertune.kernels.ops._triton_swiglu import glu_backward, glu_forward

        _check(activation)
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"gate and up must have the same shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                f"and {tuple(up.shape)} {up.dtype}"
            )
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.activation, ctx.backward_fn = activation, glu_backward
        return glu_forward(g2, u2, activation).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dg, du = ctx.backward_fn(_rows(dy), g2, u2, ctx.activation)
        return dg.view(dy.shape), du.view(dy.shape), None


def glu(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", backend: str = "auto"
) -> torch.Tensor:
    """``act(gate) * up`` with the Triton kernels (``triton``, or ``auto`` on a GPU with Triton) or the
    reference (``torch``). ``activation`` is ``silu`` or ``gelu_tanh``."""
    _check(activation)
    backend = choose_backend(backend, gate)
    if backend == "triton":
        return GLUTriton.apply(gate, up, activation)
    return glu_reference(gate, up, activation)
