"""NF4 quantization of a decoder layer's linear weights (``tiertune.quant.bnb4``)."""

import torch
from torch import nn

from tiertune.quant.bnb4 import NF4


def test_a_weight_of_less_than_whole_blocks_stays_unquantized():
    """Gemma 3n's layers hold 4 x 4 linear weights (AltUp's coefficients): 16 elements fill no 64-element NF4
    block. Such a weight stays as it is (its bytes are nothing beside the layer's) instead of failing the
    layout, and every other linear weight of the layer is quantized."""
    import bitsandbytes as bnb

    with torch.device("meta"):
        layer = nn.Module()
        layer.proj = nn.Linear(64, 64, bias=False)
        layer.altup = nn.Module()
        layer.altup.correction_coefs = nn.Linear(4, 4, bias=False)
    quant = NF4()
    quant.convert(layer)
    assert isinstance(layer.proj, bnb.nn.Linear4bit)
    assert type(layer.altup.correction_coefs) is nn.Linear
    entries = quant.entries("proj.weight", (64, 64))
    assert entries[0] == ("proj.weight", (64 * 64 // 2, 1), torch.uint8)
