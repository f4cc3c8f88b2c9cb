"""Comparing weights trained two ways (tiertune's engine and a plain PyTorch or peft loop) where the comparison is
well-posed on every x86 CPU, not only the one a tolerance was tuned on."""

import torch


def assert_adam_trained_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Adam divides each gradient entry by its own running magnitude: an entry whose gradient is nearly zero
    turns float rounding (which differs between CPUs, MKL's last bits) into a step of up to the learning rate.
    So the tensor is compared as a whole (the difference's norm <= 1e-4 of the tensor's), and element by element
    (rtol 1e-4, atol 1e-5) for all but 0.5% of its entries: a wrong gradient or update fails both."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = float(expected.norm()) or 1.0
    assert float((actual - expected).norm()) <= 1e-4 * scale, (name, float((actual - expected).norm()), scale)
    beyond = ~torch.isclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert int(beyond.sum()) <= max(1, actual.numel() // 200), (name, int(beyond.sum()), actual.numel())
