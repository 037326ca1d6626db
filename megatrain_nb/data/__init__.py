"""Data for the trainer: the doors to batches (``batches.py``: synthetic tasks, ``sft_batches``,
``jsonl_batches``), fine-tuning records (``sft.py``), preference pairs (``preference.py``:
``preference_batches``), packed examples kept apart (``packing.py``) and real text without a download
(``stdlib_text.py``: the standard library's sources, a BPE trained on them; imported by its own path).

Owns: what the trainer eats, batches of ``{"input_ids", "labels"[, "position_ids"]}``; ``files/`` holds
the demo model's config. Does not own: models, devices or the step. The public names live here:
``megatrain_nb.data.synthetic_batches``, ``sft_batches``, ``jsonl_batches``, ``preference_batches``, ``IGNORE``.
"""
from .batches import TOKENIZER_FILES, IGNORE, KINDS, SftBatches, jsonl_batches, sft_batches, synthetic_batches  # noqa: F401
from .preference import PreferenceBatches, preference_batches  # noqa: F401

__all__ = ["synthetic_batches", "sft_batches", "jsonl_batches", "preference_batches", "SftBatches", "PreferenceBatches",
           "IGNORE", "KINDS"]
