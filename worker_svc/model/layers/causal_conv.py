"""The short causal depthwise convolution of the recurrent layers (Gated DeltaNet, Mamba2), over a flattened step.

A step holds chunks of several sequences laid end to end (rows cu_seqlens[i] .. cu_seqlens[i + 1]). Each sequence
carries its last `kernel - 1` inputs between steps in a state slot, so a prefill chunk continues exactly where the
previous chunk stopped and a decode token sees the three tokens before it. The whole step is one gather: the carried
windows and the step's inputs are written into one buffer (each sequence's window just before its rows), and every
output row reads its `kernel` rows of that buffer. No loop over sequences or tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.model.layers.op import LayerOp


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                  slots: torch.Tensor, cu_seqlens: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """y[t] = act(sum_k weight[:, k] * window_t[k] + bias) for x [T, C], weight [C, K]; `states` [S, C, K - 1]
    (the pool's windows of this layer, oldest first) is read at `slots` [N] and updated in place to each sequence's
    last K - 1 inputs. cu_seqlens [N + 1]: the sequences' rows in x."""
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    n = len(slots)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(n, device=x.device), lens, output_size=num_tokens)
    # Buffer layout: sequence i's window (width rows), then its tokens; so token t sits width * (seq + 1) rows on.
    token_rows = torch.arange(num_tokens, device=x.device) + width * (seq + 1)
    window_rows = (cu_seqlens[:-1] + width * torch.arange(n, device=x.device)).unsqueeze(1) + \
        torch.arange(width, device=x.device)
    buf = x.new_empty(num_tokens + n * width, channels)
    buf[token_rows] = x
    buf[window_rows.flatten()] = states.index_select(0, slots).transpose(1, 2).reshape(n * width, channels).to(x.dtype)
    taps = token_rows.unsqueeze(1) - width + torch.arange(width + 1, device=x.device)  # [T, K]
    y = torch.einsum("tkc,ck->tc", buf[taps], weight)
    if bias is not None:
        y = y + bias
    # The new window: the last `width` buffer rows of each sequence (old window rows where it had fewer tokens).
    last = (cu_seqlens[1:] + width * torch.arange(n, device=x.device)).unsqueeze(1) + torch.arange(width,
                                                                                                   device=x.device)
    states.index_copy_(0, slots, buf[last.flatten()].view(n, width, channels).transpose(1, 2).to(states.dtype))
    if activation == "silu":
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")


class CausalConv1d(LayerOp):
    """`causal_conv1d`; on CUDA a decode step (one row per sequence) runs the Triton kernel that shifts the pool's
    windows in place."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                       slots: torch.Tensor, cu_seqlens: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
        return causal_conv1d(x, weight, bias, states, slots, cu_seqlens, activation)

    def forward_cuda(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                     slots: torch.Tensor, cu_seqlens: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
        if x.shape[0] == len(slots) and activation in ("silu", None):
            from kernels.recurrent_triton import conv1d_decode  # Triton: imported only where it runs

            return conv1d_decode(x, weight, bias, states, slots, silu=activation == "silu")
        return causal_conv1d(x, weight, bias, states, slots, cu_seqlens, activation)
