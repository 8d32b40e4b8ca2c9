"""Low-rank adapters on the decoder's linear projections (finetune=lora).

    add_lora(model, rank=8, alpha=16, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    y = linear(x)               # = x W^T + (alpha / rank) * (x A^T) B^T,  A (rank, in), B (out, rank)
    merge_lora_state(state)     # {..."wq.weight", "wq.lora.a", "wq.lora.b"} -> {..."wq.weight": W + s B A}

Each targeted nn.Linear keeps its own `weight` (the state-dict key of the
layer is unchanged, so base checkpoints, init_from, exports and the Hugging
Face name mapping see the same names) and gains a child `lora` holding A and
B; a forward hook adds the adapter's output. B starts at zero, so the first
forward equals the base model's. Why not peft: peft replaces each adapted
layer by a wrapper whose base weight moves to `<name>.base_layer.weight`,
which would rename every adapted tensor of our checkpoints and exports and
the keys FSDP2 and DCP see; these few lines keep the names and the modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
KEY = ".lora."  # in every adapter tensor's state-dict key


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float):
        super().__init__()
        self.scale = alpha / rank
        self.a = nn.Parameter(torch.empty(rank, in_features))
        self.b = nn.Parameter(torch.empty(out_features, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))  # as nn.Linear's weight
        nn.init.zeros_(self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., in) -> (..., out)
        return F.linear(F.linear(x, self.a.to(x.dtype)), self.b.to(x.dtype)) * self.scale

    def delta(self) -> torch.Tensor:
        """(out, in): what the adapter adds to the weight."""
        return (self.b @ self.a) * self.scale


def _add_output(linear: nn.Linear, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + linear.lora(inputs[0])


def add_lora(model: nn.Module, rank: int, alpha: float, targets=TARGETS) -> list[str]:
    """Give every nn.Linear named one of `targets` an adapter; returns their module names."""
    adapted = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and not hasattr(module, "lora"):
            module.lora = LoRA(module.in_features, module.out_features, rank, alpha).to(module.weight.device)
            module.register_forward_hook(_add_output)
            adapted.append(name)
    return adapted


@torch.no_grad()
def reset_lora(model: nn.Module) -> None:
    """Re-initialize every adapter (after `to_empty()` of a model built on meta)."""
    for module in model.modules():
        if isinstance(module, LoRA):
            module.reset_parameters()


def is_lora_key(key: str) -> bool:
    return KEY in key


def merge_lora_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the plain one: each `<m>.weight` plus
    `scale * <m>.lora.b @ <m>.lora.a` (in float32), adapter tensors dropped."""
    merged = {k: v for k, v in state.items() if not is_lora_key(k)}
    for key in state:
        if key.endswith(".lora.a"):
            module = key[: -len(".lora.a")]
            weight = merged[f"{module}.weight"]
            delta = state[f"{module}.lora.b"].float() @ state[key].float()
            merged[f"{module}.weight"] = (weight.float() + scale * delta).to(weight.dtype)
    return merged
