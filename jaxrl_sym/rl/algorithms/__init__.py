"""The algorithms' maths, with no step machinery: the advantage estimates (GRPO, RLOO, PPO's GAE)
and the per-token loss weights in :mod:`.advantages` (numpy, on the host), and the one policy
loss every algorithm shares (PPO-clip, GSPO, CISPO, KL to the reference, PPO's value loss) in
:mod:`.losses` (JAX, on per-slot arrays of any layout).

Kept import-free on purpose: importing a submodule must not load its siblings.
"""
