"""What the trained weights are: LoRA adapters over a frozen base (:mod:`.lora`), their
configuration (:mod:`.lora_config`, JAX-free so the CLI can check flags before importing JAX)
and PEFT adapter directories (:mod:`.peft`).

Kept import-free on purpose: importing ``jaxrl_sym.weights.lora_config`` must not pull in JAX.
"""
