"""Speculative decoding on the symbolic runtime: :mod:`.lm` (``SpeculativeLM``, the engine that
drafts and verifies), :mod:`.tile` (the verify tile's device program), :mod:`.draft` (a draft
model traced and planned by the same runtime) and :mod:`.rules` (the prompt-lookup draft and the
acceptance rule the padded baseline's speculation shares).

Why a room: the four change together and nothing else of the runtime reads their internals.
Kept import-free: ``import jaxrl_sym.runtime.speculative.rules`` loads only what it needs.
"""
