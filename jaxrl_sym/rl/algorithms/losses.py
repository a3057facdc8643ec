"""The one policy loss every algorithm shares, on per-slot arrays of any layout.

The policy loss is a knob of :class:`~jaxrl_sym.rl.knobs.AlgorithmConfig` (``pg_loss``):
PPO's token-clipped surrogate (GRPO, DAPO, Dr. GRPO), GSPO's sequence-ratio surrogate
(:func:`gspo_terms`) or CISPO's clipped, stop-gradient importance weights (:func:`cispo_terms`),
each on top of any advantage estimate (:mod:`jaxrl_sym.rl.algorithms.advantages`), plus beta·KL
to the reference and, for PPO, a value loss.

The loss works on *any* layout (packed rows for the symbolic runtime, right-padded rows for the
baseline) because it only sees per-slot arrays aligned with the slot whose logits predict each
response token, and per-slot weights that are zero off the response. That is what lets the two
systems share the loss code and agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_sym.rl.knobs import AlgorithmConfig

__all__ = ["cispo_terms", "gspo_terms", "loss_from_terms", "merge_aux", "rl_loss",
           "sequence_means", "slot_terms", "token_logprobs", "value_predictions"]


def _scaled(logits: jax.Array, temperature: float) -> jax.Array:
    x = logits.astype(jnp.float32)
    return x / temperature if temperature != 1.0 else x


@jax.custom_vjp
def logprob_and_entropy(x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(log p(target), -sum p log p)`` of ``softmax(x)`` over the last axis, with
    ``0 · log 0 = 0`` for words the model rules out (``-inf`` logits): value and gradient
    finite. The log-prob is :func:`token_logprobs`' computation (the reference's), op for op.

    Why one custom VJP for both: under autodiff the entropy's masked form keeps a log-softmax,
    its mask and a masked copy for the backward, and the log-prob's log-sum-exp another softmax
    — ``[slots × vocab]`` fp32 buffers each (Qwen2.5's 151,936 words × a 1,024-slot chunk:
    0.62 GB apiece, seen in the GPU projection's update temporaries). Here the backward keeps
    only ``x``, its log-sum-exp and H, and recomputes ``p`` in one fused expression:
    ``d lp / dx = onehot - p`` and ``dH/dx_i = -p_i (log p_i + H)`` (0 where ``p_i = 0``)."""
    return _lp_ent_fwd(x, targets)[0]


def _lp_ent_fwd(x: jax.Array, targets: jax.Array) -> tuple[tuple[jax.Array, jax.Array], Any]:
    picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    lse = jax.nn.logsumexp(x, axis=-1)
    logp = x - lse[..., None]
    p = jnp.exp(logp)
    h = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    return (picked - lse, h), (x, lse, h, targets)


