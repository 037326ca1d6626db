"""The host side: what lives in host RAM and what runs on the host's cores. The per-unit slabs
(``host_store.py``; ``shared_store.py`` for the ranks of one machine), the AdamW over them (``optim.py``),
their compact and split forms (``compact_state.py`` with its C and CUDA kernels, ``split_master.py``),
checkpoints (``checkpoint.py``) and which rank writes a save under data parallel (``collective_save.py``), flush-to-zero on the update threads (``denormals.py``) and the process's
resident memory (``hostmem.py``). Knows nothing of streams or the step's order.
"""
