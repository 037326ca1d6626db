"""What a reader sees of a name: one colour and one label per phase, slot state, memory category, metric and
wait, for every figure.

Owns the colours and the reader-facing words of the figures (`viz`, hence the dashboard, the HTML
report and the notebooks): a category has the same colour in every figure, a colour means one thing
(the slot state "loading" *is* a weight copy, so it shares the I/O colour; two names of one category,
such as the planner's "master_fp32" and the store's "master", share theirs; nothing else repeats), waiting
is drawn unlike work (`WAIT_COLOR` with `WAIT_PATTERN`, stalls in `STALL_COLOR`), and a legend or axis
shows words a reader knows ("pinned staging in use", not `pinned_in_use_bytes`). Does not draw: `viz`
does. Unknown names fall back to the name itself in grey (`color`), or to `EXTRA_COLORS` in order where a
figure draws several names the palette does not know (`colors_for`), so a new lane, phase, counter or
metric still draws before it gets its entry here.
"""
from __future__ import annotations

PHASE_COLORS = {"fwd": "#4C78A8", "loss": "#B279A2", "recompute": "#72B7B2", "bwd": "#F58518",
                "optim": "#54A24B", "io": "#9D755D"}
PHASE_LABELS = {"fwd": "forward", "loss": "loss", "recompute": "recompute", "bwd": "backward",
                "optim": "optimizer", "io": "I/O"}
STATE_COLORS = {"loading": PHASE_COLORS["io"], "ready": "#BAB0AC", "computing": "#EECA3B", "free": "#DDDDDD"}
STALL_COLOR = "#D62728"  # compute idle: the bands and markers of `trace.find_stalls`
WAIT_COLOR = "#F2B6B6"  # a worker held (e.g. a load waiting for an update): pale red, hatched, never a phase's colour
WAIT_PATTERN = "/"  # plotly bar marker.pattern.shape of waits
WAIT_LABEL = "waiting (held, not working)"
CARRIED_COLOR = "rgba(120,120,120,0.12)"  # the band of work carried over from the previous step
OTHER_COLOR = "#888888"

LANE_LABELS = {"compute": "compute", "device-adam": "device-adam · AdamW on the device",
               "h2d": "h2d · weights in", "d2h": "d2h · grads out", "d2h-state": "d2h-state · device units' state back",
               "host-pack": "host-pack · staging", "host-unpack": "host-unpack · grads",
               "h2d-moments": "h2d-moments · arriving groups' moments in",
               "host-moments": "host-moments · their staging (Note [Late moments])",
               "host-adam": "host-adam · AdamW", "driver": "driver · step preparation, prelude"}
SLOT_LABELS = {"weight": "weight slot", "grad": "grad slot", "pinned": "pinned buffer"}

# Trace counters ("device_mem." stripped), planner categories and `Session.memory_report` keys, as a legend
# says them. Two keys with one label are one category (and share a colour in MEMORY_COLORS).
MEMORY_LABELS = {"weights": "weights", "grads": "gradients", "activations": "activations",
                 "weight_slots": "weight slots", "grad_slots": "gradient slots", "head_slots": "head slots",
                 "embedding_rows": "embedding rows", "logits": "logits", "reserve": "allocator reserve",
                 "host_rss_bytes": "host RSS (whole process)", "pinned_in_use_bytes": "pinned staging in use",
                 "master_fp32": "fp32 master weights", "adam_moments": "AdamW moments", "pinned_pool": "pinned staging pool",
                 "activations_kept": "activations kept", "checkpoints": "layer-input checkpoints",
                 "recompute_workspace": "recompute workspace", "backward_transient": "backward transients",
                 "embedding_grad_rows": "embedding gradient rows", "attention_cache": "attention cache",
                 "parked_checkpoints": "checkpoints parked in host RAM", "runtime": "runtime (CUDA, Python, torch)",
                 "resident": "units resident on the device", "resident_state": "units resident on the device",
                 "state_slots": "streamed units' state slots", "head_state": "streamed head group's state",
                 # Session.memory_report / HostStore.bytes_report
                 "master": "fp32 master weights", "grad": "gradients", "grad_ring": "gradient ring (host buffers)",
                 "grad_rows": "embedding gradient, touched rows (fp32)",
                 "exp_avg": "AdamW 1st moment",
                 "exp_avg_sq": "AdamW 2nd moment", "shadow": "pinned compute-dtype copy", "pinned_copy": "pinned compute-dtype copy",
                 "cast_stage": "fp32 landing buffers (cast on the device)",
                 "device_resident": "units resident on the device"}
