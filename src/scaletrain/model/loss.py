"""The training loss and its label convention, shared by every architecture.

`IGNORE_INDEX` is defined here, once: the loss skips those labels, and the data layer writes them for positions that
carry no target (a sequence's last position, padding, an SFT example's input). This module imports only torch, so
`data/` can take the constant from it without pulling in a model (and `model/` imports nothing from `data/`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label of a position that has no target; `loss_sum` skips it (it is also `F.cross_entropy`'s default)."""


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy over unmasked labels (fp32), so callers can normalise by any token count."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
