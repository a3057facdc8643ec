"""The precision a run trains in, as one policy object (JAX-free: the CLI checks ``--precision``
before importing JAX).

Why a policy and not "whatever dtype the checkpoint has": a bf16 checkpoint updated in bf16
loses every update below bf16's resolution (8 significant bits: an update smaller than 1/256 of
a weight rounds away), while a run entirely in fp32 pays twice the bytes per weight read in
generation and scoring, which on a GPU is what decode time is made of. The field's answer
(Tunix, TRL, verl: "bf16 mixed precision") keeps fp32 *master* weights and optimiser state for
the update, and hands every forward a bf16 *compute* copy:

============== ============== ============== ================================================
precision      master + Adam  compute copy   what it gives
============== ============== ============== ================================================
``fp32``       float32        (the master)   exact; 16 B/param of update state + grads
``bf16-mixed`` float32        bfloat16       bf16 forward/backward, stores and reference;
                                             updates accumulate in fp32
``bf16``       bfloat16       (the master)   half the state; small updates round away
============== ============== ============== ================================================

In every policy, logits, log-softmax, the loss and the advantages are float32 (the models'
heads return float32 logits; :mod:`jaxrl_sym.rl.algorithms.losses` upcasts). :mod:`.view`
applies the policy to a model's leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl_sym.errors import InputError

__all__ = ["PRECISIONS", "Precision", "default_precision"]

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
_DTYPES = {"fp32": ("float32", "float32"), "bf16-mixed": ("float32", "bfloat16"),
           "bf16": ("bfloat16", "bfloat16")}


@dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS`; ``master`` and ``compute`` are the dtypes it implies."""

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise InputError(f"precision={self.name!r} (--precision): choose one of "
                             f"{', '.join(PRECISIONS)}")

    @property
    def master(self) -> str:
        """The dtype of the trained weights and the optimiser state."""
        return _DTYPES[self.name][0]

    @property
    def compute(self) -> str:
        """The dtype every forward (generation, scoring, the update's forward/backward) and
        every KV store and the reference weights are in."""
        return _DTYPES[self.name][1]

    @property
    def mixed(self) -> bool:
        """Whether the forward reads a copy of the weights in another dtype than the master."""
        return self.master != self.compute

    @classmethod
    def of(cls, value: str | Precision | None, *, pretrained: bool,
           platform: str) -> Precision:
        """``value``, or where it is None the default for this run (:func:`default_precision`)."""
        if isinstance(value, Precision):
            return value
        if value is None:
            return cls(default_precision(pretrained=pretrained, platform=platform))
        if not isinstance(value, str):
            raise InputError(f"precision={value!r} (--precision): give one of "
                             f"{', '.join(PRECISIONS)}")
        return cls(value)


def default_precision(*, pretrained: bool, platform: str) -> str:
    """``bf16-mixed`` for a pretrained checkpoint on an accelerator (what the field fine-tunes
    in), ``fp32`` otherwise: the built-in tasks' small models train from scratch, and on a CPU
    XLA computes bf16 by converting to fp32 and back, so bf16 saves nothing there and costs
    conversions."""
    return "bf16-mixed" if pretrained and platform in ("gpu", "tpu") else "fp32"
