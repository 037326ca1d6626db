"""Post-training: what turns a step's per-token log-probs into a preference or reinforcement-learning loss.

Owns: the losses (``losses.py``: SFT, DPO, GRPO and its loss types, KTO, group-normalised advantages) and their
``LossContext`` (the step's global token and sequence counts, and the metrics the losses log). Does not own: the
step, the log-probs' computation (``step/head.py``) or the data (``data/preference.py``).
"""
