"""4-bit linear weights as chunk payloads, through bitsandbytes (QLoRA's NF4, or FP4; double-quantized or not).

A quantized weight of shape (out, in) is stored in its chunk as four tensors, next to the layer's other
(unquantized) parameters::

    <name>          uint8 (out*in/2, 1)   two 4-bit codes per byte, as bitsandbytes packs them
    <name>.absmax   uint8 (out*in/64,)    per-block scales, themselves quantized (double quantization)
    <name>.absmax2  fp32  (ceil(.../256),) the scales of the scales
    <name>.offset   fp32  ()              the mean subtracted from the scales before quantizing them

so a layer moves at ~0.52 bytes per parameter instead of 2 (bf16). Without double quantization the scales
are ``<name>.absmax`` in fp32 and there is no ``absmax2`` or ``offset``. The lookup tables (the 16 NF4 or
FP4 values and bitsandbytes' dynamic map for the nested scales) are the same for every weight and are kept
once.

A checkpoint saved by transformers from a bitsandbytes 4-bit model (a ``*-bnb-4bit`` repository) holds the
same bytes under other names (``weight``, ``weight.absmax``, ``weight.nested_absmax``, and the offset and
shape in the JSON of ``weight.quant_state.bitsandbytes__nf4``): ``saved`` maps them onto the chunk entries,
so such a base is read as it is, never dequantized and quantized again.

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

from tiertune.errors import ModelError

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

    from tiertune.loading.weights import Checkpoint

STATS = ("absmax", "absmax2", "offset")
NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for the double-quantized scales


@dataclass
class SavedWeight:
    """Where a pre-quantized weight's chunk entries are in a checkpoint: ``tensors`` maps an entry to the
    checkpoint tensor holding its bytes as they are; ``values`` holds entries the checkpoint keeps as numbers
    in JSON (the double-quantization offset)."""

    tensors: dict[str, str]
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def read_into(self, checkpoint: Checkpoint, views: dict[str, torch.Tensor]) -> None:
        """Copy the weight's saved bytes into those of its chunk entries that ``views`` has (no conversion:
        dtypes were checked)."""
        for entry, key in self.tensors.items():
            if entry in views:
                checkpoint.read_into(key, views[entry])
        for entry, value in self.values.items():
            if entry in views:
                views[entry].copy_(value)


@dataclass
class NF4:
    """How weights are quantized: ``quant_type`` (nf4 or fp4) with ``blocksize`` elements per scale, the
    scales double-quantized when ``double_quant``. ``skip`` names modules left unquantized (a saved
    checkpoint's ``llm_int8_skip_modules``)."""

    compute_dtype: torch.dtype = torch.float32
    blocksize: int = 64
    quant_type: str = "nf4"
    double_quant: bool = True
    skip: tuple[str, ...] = ()
    _codes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def settings(self) -> dict[str, object]:
        settings: dict[str, object] = {
            "quantize": self.quant_type,
            "blocksize": self.blocksize,
            "dtype": self.compute_dtype,
        }
        if not self.double_quant:  # the keys of the default settings stay as they were (cache keys)
            settings["double_quant"] = False
        return settings

    def config(self) -> BitsAndBytesConfig:
        """The equivalent ``BitsAndBytesConfig`` (what a plain QLoRA run would load the model with)."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=self.compute_dtype,
            llm_int8_skip_modules=list(self.skip) or None,
        )

    def convert(self, module: nn.Module) -> None:
        """Replace the ``nn.Linear`` modules inside ``module`` (a decoder layer) by ``Linear4bit`` (meta). A
        weight of fewer elements than whole blocks (Gemma 3n's 4 x 4 AltUp coefficients) stays as it is: its
        bytes are nothing beside the layer's, and a packed weight is whole blocks."""
        import re

        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        partial = [
            re.escape(name)
            for name, sub in module.named_modules()
            if isinstance(sub, nn.Linear) and sub.weight.numel() % self.blocksize
        ]
        replace_with_bnb_linear(module, [*self.skip, *partial] or None, quantization_config=self.config())
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
        if not self.double_quant:
            return [(name, (numel // 2, 1), torch.uint8), (f"{name}.absmax", (blocks,), torch.float32)]
        return [
            (name, (numel // 2, 1), torch.uint8),
            (f"{name}.absmax", (blocks,), torch.uint8),
            (f"{name}.absmax2", (-(-blocks // NESTED_BLOCKSIZE),), torch.float32),
            (f"{name}.offset", (), torch.float32),
        ]

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        """What transformers saves for weight ``key`` of ``shape`` quantized by these settings (bitsandbytes'
        packed state): ``(key, shape, dtype, content)`` each, ``content`` the values of the small tensors that
        ``saved`` reads (lookup tables, the quant state's JSON), None for the others. ``dtype``: the weight's
        unquantized dtype, as the quant state records it."""
        import json

        numel = math.prod(shape)
        blocks = numel // self.blocksize
        code, nested = self.codes(torch.device("cpu"))
        state: dict[str, object] = {  # bitsandbytes' keys, in its order (the offset is the weights')
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape),
        }
        out: list[tuple] = [
            (key, (numel // 2, 1), torch.uint8, None),
            (f"{key}.absmax", (blocks,), torch.uint8 if self.double_quant else torch.float32, None),
            (f"{key}.quant_map", tuple(code.shape), torch.float32, code.float()),
        ]
        if self.double_quant:
            state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=0.0)
            out += [
                (f"{key}.nested_absmax", (-(-blocks // NESTED_BLOCKSIZE),), torch.float32, None),
                (f"{key}.nested_quant_map", tuple(nested.shape), torch.float32, nested.float()),
            ]
        raw = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        out.append((f"{key}.quant_state.bitsandbytes__{self.quant_type}", tuple(raw.shape), torch.uint8, raw))
        return out

    def quantize_into(self, name: str, weight: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """Quantize ``weight`` (in the dtype a plain load would quantize from) into its chunk entries."""
        import bitsandbytes.functional as F

        packed, state = F.quantize_4bit(
            weight,
            blocksize=self.blocksize,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
        )
        views[name].copy_(packed)
        views[f"{name}.absmax"].copy_(state.absmax)
        if self.double_quant:
            views[f"{name}.absmax2"].copy_(state.state2.absmax)
            views[f"{name}.offset"].copy_(state.offset)

    def saved(
        self, name: str, key: str, shape: tuple[int, ...], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where weight ``name`` (of logical ``shape``), saved as checkpoint tensor ``key``, has its bytes when
        the checkpoint holds it 4-bit quantized as these settings would; None when it holds it unquantized.
        Raises ModelError when it is quantized differently (another type, block size or shape)."""
        import json

        stored = [
            k
            for k in (f"{key}.quant_state.bitsandbytes__nf4", f"{key}.quant_state.bitsandbytes__fp4")
            if k in checkpoint
        ]
        if not stored:
            return None
        raw = torch.empty(checkpoint.entries[stored[0]].shape, dtype=torch.uint8)
        checkpoint.read_into(stored[0], raw)
        state = json.loads(bytes(raw.tolist()).decode())
        where = f"{key!r} in {checkpoint.entries[key].file}"
        found = (
            state.get("quant_type"),
            state.get("blocksize"),
            tuple(state.get("shape") or ()),
            "nested_absmax" in state or f"{key}.nested_absmax" in checkpoint,
        )
        wanted = (self.quant_type, self.blocksize, tuple(shape), self.double_quant)
        if found != wanted:
            what = ("type", "block size", "shape", "double quantization")
            diff = "; ".join(
                f"{w}: saved {f}, expected {e}" for w, f, e in zip(what, found, wanted, strict=True) if f != e
            )
            raise ModelError(
                f"pre-quantized weight {where} is not the 4-bit layout the model's quantization_config "
                f"describes ({diff}); re-save the checkpoint, or load an unquantized one"
            )
        tensors = {name: key, f"{name}.absmax": f"{key}.absmax"}
        values = {}
        if self.double_quant:
            tensors[f"{name}.absmax2"] = f"{key}.nested_absmax"
            values[f"{name}.offset"] = torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
        self._check_maps(key, checkpoint)
        for entry, (ename, eshape, edtype) in zip(tensors, self.entries(name, shape), strict=False):
            saved = checkpoint.entries.get(tensors[entry])
            if saved is None or saved.dtype != edtype or math.prod(saved.shape) != math.prod(eshape):
                got = "missing" if saved is None else f"{saved.dtype} {saved.shape}"
                raise ModelError(
                    f"pre-quantized weight {where}: {tensors[entry]!r} is {got}, expected {edtype} {eshape}"
                )
            assert ename == entry
        return SavedWeight(tensors, values)

    def _check_maps(self, key: str, checkpoint: Checkpoint) -> None:
        """The checkpoint's lookup tables must be the ones these settings dequantize with."""
        code, nested = self.codes(torch.device("cpu"))
        maps = [(f"{key}.quant_map", code)] + (
            [(f"{key}.nested_quant_map", nested)] if self.double_quant else []
        )
        for map_key, expected in maps:
            if map_key not in checkpoint:
                continue
            saved = torch.empty(checkpoint.entries[map_key].shape, dtype=torch.float32)
            checkpoint.read_into(map_key, saved)
            if saved.shape != expected.shape or not torch.equal(saved, expected.cpu().float()):
                raise ModelError(
                    f"pre-quantized weight {key!r}: its lookup table {map_key!r} is not bitsandbytes' "
                    f"{self.quant_type} table; the checkpoint was not written by bitsandbytes"
                )

    def parameter(self, name: str, shape: torch.Size, views: dict[str, torch.Tensor]) -> nn.Parameter:
        """A ``Params4bit`` of logical ``shape`` over the chunk's memory, ready for ``Linear4bit``."""
        import bitsandbytes as bnb
        from bitsandbytes.functional import QuantState

        packed = views[name]
        code, nested_code = self.codes(packed.device)
        nested = None
        if self.double_quant:
            nested = QuantState(
                absmax=views[f"{name}.absmax2"],
                code=nested_code,
                blocksize=NESTED_BLOCKSIZE,
                dtype=torch.float32,
            )
        state = QuantState(
            absmax=views[f"{name}.absmax"],
            shape=torch.Size(shape),
            code=code,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.compute_dtype,
            offset=views[f"{name}.offset"] if self.double_quant else None,
            state2=nested,
        )
        return bnb.nn.Params4bit(
            packed,
            requires_grad=False,
            quant_state=state,
            blocksize=self.blocksize,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            bnb_quantized=True,
        )

    def codes(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The 4-bit code book and the double quantization's 8-bit code book (bitsandbytes' own), on ``device``."""
        if (
            device not in self._codes and device.type == "meta"
        ):  # a ledger's: shapes of the CPU's (bitsandbytes
            # caches the first device's map for every later call, so it never quantizes on meta)
            code, nested = self.codes(torch.device("cpu"))
            self._codes[device] = (code.to(device), nested.to(device))
        if device not in self._codes:
            import bitsandbytes.functional as F

            probe = torch.zeros(self.blocksize * NESTED_BLOCKSIZE, device=device)
            _, state = F.quantize_4bit(
                probe, blocksize=self.blocksize, compress_statistics=True, quant_type=self.quant_type
            )
            self._codes[device] = (state.code, state.state2.code)
        return self._codes[device]
