"""What generation holds, without running it: :mod:`.estimate` (bytes from shapes, compiling
nothing: the memory check before a decode), :mod:`.ledger` (named buffers and the moments they
are alive together) and :mod:`.ledger_generation` (the runtime's own dispatches walked over its
compiled, never run, programs).

Why a room: the three are read by the systems, the RL step's ledger and the projections, never by
the decode loop itself. Kept import-free.
"""
