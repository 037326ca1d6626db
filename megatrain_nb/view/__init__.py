"""What a person sees: a step's trace (``trace.py``: spans and counters -> DataFrames, stalls, Chrome
trace), figures over those DataFrames (``viz.py``, colours and words in ``palette.py``), the live dashboard
(``dashboard.py``), a run's HTML report (``report.py``), the tables a notebook shows (``tables.py``) and what a
step reports (``results.py``).
Reads what the step recorded; changes nothing about how it runs.
"""
