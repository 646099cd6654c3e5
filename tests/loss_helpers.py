"""What the loss tests share (test_losses*.py): float32 rows from nested lists, as values or as
leaves that collect a gradient."""
from __future__ import annotations

import torch

NAN, INF = float("nan"), float("inf")


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def leaf(rows) -> torch.Tensor:
    return t(rows).requires_grad_()
