"""INT8 linear weights as chunk payloads, through bitsandbytes (LLM.int8(): row-wise absmax, fp16 outliers).

A quantized weight of shape (out, in) is stored in its chunk as two tensors, next to the layer's other
parameters::

    <name>      int8  (out, in)   row-wise absmax-quantized weight, as ``Int8Params`` stores it
    <name>.SCB  fp32  (out,)      the scale of each row

A checkpoint saved by transformers from a bitsandbytes 8-bit model holds the same bytes (``weight`` and the
module's ``SCB``); ``saved`` maps them onto the chunk entries, so such a base is read as it is.

so a layer moves at ~1 byte per parameter. The model's ``nn.Linear`` modules inside the decoder layers are
replaced on the instance by ``bnb.nn.Linear8bitLt`` (transformers' ``replace_with_bnb_linear``, as
``load_in_8bit`` does), and binding gives each an ``Int8Params`` over the chunk's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiertune.errors import ModelError
from tiertune.quant.bnb4 import SavedWeight

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

    from tiertune.loading.weights import Checkpoint


@dataclass
class Int8:
    """LLM.int8() quantization: int8 rows with fp32 scales; activations above ``threshold`` stay fp16."""

    compute_dtype: torch.dtype = torch.float32
    threshold: float = 6.0
    skip: tuple[str, ...] = ()  # modules left unquantized (a saved checkpoint's llm_int8_skip_modules)

    def settings(self) -> dict[str, object]:
        return {"quantize": "int8", "threshold": self.threshold, "dtype": self.compute_dtype}

    def config(self) -> BitsAndBytesConfig:
        """The equivalent ``BitsAndBytesConfig`` (what a plain run would load the model with)."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=self.threshold,
            llm_int8_skip_modules=list(self.skip) or None,
        )

    def convert(self, module: nn.Module) -> None:
        """Replace the ``nn.Linear`` modules inside ``module`` (a decoder layer) by ``Linear8bitLt`` (meta)."""
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        replace_with_bnb_linear(module, list(self.skip) or None, quantization_config=self.config())

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The chunk entries that hold weight ``name`` of ``shape`` quantized."""
        return [(name, tuple(shape), torch.int8), (f"{name}.SCB", (shape[0],), torch.float32)]

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        """What transformers saves for weight ``key`` of ``shape`` int8-quantized: ``(key, shape, dtype,
        content)`` each (``NF4.saved_tensors``): the int8 rows, their fp32 scales and the layout's code (0: rows)."""
        prefix = key.removesuffix("weight")
        return [
            (key, tuple(shape), torch.int8, None),
            (prefix + "SCB", (shape[0],), torch.float32, None),
            (prefix + "weight_format", (), torch.uint8, torch.tensor(0, dtype=torch.uint8)),
        ]

    def quantize_into(self, name: str, weight: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """Quantize ``weight`` exactly as ``Int8Params`` does when a plain load moves it to a device."""
        import bitsandbytes as bnb

        quantized = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to(weight.device)
        views[name].copy_(quantized.CB)
        views[f"{name}.SCB"].copy_(quantized.SCB)

    def saved(
        self, name: str, key: str, shape: tuple[int, ...], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where weight ``name`` (of ``shape``), saved as checkpoint tensor ``key``, has its bytes when the
        checkpoint holds it int8-quantized; None when it holds it unquantized."""
        scales = key.removesuffix("weight") + "SCB"
        if scales not in checkpoint:
            return None
        entry = checkpoint.entries[key]
        where = f"{key!r} in {entry.file}"
        if entry.dtype != torch.int8 or entry.shape != tuple(shape):
            raise ModelError(
                f"pre-quantized weight {where} is {entry.dtype} {entry.shape}, expected int8 {tuple(shape)}"
            )
        if (
            checkpoint.entries[scales].shape != (shape[0],)
            or checkpoint.entries[scales].dtype != torch.float32
        ):
            raise ModelError(
                f"pre-quantized weight {where}: its scales {scales!r} are not {shape[0]} fp32 values"
            )
        layout = key.removesuffix("weight") + "weight_format"
        if layout in checkpoint:
            value = torch.empty(checkpoint.entries[layout].shape, dtype=checkpoint.entries[layout].dtype)
            checkpoint.read_into(layout, value)
            if int(value.reshape(-1)[0]) != 0:  # bitsandbytes' "row": the only layout it saves today
                raise ModelError(
                    f"pre-quantized weight {where} is saved in a tiled layout ({layout!r} = "
                    f"{int(value.reshape(-1)[0])}); re-save it with bitsandbytes >= 0.45 (row layout)"
                )
        return SavedWeight({name: key, f"{name}.SCB": scales})

    def parameter(self, name: str, shape: torch.Size, views: dict[str, torch.Tensor]) -> nn.Parameter:
        """An ``Int8Params`` over the chunk's memory, ready for ``Linear8bitLt``."""
        import bitsandbytes as bnb

        data = views[name]
        return bnb.nn.Int8Params(
            data, requires_grad=False, has_fp16_weights=False, CB=data, SCB=views[f"{name}.SCB"]
        )