# One colour per category above (keys of one label share it). Families: weights blue, gradients orange,
# optimizer state green, activations purple/pink, transfers brown, runtime and reserves grey.
MEMORY_COLORS = {"master_fp32": "#08306B", "master": "#08306B", "weights": "#2171B5", "weight_slots": "#6BAED6",
                 "head_slots": "#9ECAE1", "embedding_rows": "#17BECF", "shadow": "#393B79", "pinned_copy": "#393B79",
                 "grads": "#D94801", "grad": "#D94801", "grad_ring": "#F16913", "grad_rows": "#A63603", "grad_slots": "#FDAE6B", "embedding_grad_rows": "#FFD8A8",
                 "adam_moments": "#006D2C", "exp_avg": "#41AB5D", "exp_avg_sq": "#A1D99B",
                 "resident": "#BCBD22", "resident_state": "#BCBD22", "device_resident": "#BCBD22",
                 "state_slots": "#8CA252", "head_state": "#CEDB9C",
                 "activations": "#6A51A3", "activations_kept": "#9467BD", "checkpoints": "#C5B0D5",
                 "parked_checkpoints": "#DADAEB", "attention_cache": "#E377C2", "recompute_workspace": "#F7B6D2",
                 "backward_transient": "#AD494A", "logits": "#7B4173",
                 "pinned_pool": "#8C564B", "pinned_in_use_bytes": "#C49C94", "cast_stage": "#BF812D", "host_rss_bytes": "#252525",
                 "runtime": "#7F7F7F", "reserve": "#C7C7C7"}
# Columns of `Session.history_dataframe()`.
METRIC_LABELS = {"loss": "training loss", "eval_loss": "eval loss", "tokens_per_s": "tokens/s",
                 "tflops": "model TFLOP/s", "peak_device_bytes": "peak device memory", "host_rss_bytes": "host RSS"}
METRIC_COLORS = {"loss": "#222222", "eval_loss": "#E15759", "tokens_per_s": "#17BECF", "tflops": "#9467BD",
                 "peak_device_bytes": "#8C564B", "host_rss_bytes": "#7F7F7F"}
# `optimizer_state`: the moments' precision, in every figure that compares them.
STATE_PRECISION_COLORS = {"fp32": "#2B2D80", "int8": "#E6550D", "int4": "#31A354"}
# For names no table above knows (a loss hook's metrics, a new counter): taken in order within one figure.
EXTRA_COLORS = ("#1B9E77", "#D95F02", "#7570B3", "#E7298A", "#66A61E", "#E6AB02", "#A6761D", "#666666",
                "#FF9DA7", "#86BCB6", "#D4A6C8", "#B5BD61")


def label(name: str, labels: dict[str, str]) -> str:
    """The reader's word for `name` in `labels`, or `name` itself when it has none.

    Example:
        >>> label("pinned_in_use_bytes", MEMORY_LABELS), label("new_counter", MEMORY_LABELS)
        ('pinned staging in use', 'new_counter')
    """
    return labels.get(name, name)


def color(name: str, colors: dict[str, str]) -> str:
    """The colour of `name` in `colors`, or `OTHER_COLOR` (grey) when it has none.

    Example:
        >>> color("master_fp32", MEMORY_COLORS) == color("master", MEMORY_COLORS), color("new", MEMORY_COLORS)
        (True, '#888888')
    """
    return colors.get(name, OTHER_COLOR)


def colors_for(names, colors: dict[str, str]) -> dict[str, str]:
    """A colour for each of `names` in one figure: its own from `colors`, else the next unused of
    `EXTRA_COLORS` (then grey), so names the palette does not know still differ from each other.

    Example:
        >>> colors_for(["loss", "kl", "reward_mean"], METRIC_COLORS)
        {'loss': '#222222', 'kl': '#1B9E77', 'reward_mean': '#D95F02'}
    """
    extra = iter(c for c in EXTRA_COLORS if c not in set(colors.values()))
    return {n: colors[n] if n in colors else next(extra, OTHER_COLOR) for n in dict.fromkeys(names)}


def color_map(names, labels: dict[str, str], colors: dict[str, str]) -> dict[str, str]:
    """Label -> colour of `names`, for plotly express's `color_discrete_map` when a column holds the labels.

    Example:
        >>> color_map(["master_fp32", "weight_slots"], MEMORY_LABELS, MEMORY_COLORS)
        {'fp32 master weights': '#08306B', 'weight slots': '#6BAED6'}
    """
    return {label(n, labels): c for n, c in colors_for(names, colors).items()}


def slot_label(kind: str, index: int) -> str:
    """'weight slot 0' for ("weight", 0); unknown kinds keep their name."""
    return f"{label(kind, SLOT_LABELS)} {index}"


def layer_label(layer, head: int | None = None) -> str:
    """How a figure names a layer index: -1 is the embedding and `head` (the layer count L, when known)
    the LM head with the loss (`Recorder.span`'s convention); None or NA blank.

    Example:
        >>> layer_label(-1), layer_label(3), layer_label(4, head=4), layer_label(None)
        ('embedding', '3', 'head', '')
    """
    if layer is None or str(layer) in ("", "<NA>", "nan"):
        return ""
    return "embedding" if int(layer) == -1 else "head" if head is not None and int(layer) == head else str(int(layer))
