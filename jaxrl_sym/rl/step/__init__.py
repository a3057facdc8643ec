"""One RL step's machinery: :class:`~jaxrl_sym.rl.step.trainer.RLTrainer` and what it runs.

:mod:`.trainer` (the step: generate → reference → reward → advantages → update, committed at
once), :mod:`.stages` (those stages as functions of the state), :mod:`.state` (the immutable
train state, optimiser, digest), :mod:`.context` (what one step's stages share),
:mod:`.rollout` / :mod:`.sampling` (rollouts, rewards, sampling fields),
:mod:`.programs` / :mod:`.logprobs` / :mod:`.remat` (the compiled loss, reference and update
programs), :mod:`.partial` (partial rollouts) and :mod:`.ledger` (a step's memory ledger from
compiled, never run, programs). Each trainable system's RL half — its layout (packed,
shared-prompt or padded rows), its forward, the reference overlapped with generation — lives
with the system, in :mod:`jaxrl_sym.systems`.

Kept import-free on purpose: ``jaxrl_sym.rl.step.sampling`` must not pull in JAX.
"""
