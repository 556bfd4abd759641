"""What a speculative head reads from the target's forward: the residual stream entering some layers (EAGLE-3's
auxiliary hidden states) and the final normed hidden state (MTP), at every row of the step.

The decoder fills it when the runner sets `model.capture` (LlamaModel.forward, LlamaModel.head); the head gathers
the rows it needs afterwards. Every row, because the head keeps its own KV over the whole context: each position
the target computes, prefill included, becomes a row of the head's forward (worker_svc/core/hidden_drafts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HiddenCapture:
    aux_layers: tuple[int, ...] = ()  # the residual stream entering these layers (num_layers: after the last)
    final: bool = False  # the final normed hidden state
    aux: dict[int, torch.Tensor] = field(default_factory=dict)
    last: torch.Tensor | None = None

    def begin(self) -> None:
        self.aux.clear()
        self.last = None

    def layer_input(self, i: int, h: torch.Tensor) -> None:
        if i in self.aux_layers:
            self.aux[i] = h.clone()  # later layers add into h in place

    def aux_states(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), len(aux_layers) * hidden]: the captured states of `rows`, in aux_layers order."""
        return torch.cat([self.aux[i][rows] for i in self.aux_layers], dim=-1)
