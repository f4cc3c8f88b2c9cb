"""tiertune's fused ops against torch eager (what transformers and peft run) and against Liger-Kernel.

Ops and what each implementation is:

- ``ce``: the loss of the head: eager ``F.linear`` + fp32 ``F.cross_entropy`` over the full logits; ours
  ``linear_cross_entropy`` (chunked); Liger's ``liger_fused_linear_cross_entropy``;
- ``rms_norm``: transformers' ``LlamaRMSNorm``; ours ``rms_norm``; ``liger_rms_norm``;
- ``rope``: transformers' ``apply_rotary_pos_emb`` on q/k as attention passes them; ours ``apply_rope``;
  ``liger_rope``;
- ``swiglu``: ``silu(gate) * up``; ours ``glu``; ``liger_swiglu``;
- ``nf4``: a frozen NF4 linear (bitsandbytes' ``Linear4bit``, double-quantized scales); ours ``nf4_linear``
  (no Liger counterpart);
- ``lora``: a peft LoRA linear with dropout on a frozen base; ours, the same module through
  ``kernels.patch`` (``lora_branch``; no Liger counterpart);
- ``fp8``: a frozen FP8 blockwise linear (e4m3 codes, a scale per 128 x 128 block: DeepSeek-V3's release;
  hidden -> intermediate): eager dequantizes the weight (DeepSeek's ``weight_dequant``: codes times the repeated
  scales, to the compute dtype) and calls ``F.linear``, forward and for the input's gradient; ours
  ``fp8_linear`` (the fused kernel; no Liger counterpart);
- ``mxfp4``: one MXFP4 expert matrix (e2m1 codes with a power-of-two scale per 32: gpt-oss's; hidden ->
  hidden): eager dequantizes it (transformers' gpt-oss loader's values) and calls ``F.linear``, forward and for
  the input's gradient; ours ``mxfp4_linear`` (the fused kernel; no Liger counterpart).

Each (op, implementation) runs in a fresh process: forward + backward ``--reps`` times after ``--warmup``;
reported are the median seconds of the forward and of forward + backward; ``saved_bytes``, what autograd
keeps from forward to backward that did not exist before it (activations and masks, and the fused loss's
gradients; bitsandbytes' NF4 linear keeps its state outside autograd's view and shows 0); and the peak
memory of one forward + backward above what the inputs take (``torch.cuda.max_memory_allocated`` on a GPU;
on a CPU the process's peak RSS, reset just before, which is only meaningful for large ops such as ``ce``).
Shapes are Llama-3-8B's by default (hidden 4096, intermediate 14336, 32 heads of 128, 8 KV heads,
vocabulary 128256) over ``--tokens`` tokens. On a CPU our ops run their torch code and Liger is skipped
(Triton needs a GPU). Prints one JSON object.

Run: ``python benchmarks/bench_kernels.py`` (on a GPU: bf16; ``--ops ce,rms_norm`` for a subset).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, proc_status_bytes

OPS = ("ce", "rms_norm", "rope", "swiglu", "nf4", "lora", "fp8", "mxfp4")
IMPLS = ("eager", "tiertune", "liger")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--tokens", type=int, default=None, help="batch x sequence (8192 on a GPU, 1024 on a CPU)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure every op in this process, not each in a fresh one: quick (a check of the script), but "
        "the peak-memory figures then carry what earlier ops left",
    )
    p.add_argument("--child", nargs=2, metavar=("OP", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    args.tokens = args.tokens or (8192 if args.device == "cuda" else 1024)
    return args


# ------------------------------------------------------------------ each op's inputs and implementations


def _case(op: str, impl: str, a: argparse.Namespace) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """A function running ``impl`` of ``op`` forward (returning a tensor to backpropagate from) and the
    tensors whose gradients backward computes."""
    dev, dt, n = a.device, a.dtype, a.tokens
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
        t = torch.randn(*shape, device=dev, generator=g) * scale
        return t.to(dt).requires_grad_(grad)

    if op == "ce":
        x, w = rand(n, a.hidden), rand(a.vocab, a.hidden, scale=0.02)
        target = torch.randint(0, a.vocab, (n,), device=dev, generator=g)
        if impl == "eager":
            return lambda: F.cross_entropy(F.linear(x, w).float(), target), [x, w]
        if impl == "tiertune":
            from tiertune.kernels.ops.linear_ce import linear_cross_entropy

            return lambda: linear_cross_entropy(x, w, target, reduction="mean"), [x, w]
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda: liger_fused_linear_cross_entropy(x, w, target), [x, w]
    if op == "rms_norm":
        x, w = rand(n, a.hidden), rand(a.hidden, scale=0.1)
        if impl == "eager":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm

            module = LlamaRMSNorm(a.hidden, 1e-6)
            module.weight = torch.nn.Parameter(w)
            return lambda: module(x), [x, w]
        if impl == "tiertune":
            from tiertune.kernels.ops.rms_norm import rms_norm

            return lambda: rms_norm(x, w, 1e-6), [x, w]
        from liger_kernel.transformers.functional import liger_rms_norm

        return lambda: liger_rms_norm(x, w, 1e-6, in_place=False), [x, w]
    if op == "rope":
        seq = 2048 if n % 2048 == 0 else n
        batch = n // seq
        # as attention passes them: [batch, heads, seq, head_dim] views of the projections' [batch, seq, ...]
        q, k = rand(batch, seq, a.heads, a.head_dim), rand(batch, seq, a.kv_heads, a.head_dim)
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        cfg = LlamaConfig(
            hidden_size=a.heads * a.head_dim, num_attention_heads=a.heads, max_position_embeddings=seq
        )
        positions = torch.arange(seq, device=dev).expand(batch, -1)
        cos, sin = LlamaRotaryEmbedding(cfg).to(dev)(q, positions)
        cos, sin = cos.to(dt), sin.to(dt)

        def both(fn: Callable) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                qe, ke = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                return qe.sum() + ke.sum() * 0.5  # one scalar whose gradient reaches both

            return run

        if impl == "eager":
            return both(apply_rotary_pos_emb), [q, k]
        if impl == "tiertune":
            from tiertune.kernels.ops.rope import apply_rope

            return both(apply_rope), [q, k]
        from liger_kernel.transformers.functional import liger_rope

        return both(liger_rope), [q, k]
    if op == "swiglu":
        gate, up = rand(n, a.intermediate), rand(n, a.intermediate)
        if impl == "eager":
            return lambda: F.silu(gate) * up, [gate, up]
        if impl == "tiertune":
            from tiertune.kernels.ops.swiglu import glu

            return lambda: glu(gate, up, "silu"), [gate, up]
        from liger_kernel.transformers.functional import liger_swiglu

        return lambda: liger_swiglu(gate, up), [gate, up]
    if op in ("nf4", "lora"):
        return _linear_case(op, impl, a, rand)
    if op == "fp8":
        return _fp8_case(impl, a, rand)
    if op == "mxfp4":
        return _mxfp4_case(impl, a, rand)
    raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")


def _linear_case(op: str, impl: str, a: argparse.Namespace, rand: Callable) -> tuple[Callable, list]:
    """A frozen base linear (hidden -> intermediate, the MLP's up projection): NF4 for ``nf4``, with a peft
    LoRA adapter (rank ``--rank``, dropout 0.05) in the compute dtype for ``lora``."""
    x = rand(a.tokens, a.hidden)
    if op == "nf4":
        if impl == "liger":
            raise NotImplementedError("Liger-Kernel has no NF4 linear")
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(
            a.hidden, a.intermediate, bias=False, compute_dtype=a.dtype, quant_type="nf4"
        )
        layer.weight = bnb.nn.Params4bit(
            rand(a.intermediate, a.hidden, scale=0.02, grad=False).cpu(),
            requires_grad=False,
            quant_type="nf4",
            compress_statistics=True,
        )
        layer = layer.to(a.device)
        if impl == "eager":
            return lambda: layer(x), [x]
        from tiertune.kernels.ops.nf4 import nf4_linear

        return lambda: nf4_linear(x, layer.weight.data, layer.weight.quant_state), [x]
    if impl == "liger":
        raise NotImplementedError("Liger-Kernel has no LoRA op")
    from peft import LoraConfig, get_peft_model

    class Up(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = torch.nn.Linear(
                a.hidden, a.intermediate, bias=False, dtype=a.dtype, device=a.device
            )

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.up_proj(h)

    cfg = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.05, target_modules=["up_proj"])
    model = get_peft_model(Up(), cfg).to(device=a.device, dtype=a.dtype)
    model.train()
    if impl == "tiertune":
        from tiertune.kernels.patch import patch_model

        backend = "triton" if a.device == "cuda" else "torch"
        assert patch_model(model, backend)["lora"] == 1
    adapters = [p for p in model.parameters() if p.requires_grad]
    return lambda: model(x), [x, *adapters]


class _Dequantizing(torch.autograd.Function):
    """Eager code's product with a frozen quantized matrix: ``weight_of(dtype)`` dequantizes it whole, then
    ``F.linear``; dequantized again for the input's gradient, as the fused ops do (no 16-bit copy kept)."""

    @staticmethod
    def forward(ctx, h, weight_of):  # type: ignore[no-untyped-def]
        ctx.weight_of = weight_of
        return F.linear(h, weight_of(h.dtype))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        return dy @ ctx.weight_of(dy.dtype), None


def _fp8_case(impl: str, a: argparse.Namespace, rand: Callable) -> tuple[Callable, list]:
    """A frozen FP8 blockwise linear (hidden -> intermediate, 128 x 128 scale blocks) as the release stores it."""
    if impl == "liger":
        raise NotImplementedError("Liger-Kernel has no FP8 blockwise linear")
    from tiertune.kernels.ops.fp8 import dequantize_fp8, fp8_linear
    from tiertune.quant.shipped import FP8

    block = (128, 128)
    codes, scale = FP8(block=block).quantize(
        rand(a.intermediate, a.hidden, scale=0.02, grad=False).float().cpu()
    )
    codes, scale = codes.to(a.device), scale.to(a.device)
    x = rand(a.tokens, a.hidden)
    if impl == "eager":
        return lambda: _Dequantizing.apply(x, lambda dtype: dequantize_fp8(codes, scale, block, dtype)), [x]
    backend = "triton" if a.device == "cuda" else "torch"
    return lambda: fp8_linear(x, codes, scale, block, backend=backend), [x]


def _mxfp4_case(impl: str, a: argparse.Namespace, rand: Callable) -> tuple[Callable, list]:
    """One MXFP4 expert matrix (hidden -> hidden) as gpt-oss ships its experts."""
    if impl == "liger":
        raise NotImplementedError("Liger-Kernel has no MXFP4 linear")
    from tiertune.kernels.ops.mxfp4 import dequantize_mxfp4, mxfp4_linear
    from tiertune.quant.shipped import MXFP4

    blocks, scales = MXFP4().quantize(rand(a.hidden, a.hidden, scale=0.02, grad=False).float().cpu())
    blocks, scales = blocks.to(a.device), scales.to(a.device)
    x = rand(a.tokens, a.hidden)
    if impl == "eager":
        return lambda: _Dequantizing.apply(x, lambda dtype: dequantize_mxfp4(blocks, scales, dtype)), [x]
    backend = "triton" if a.device == "cuda" else "torch"
    return lambda: mxfp4_linear(x, blocks, scales, backend=backend), [x]


# ------------------------------------------------------------------ measuring one case


def _measure(op: str, impl: str, a: argparse.Namespace) -> dict:
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        forward, inputs = _case(op, impl, a)
    except (ImportError, NotImplementedError) as err:
        return {"skipped": str(err)}

    def step() -> None:
        out = forward()
        out.float().sum().backward() if out.dim() else out.backward()
        for t in inputs:
            t.grad = None

    for _ in range(a.warmup):
        step()
    sync()
    saved = _saved_bytes(forward)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = proc_status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here
    step()
    sync()
    peak = (torch.cuda.max_memory_allocated() if cuda else proc_status_bytes("VmHWM")) - base
    fwd, full = [], []
    for _ in range(a.reps):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            forward()
        sync()
        fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step()
        sync()
        full.append(time.perf_counter() - t0)
    return {
        "forward_s": statistics.median(fwd),
        "forward_backward_s": statistics.median(full),
        "peak_bytes": peak,
        "saved_bytes": saved,
    }


def _saved_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps from one forward until backward that did not exist before it (activations, masks,
    gradients computed ahead; not the inputs or the weights it merely references), each storage once."""
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        seen = {t.untyped_storage().data_ptr() for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return total


def _compare(results: dict[str, dict]) -> dict:
    """Ours against each reference: speed (their time / ours) and memory (our peak / theirs)."""
    ours = results.get("tiertune", {})
    out = {}
    for ref in ("eager", "liger"):
        theirs = results.get(ref, {})
        if "forward_backward_s" in ours and "forward_backward_s" in theirs:
            out[f"speedup_vs_{ref}"] = round(theirs["forward_backward_s"] / ours["forward_backward_s"], 3)
            out[f"peak_vs_{ref}"] = round(ours["peak_bytes"] / max(theirs["peak_bytes"], 1), 3)
            out[f"saved_vs_{ref}"] = round(ours["saved_bytes"] / max(theirs["saved_bytes"], 1), 3)
    return out


def main() -> None:
    a = _args()
    if a.child:
        print(json.dumps(_measure(*a.child, a)))
        return
    report: dict = {
        "machine": machine() | {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"},
        "isolation": "one process" if a.in_process else "a process per op and implementation",
        "dtype": str(a.dtype).removeprefix("torch."),
        "tokens": a.tokens,
        "ops": {},
    }
    for op in a.ops.split(","):
        results = {}
        for impl in IMPLS:
            if impl == "liger" and a.device != "cuda":
                results[impl] = {"skipped": "Liger-Kernel's Triton kernels need a GPU"}
                continue
            if a.in_process:
                results[impl] = _measure(op, impl, a)
            else:
                cmd = [sys.executable, __file__, *sys.argv[1:], "--child", op, impl]
                out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                lines = out.stdout.strip().splitlines()
                results[impl] = (
                    json.loads(lines[-1])
                    if out.returncode == 0 and lines
                    else {"error": f"exit {out.returncode}"}
                )
            print(f"{op}/{impl}: {json.dumps(results[impl])}", file=sys.stderr, flush=True)
        report["ops"][op] = results | _compare(results)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
