"""NF4 linear weights as chunk payloads, through bitsandbytes (QLoRA's 4-bit NormalFloat, double-quantized).

A quantized weight of shape (out, in) is stored in its chunk as four tensors, next to the layer's other
(unquantized) parameters::

    <name>          uint8 (out*in/2, 1)   two 4-bit codes per byte, as bitsandbytes packs them
    <name>.absmax   uint8 (out*in/64,)    per-block scales, themselves quantized (double quantization)
    <name>.absmax2  fp32  (ceil(.../256),) the scales of the scales
    <name>.offset   fp32  ()              the mean subtracted from the scales before quantizing them

so a layer moves at ~0.52 bytes per parameter instead of 2 (bf16). The lookup tables (the 16 NF4 values and
bitsandbytes' dynamic map for the nested scales) are the same for every weight and are kept once.

The model's ``nn.Linear`` modules inside the decoder layers are replaced on the *instance* by
``bnb.nn.Linear4bit`` (with transformers' own ``replace_with_bnb_linear``, as ``from_pretrained`` does for
``load_in_4bit``), so peft wraps them exactly as it wraps a QLoRA model. Binding a chunk gives each module a
``Params4bit`` over the chunk's memory with a ``QuantState`` over its statistics; no bytes are copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

STATS = ("absmax", "absmax2", "offset")
NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for the double-quantized scales


@dataclass
class NF4:
    """How weights are quantized: NF4 with ``blocksize`` elements per scale, scales double-quantized."""

    compute_dtype: torch.dtype = torch.float32
    blocksize: int = 64
    _codes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def settings(self) -> dict[str, object]:
        return {"quantize": "nf4", "blocksize": self.blocksize, "dtype": self.compute_dtype}

    def config(self) -> BitsAndBytesConfig:
        """The equivalent ``BitsAndBytesConfig`` (what a plain QLoRA run would load the model with)."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=self.compute_dtype,
        )

    def convert(self, module: nn.Module) -> None:
        """Replace the ``nn.Linear`` modules inside ``module`` (a decoder layer) by ``Linear4bit`` (meta)."""
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        replace_with_bnb_linear(module, quantization_config=self.config())
        for sub in module.modules():  # transformers sets the storage dtype; the block size is ours
            weight = getattr(sub, "weight", None)
            if weight is not None and hasattr(weight, "quant_state"):
                weight.blocksize = self.blocksize

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The chunk entries that hold weight ``name`` of ``shape`` quantized."""
        numel = math.prod(shape)
        if numel % 2 or numel % self.blocksize:
            raise ValueError(f"{name}: {numel} elements do not split into {self.blocksize}-element blocks")
        blocks = numel // self.blocksize
        return [
            (name, (numel // 2, 1), torch.uint8),
            (f"{name}.absmax", (blocks,), torch.uint8),
            (f"{name}.absmax2", (-(-blocks // NESTED_BLOCKSIZE),), torch.float32),
            (f"{name}.offset", (), torch.float32),
        ]

    def quantize_into(self, name: str, weight: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """Quantize ``weight`` (in the dtype a plain load would quantize from) into its chunk entries."""
        import bitsandbytes.functional as F

        packed, state = F.quantize_4bit(
            weight, blocksize=self.blocksize, compress_statistics=True, quant_type="nf4"
        )
        views[name].copy_(packed)
        views[f"{name}.absmax"].copy_(state.absmax)
        views[f"{name}.absmax2"].copy_(state.state2.absmax)
        views[f"{name}.offset"].copy_(state.offset)
        self._codes.setdefault(weight.device, (state.code, state.state2.code))

    def parameter(self, name: str, shape: torch.Size, views: dict[str, torch.Tensor]) -> nn.Parameter:
        """A ``Params4bit`` of logical ``shape`` over the chunk's memory, ready for ``Linear4bit``."""
        import bitsandbytes as bnb
        from bitsandbytes.functional import QuantState

        packed = views[name]
        code, nested_code = self._code(packed.device)
        state = QuantState(
            absmax=views[f"{name}.absmax"],
            shape=torch.Size(shape),
            code=code,
            blocksize=self.blocksize,
            quant_type="nf4",
            dtype=self.compute_dtype,
            offset=views[f"{name}.offset"],
            state2=QuantState(
                absmax=views[f"{name}.absmax2"],
                code=nested_code,
                blocksize=NESTED_BLOCKSIZE,
                dtype=torch.float32,
            ),
        )
        return bnb.nn.Params4bit(
            packed,
            requires_grad=False,
            quant_state=state,
            blocksize=self.blocksize,
            compress_statistics=True,
            quant_type="nf4",
            bnb_quantized=True,
        )

    def _code(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._codes:
            import bitsandbytes.functional as F

            probe = torch.zeros(self.blocksize * NESTED_BLOCKSIZE, device=device)
            _, state = F.quantize_4bit(
                probe, blocksize=self.blocksize, compress_statistics=True, quant_type="nf4"
            )
            self._codes[device] = (state.code, state.state2.code)
        return self._codes[device]