def _lp_ent_bwd(res: Any, g: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    x, lse, h, targets = res
    g_lp, g_h = g
    logp = x - lse[..., None]
    p = jnp.exp(logp)
    onehot = jnp.arange(x.shape[-1], dtype=jnp.int32) == targets[..., None].astype(jnp.int32)
    d_ent = jnp.where(p > 0, -p * (logp + h[..., None]), 0.0)
    return g_lp[..., None] * (onehot - p) + g_h[..., None] * d_ent, None


logprob_and_entropy.defvjp(_lp_ent_fwd, _lp_ent_bwd)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
    """log p(target | slot) for every slot, under softmax(logits / temperature) — the same
    distribution :func:`jaxrl_sym.generation.select_tokens` samples from."""
    # target logit minus logsumexp: no [slots × vocab] log-softmax is kept beside the logits
    x = _scaled(logits, temperature)
    picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def value_predictions(logits: jax.Array, head: dict[str, jax.Array]) -> jax.Array:
    """PPO's value head: a linear read-out of the LM's final features.

    The LM's head is tied (logits = h · Eᵀ), so a linear map of the logits is a linear map of the
    final hidden state restricted to the embedding span — a value head on the shared trunk
    without changing the traced model (whose only output is logits).
    """
    return logits.astype(jnp.float32) @ head["w"] + head["b"]


def slot_terms(logits: jax.Array, targets: jax.Array, temperature: float,
               value_head: dict[str, jax.Array] | None = None, *, entropy: bool = True
               ) -> dict[str, jax.Array]:
    """What the loss needs from each slot's logits: ``lp`` (log-prob of the target), ``ent``
    (entropy of softmax(logits / temperature)) and, with a value head, ``v``.

    Everything the loss reads from the logits passes through here, per slot: that is what lets
    :mod:`jaxrl_sym.rl.step.logprobs` compute these terms a chunk of slots at a time (the logits of
    one chunk at once) and hand :func:`loss_from_terms` the same arrays the unchunked loss sees.
    """
    # the same computation as the reference's log-probs, so identical weights give d = 0 exactly
    if entropy:
        lp, ent = logprob_and_entropy(_scaled(logits, temperature), targets)
        out = {"lp": lp, "ent": ent}
    else:
        out = {"lp": token_logprobs(logits, targets, temperature)}
    if value_head is not None:
        out["v"] = value_predictions(logits, value_head)
    return out


def rl_loss(
    logits: jax.Array,
    arrays: dict[str, jax.Array],
    value_head: dict[str, jax.Array] | None,
    cfg: AlgorithmConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy loss + beta·KL (+ vf_coef·value loss) as a weighted sum over slots, from
    the whole batch's logits (see :func:`loss_from_terms` for the loss itself)."""
    terms = slot_terms(logits, arrays["targets"], cfg.temperature, value_head)
    return loss_from_terms(terms, arrays, cfg)


def loss_from_terms(terms: dict[str, jax.Array], arrays: dict[str, jax.Array], cfg: AlgorithmConfig
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss from the per-slot :func:`slot_terms` (``v`` present: PPO's value loss too).

    ``arrays`` (all the layout's shape, aligned with the *predicting* slot of each response
    token): ``targets`` (the sampled token), ``mask`` (slot predicts a response token),
    ``weight`` (aggregation weight, 0 off the response), ``old_lp`` (generation-time log-probs),
    ``ref_lp``, ``adv``, and for PPO ``returns`` / ``old_values``.

    Off-response slots are neutralised with ``where`` *before* any exp: a masked slot with a huge
    log-ratio would otherwise give inf·0 = NaN in the forward or the gradient.
    """
    mask = arrays["mask"]
    w = arrays["weight"]
    lp, ent = terms["lp"], terms["ent"]
    log_ratio = jnp.where(mask, lp - arrays["old_lp"], 0.0)
    ratio = jnp.exp(log_ratio)
    adv = arrays["adv"]
    pg, tis_w, clip_ratio = _policy_gradient(lp, ratio, log_ratio, mask, adv, cfg)
    per_tok = pg
    d = jnp.where(mask, arrays["ref_lp"] - lp, 0.0)
    # k3 estimate of KL(pi || ref): >= 0 in exact arithmetic; expm1 and the clamp keep fp32
    # rounding at tiny d from reporting a negative KL (the clamp is inactive wherever kl > 0)
    kl = jnp.maximum(jnp.expm1(d) - d, 0.0)
    if cfg.beta > 0:
        per_tok = per_tok + cfg.beta * kl
    n_tok = jnp.maximum(jnp.sum(mask), 1)
    if cfg.entropy_coef > 0:
        per_tok = per_tok - cfg.entropy_coef * ent
    loss = jnp.sum(jnp.where(mask, w * per_tok, 0.0))

    tok_mean = lambda x: jnp.sum(jnp.where(mask, x, 0.0)) / n_tok
    aux = {"pg_loss": jnp.sum(jnp.where(mask, w * pg, 0.0)), "kl": tok_mean(kl),
           "entropy": tok_mean(ent),
           **_ratio_stats(ratio, clip_ratio, log_ratio, adv, mask, tok_mean, cfg)}
    if tis_w is not None:
        aux["tis_weight_mean"] = tok_mean(tis_w)
    if "v" in terms:
        loss, aux["v_loss"] = _add_value_loss(loss, terms["v"], arrays, cfg)
    aux["loss"] = loss
    aux["n_tok"] = n_tok.astype(jnp.float32)
    return loss, aux


def _ratio_stats(ratio: jax.Array, clip_ratio: jax.Array, log_ratio: jax.Array,
                 adv: jax.Array, mask: jax.Array, tok_mean: Callable[[jax.Array], jax.Array],
                 cfg: AlgorithmConfig) -> dict[str, jax.Array]:
    """Diagnostics of the importance ratios (new / generation-time probabilities).

    ``clip_ratio`` is the ratio the loss clips: the token's, or under GSPO its sequence's (so
    ``clip_frac`` counts the tokens of clipped sequences). CISPO never zeroes a gradient, so
    there it counts the tokens whose importance weight was truncated, whatever A's sign."""
    low = clip_ratio < 1.0 - cfg.clip_eps
    high = clip_ratio > 1.0 + cfg.clip_high
    if cfg.pg_loss != "cispo":
        low, high = low & (adv < 0), high & (adv > 0)
    return {
        # k3 KL(behaviour || current) from the same ratios: how far this update has moved off
        # the policy that sampled (0 on the first epoch; a large value means lr or epochs too big)
        "kl_old": tok_mean(jnp.maximum(jnp.expm1(-log_ratio) + log_ratio, 0.0)),
        # the clip binds (zero gradient) only where it changes the minimum: ratio below
        # 1 - clip_eps with A < 0, or above 1 + clip_eps_high with A > 0 (TRL's definition)
        "clip_frac": tok_mean(low | high),
        "clip_low_frac": tok_mean(low),
        "clip_high_frac": tok_mean(high),
        "ratio_mean": tok_mean(ratio),
        "ratio_min": jnp.min(jnp.where(mask, ratio, 1.0)),
        "ratio_max": jnp.max(jnp.where(mask, ratio, 1.0)),
        # generation vs trainer log-probs: on the first epoch (the weights that sampled) these
        # measure the rollout/trainer mismatch (precision, kernels), 0 when both agree exactly
        "lp_mismatch_mean": tok_mean(jnp.abs(log_ratio)),
        "lp_mismatch_max": jnp.max(jnp.abs(log_ratio)),
        "ratio_outside": tok_mean((ratio < 0.8) | (ratio > 1.25)),
    }


def _policy_gradient(lp: jax.Array, ratio: jax.Array, log_ratio: jax.Array, mask: jax.Array,
                     adv: jax.Array, cfg: AlgorithmConfig
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Per-token policy-gradient term, the TIS weights (None when off) and the ratio the term
    clips (for the diagnostics), by ``cfg.pg_loss``.

    ``ppo_clip`` (GRPO, DAPO, Dr. GRPO: they differ in advantages and aggregation, not here):
    ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` per token, ``r = exp(lp - old_lp)``.
    ``gspo`` / ``cispo``: :func:`gspo_terms` / :func:`cispo_terms`.

    Without ``tis_cap`` the ratio is against the generation's log-probs. With it (epochs == 1,
    so ``lp`` is the trainer's forward at the weights that sampled; ``ppo_clip`` only), the ratio
    is against the trainer's own log-probs, ``exp(lp - stop_gradient(lp))`` (1, with lp's
    gradient), and the term is weighted by ``min(exp(lp - old_lp), tis_cap)``, held constant
    (verl's TIS)."""
    lo, hi = cfg.clip_eps, cfg.clip_high
    if cfg.pg_loss == "gspo":
        pg, seq_ratio = gspo_terms(log_ratio, mask, adv, lo, hi)
        return pg, None, seq_ratio
    if cfg.pg_loss == "cispo":
        return cispo_terms(lp, ratio, mask, adv, lo, hi), None, ratio
    if cfg.tis_cap is None:
        clipped = jnp.clip(ratio, 1.0 - lo, 1.0 + hi)
        return -jnp.minimum(ratio * adv, clipped * adv), None, ratio
    prox = jax.lax.stop_gradient(lp)
    tis_w = jnp.minimum(jnp.exp(jax.lax.stop_gradient(log_ratio)), cfg.tis_cap)
    own = jnp.exp(jnp.where(mask, lp - prox, 0.0))
    return -tis_w * own * adv, tis_w, ratio


def sequence_means(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Per slot, the mean of ``x`` over the slots of its sequence; 0 off the mask.

    A sequence is a run of consecutive ``mask`` slots along the last axis: in every layout
    (:mod:`jaxrl_sym.systems.layout`) a span ``(row, first, n)`` is followed in its row by at least
    one unmasked slot (the one holding the response's last token, which predicts nothing), so
    two sequences never touch even in packed or shared-prompt rows. Why runs rather than a
    segment array: the loss then needs nothing beyond the arrays every layout already gives
    it. Row-local (a segment sum per row), so rows may be split or sharded freely."""
    shape = mask.shape
    m = mask.reshape(-1, shape[-1])
    v = jnp.where(m, x.reshape(m.shape), 0.0)
    starts = m & ~jnp.pad(m[:, :-1], ((0, 0), (1, 0)))
    seg = jnp.where(m, jnp.cumsum(starts, axis=-1), 0)  # run k -> k (1-based); off-mask -> 0
    n_seg = shape[-1] + 1
    seg_sum = jax.vmap(lambda a, ids: jax.ops.segment_sum(a, ids, num_segments=n_seg))
    sums = seg_sum(v, seg)
    counts = jnp.maximum(seg_sum(m.astype(v.dtype), seg), 1.0)
    mean = jnp.take_along_axis(sums / counts, seg, axis=-1)
    return jnp.where(m, mean, 0.0).reshape(shape)


def gspo_terms(log_ratio: jax.Array, mask: jax.Array, adv: jax.Array, eps_low: float,
               eps_high: float) -> tuple[jax.Array, jax.Array]:
    """GSPO's per-token term and sequence ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv:2507.18071, section 4.1).

    ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t (lp_t - old_lp_t))`` and sequence
    i's loss is ``-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``: one ratio, so one
    clipping decision, per sequence. Why per sequence: token ratios are single samples of the
    next-token distribution, whose noise the token-level objective accumulates over long
    responses; the length-normalised sequence ratio is the likelihood ratio the reward is
    about. Each of the sequence's slots carries the same term, so ``loss_agg="seq_mean"``
    (weights ``1 / (sequences x |y_i|)``) gives the paper's mean over sequences; its gradient
    ``s_i A_i / |y_i| sum_t grad lp_t`` weighs the sequence's tokens equally. Because ``s_i``
    is a geometric mean it stays near 1: the paper clips at eps 3e-4 / 4e-4 (section 5.1), set
    through ``clip_eps`` / ``clip_eps_high``. With per-token advantages (PPO) each token's term
    uses its own A with the sequence's ratio. Returns (term, ``s_i`` per slot)."""
    seq_ratio = jnp.exp(sequence_means(log_ratio, mask))
    clipped = jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -jnp.minimum(seq_ratio * adv, clipped * adv), seq_ratio


def cispo_terms(lp: jax.Array, ratio: jax.Array, mask: jax.Array, adv: jax.Array,
                eps_low: float, eps_high: float) -> jax.Array:
    """CISPO's per-token term (MiniMax-M1 report, 2025, arXiv:2506.13585, section 3.1):
    ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)``, ``r_t = exp(lp - old_lp)``.

    Why: PPO's min drops the gradient of every token whose ratio left the clip range in A's
    direction — in long reasoning those are often the rare "fork" tokens that matter most.
    CISPO clips the importance weight instead, held constant (stop-gradient), so every token
    keeps a REINFORCE gradient ``-clip(r_t) A_t grad lp_t``, merely bounded in size. The
    report normalises by all tokens of the batch (``loss_agg="token_mean"``) and sets no lower
    bound (``clip_eps >= 1``), tuning only ``eps_high``. The value is the paper's objective
    (it contains ``log pi``, so it is not comparable to ``ppo_clip``'s); only its gradient is
    the policy gradient. ``lp`` is masked before use: off-response slots may hold ``-inf``."""
    w = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return -w * adv * jnp.where(mask, lp, 0.0)


def _add_value_loss(loss: jax.Array, v: jax.Array, arrays: dict[str, jax.Array],
                    cfg: AlgorithmConfig) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped value loss added to ``loss``; returns (new loss, value loss)."""
    old_v = arrays["old_values"]
    v_clip = old_v + jnp.clip(v - old_v, -cfg.vf_clip, cfg.vf_clip)
    ret = arrays["returns"]
    vl = 0.5 * jnp.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    v_loss = jnp.sum(jnp.where(arrays["mask"], arrays["weight"] * vl, 0.0))
    return loss + cfg.vf_coef * v_loss, v_loss


SUMMED_AUX = ("loss", "pg_loss", "v_loss", "n_tok")
TOKEN_MEAN_AUX = ("kl", "kl_old", "entropy", "clip_frac", "clip_low_frac", "clip_high_frac",
                  "ratio_mean", "lp_mismatch_mean", "ratio_outside", "tis_weight_mean")


def merge_aux(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine :func:`rl_loss` aux of micro-batches into the whole batch's.

    Losses are weighted sums whose weights were normalised over the whole batch, so they add;
    per-token means are re-weighted by each micro-batch's token count; the ratio maximum is a max.
    """
    n = sum(p["n_tok"] for p in parts)
    out: dict[str, float] = {}
    for key in parts[0]:
        if key in SUMMED_AUX:
            out[key] = sum(p[key] for p in parts)
        elif key in TOKEN_MEAN_AUX:
            out[key] = sum(p[key] * p["n_tok"] for p in parts) / max(n, 1.0)
        elif key in ("ratio_max", "lp_mismatch_max"):
            out[key] = max(p[key] for p in parts)
        elif key == "ratio_min":
            out[key] = min(p[key] for p in parts)
        else:
            out[key] = parts[-1][key]
    return out
