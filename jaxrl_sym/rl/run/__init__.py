"""Running a training run around the step: the ``train`` and ``eval`` commands' flags
(:mod:`.cli`, :mod:`.eval_cli`, :mod:`.config_file`), the loop (:mod:`.train`), checkpoints
(:mod:`.checkpoint`), signals (:mod:`.interrupt`), output files and locks (:mod:`.run_files`),
progress and health (:mod:`.progress`), trackers (:mod:`.trackers`), plots (:mod:`.plot`), a
pretrained Hugging Face model's side of a run (:mod:`.pretrained`), evaluation
(:mod:`.evaluate`) and export of the trained policy (:mod:`.export`).

Kept import-free on purpose: the CLI's flag parsing (:mod:`.cli`, :mod:`.eval_cli`,
:mod:`.config_file`, :mod:`.trackers`) imports no JAX.
"""
