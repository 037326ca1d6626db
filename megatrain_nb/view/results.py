"""What one training step reports (``StepResult``): a leaf module, so that the session and the
checkpoint that writes its history both import it without importing each other."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepResult:
    """What one ``Session.step`` did."""

    step: int  # 1-based index of this step
    loss: float  # HF's loss: mean cross-entropy over supervised tokens; with a loss hook, its loss
    tokens: int  # tokens in the batch (B*T)
    seconds: float  # wall time of the step call
    lr: float  # learning rate this step's update uses
    tflops: float  # model TFLOPS: 6 * params * tokens / seconds / 1e12
    recomputed_layers: int
    grad_norm: float = float("nan")  # global L2 norm of the gradients (before clipping)
    skipped: bool = False  # a non-finite loss or gradient: this step's update was skipped
    metrics: dict | None = None  # a loss hook's logged metrics (name -> float), summed over micro-batches and ranks
