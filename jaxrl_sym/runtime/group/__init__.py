"""One aligned microbatch decoding on device: the engine's host loop and what it keeps.

``loop.py``: :class:`~jaxrl_sym.runtime.group.loop.DecodeGroup`, the loop itself, which asks
the pure policy (:mod:`jaxrl_sym.runtime.policy`) before every dispatch and carries its answer
out; ``rows.py``: its per-row host state as one immutable value; ``refills.py``: its refills
from the prompt cache; ``outputs.py``: what the host has read back per request row;
``programs_by_shape.py``: the programs it runs, by shape (the generation ledger compiles the
same ones at shapes that never run).
"""
