"""LoRA settings, checked on construction; JAX-free so the CLI can check flags before JAX loads.

``LoraConfig(rank, alpha, dropout, targets, base_dtype)`` — what :func:`jaxrl_sym.weights.lora
.plan_lora` turns into a plan over a model's parameter leaves. Why the defaults are what they are:

* ``rank=16, alpha=32`` (scale ``alpha / rank = 2``): TRL's ``ModelConfig`` defaults
  (``lora_r=16``, ``lora_alpha=32``), the RL fine-tuning library closest to this one's use.
  PEFT's own ``LoraConfig`` defaults to ``r=8, lora_alpha=8`` and Tunix's GRPO examples use
  rank 64, alpha 64 (scale 1); all keep alpha a fixed number, not a multiple of the rank, so
  changing ``rank`` alone changes the scale here too, exactly as it does there.
* ``targets="all-linear"``: PEFT's shorthand — every 2-D ``kernel`` leaf (a Linear layer's
  weight) except the output head, which PEFT leaves out for causal LMs. Any other string is a
  regular expression that must match a parameter's whole dotted path
  (``re.fullmatch``, as PEFT matches a regex ``target_modules`` against module names), e.g.
  ``.*\\.(q_proj|v_proj)\\.kernel``.
* ``dropout=0.0`` and nothing else: LoRA dropout acts on a layer's *input* ``x`` before ``A``
  (``W x + s·B A drop(x)``). Here the adapters act through merged weights ``W + s·A B`` on a
  model whose code is not changed, so there is no place to drop ``x`` for the adapter path
  alone; a mask on ``A``'s rows would be one mask for every token, a different regulariser.
* ``base_dtype=None`` keeps the frozen base in the checkpoint's dtype; ``"bfloat16"`` halves
  it (the adapters stay float32).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from jaxrl_sym.errors import InputError

ALL_LINEAR = "all-linear"
BASE_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters ``W + (alpha / rank) · A @ B`` on the parameters ``targets`` selects.

    Frozen (hashable), so a plan holding it can be a static argument of a jitted function.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: str = ALL_LINEAR
    base_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise InputError(f"LoraConfig.rank={self.rank!r}: must be an int >= 1 (the adapters' "
                             "inner dimension; 8-64 is usual)")
        if (not isinstance(self.alpha, int | float) or isinstance(self.alpha, bool)
                or not 0 < self.alpha <= sys.float_info.max):  # NaN, inf, an int past float
            raise InputError(f"LoraConfig.alpha={self.alpha!r}: must be a finite number > 0 (the "
                             "update is scaled by alpha / rank; 2 x rank is common)")
        self._check_dropout()
        self._check_targets()
        if self.base_dtype is not None and (not isinstance(self.base_dtype, str)
                                            or self.base_dtype not in BASE_DTYPES):
            raise InputError(f"LoraConfig.base_dtype={self.base_dtype!r}: give None (keep the "
                             f"checkpoint's dtype) or one of {', '.join(BASE_DTYPES)}")

    def _check_dropout(self) -> None:
        if not isinstance(self.dropout, int | float) or isinstance(self.dropout, bool):
            raise InputError(f"LoraConfig.dropout={self.dropout!r}: must be the number 0.0")
        if self.dropout != 0.0:
            raise InputError(
                f"LoraConfig.dropout={self.dropout!r}: only 0.0 is supported. LoRA dropout drops "
                "the layer's input x on the adapter path only (W x + s·B A dropout(x)), but the "
                "adapters here act through merged weights W + s·A B on an unchanged model, "
                "which cannot express that; set dropout=0.0 (use the KL term or weight decay "
                "to regularise instead)")

    def _check_targets(self) -> None:
        if not isinstance(self.targets, str) or not self.targets:
            raise InputError(f"LoraConfig.targets={self.targets!r}: give {ALL_LINEAR!r} or a "
                             "regular expression over dotted parameter paths, e.g. "
                             r"'.*\.(q_proj|v_proj)\.kernel'")
        if self.targets == ALL_LINEAR:
            return
        try:
            re.compile(self.targets)
        except (re.error, OverflowError) as err:  # OverflowError: a repeat count like a{10**20}
            raise InputError(f"LoraConfig.targets={self.targets!r} is not a valid regular "
                             f"expression ({err}); it must match whole dotted parameter paths, "
                             r"e.g. '.*\.(q_proj|v_proj)\.kernel'") from None

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor on ``A @ B`` (PEFT's ``scaling`` without rsLoRA)."""
        return float(self.alpha) / self.rank
