"""Models of the machine: what a configuration costs before it runs. Memory and step time
(``planner.py``, its list scheduler ``simulate.py``), the checks before allocating (``preflight.py``),
a model's sizes (``shape.py``), the memory the device and the host may give within the user's budgets
(``budget.py``), datasheet profiles of other cards (``cards.py``), where each unit's update lives (``placement.py``, ``autoplan.py``) and the
long-context memory rule that the planner and the engine share (``longcontext.py``). Pure arithmetic for
the most part: no streams, no copies; the engine applies what these modules decide.
"""
