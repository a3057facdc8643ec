"""What a run learns and how it is scored: the built-in token tasks (:mod:`.token_tasks`), the
text tasks of a pretrained model (:mod:`.text_tasks`), the user's datasets (:mod:`.data`) and
reward functions (:mod:`.rewards`). JAX-free throughout.

Kept import-free on purpose: importing a submodule must not load its siblings.
"""
