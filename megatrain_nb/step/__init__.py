"""The training step's machinery: the engine that runs a step's schedule and every cross-stream wait
(``engine.py``, and the parts it calls at named points: ``head.py``, ``embedding.py``, ``memory.py``),
the streams and copies (``transfers.py``), the host threads (``workers.py``), device-side updates
(``device_updates.py``), the order of operations (``schedule.py``), and what changes how a layer runs
(``lean.py``, ``tiling.py``, ``attncache.py``, ``early_rows.py``), plus data parallel's collectives
(``distributed.py``, called by the engine at the points of its Note: [Data parallel]).
Imports the host side, the machine models, the model adapters and the views. Of this package the
machine models read only the schedule (``schedule.py``, pure Python) and lean's and tiling's sizing rules.
"""
