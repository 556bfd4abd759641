"""Random weights for small Hugging Face checkpoints that tests save themselves (no model hub here)."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module) -> None:
    """Seeded random weights. HF init leaves biases at 0 and norms at 1, which would hide a dropped bias or norm
    weight."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
