"""What a reader sees of a name: one colour and one label per phase, slot state and counter, for every figure.

Owns the colours and the reader-facing words of the figures (`viz`, hence the dashboard, the HTML
report and the notebooks): a phase has the same colour in every figure, a colour means one thing
(the slot state "loading" *is* a weight copy, so it shares the I/O colour; nothing else repeats),
and a legend or axis shows words a reader knows ("pinned staging in use", not
`pinned_in_use_bytes`). Does not draw: `viz` does. Unknown names fall back to the name itself in
grey, so a new lane, phase or counter still draws before it gets its entry here.
"""
from __future__ import annotations

PHASE_COLORS = {"fwd": "#4C78A8", "loss": "#B279A2", "recompute": "#72B7B2", "bwd": "#F58518",
                "optim": "#54A24B", "io": "#9D755D"}
PHASE_LABELS = {"fwd": "forward", "loss": "loss", "recompute": "recompute", "bwd": "backward",
                "optim": "optimizer", "io": "I/O"}
STATE_COLORS = {"loading": PHASE_COLORS["io"], "ready": "#BAB0AC", "computing": "#EECA3B", "free": "#DDDDDD"}
STALL_COLOR = "#D62728"
OTHER_COLOR = "#888888"

LANE_LABELS = {"compute": "compute", "device-adam": "device-adam · AdamW on the device",
               "h2d": "h2d · weights in", "d2h": "d2h · grads out", "d2h-state": "d2h-state · device units' state back",
               "host-pack": "host-pack · staging", "host-unpack": "host-unpack · grads",
               "h2d-moments": "h2d-moments · arriving groups' moments in",
               "host-moments": "host-moments · their staging (Note [Late moments])",
               "host-adam": "host-adam · AdamW", "driver": "driver · step preparation, prelude"}
SLOT_LABELS = {"weight": "weight slot", "grad": "grad slot", "pinned": "pinned buffer"}

# Trace counters ("device_mem." stripped) and planner categories, as a legend says them.
MEMORY_LABELS = {"weights": "weights", "grads": "gradients", "activations": "activations",
                 "weight_slots": "weight slots", "grad_slots": "gradient slots", "head_slots": "head slots",
                 "embedding_rows": "embedding rows", "logits": "logits", "reserve": "allocator reserve",
                 "host_rss_bytes": "host RSS (whole process)", "pinned_in_use_bytes": "pinned staging in use",
                 "master_fp32": "fp32 master weights", "adam_moments": "AdamW moments", "pinned_pool": "pinned staging pool",
                 "activations_kept": "activations kept", "checkpoints": "layer-input checkpoints",
                 "recompute_workspace": "recompute workspace", "backward_transient": "backward transients",
                 "embedding_grad_rows": "embedding gradient rows",
                 "resident": "units resident on the device", "resident_state": "units resident on the device",
                 "state_slots": "streamed units' state slots", "head_state": "streamed head group's state"}
# Columns of `Session.history_dataframe()`.
METRIC_LABELS = {"loss": "loss", "eval_loss": "eval loss", "tokens_per_s": "tokens/s", "tflops": "model TFLOP/s",
                 "peak_device_bytes": "peak device memory", "host_rss_bytes": "host RSS"}


def label(name: str, labels: dict[str, str]) -> str:
    """The reader's word for `name` in `labels`, or `name` itself when it has none.

    Example:
        >>> label("pinned_in_use_bytes", MEMORY_LABELS), label("new_counter", MEMORY_LABELS)
        ('pinned staging in use', 'new_counter')
    """
    return labels.get(name, name)


def slot_label(kind: str, index: int) -> str:
    """'weight slot 0' for ("weight", 0); unknown kinds keep their name."""
    return f"{label(kind, SLOT_LABELS)} {index}"
