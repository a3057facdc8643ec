"""GSPO and CISPO (``AlgorithmConfig.pg_loss``) against numpy oracles written from the papers.

* GSPO (Zheng et al. 2025, arXiv:2507.18071): ``s_i = exp(mean_t (logp - logp_old))`` over
  sequence i's tokens, sequence term ``-min(s_i A, clip(s_i, 1 - eps_lo, 1 + eps_hi) A)``,
  every token of the sequence carrying it (per-token A: its own A, the sequence's ratio);
* CISPO (MiniMax-M1, arXiv:2506.13585): token term ``-sg(clip(r_t, 1 - eps_lo, 1 + eps_hi)) A
  logp_t``, ``r_t = exp(logp_t - logp_old_t)``;
* plus what :func:`~jaxrl_sym.rl.algorithms.losses.loss_from_terms` adds to either: ``beta`` times
  the k3 KL ``exp(d) - d - 1`` (``d = logp_ref - logp``), minus ``entropy_coef`` times the entropy,
  summed with the aggregation weights (``token_mean``, ``seq_mean``, ``token_sum``; samples not
  kept weigh 0).

The oracle's gradient with respect to the current log-probs is derived by hand and itself checked
against central finite differences in float64 (for CISPO with the importance weights frozen: they
are stop-gradiented). The library sees the batch in a real layout (packed, shared-prompt or
padded, where two sequences of a row are one slot apart), with junk (and ``-inf``) log-probs off
the response slots, and its ``jax.grad`` must vanish there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.algorithms.advantages import token_weights
from jaxrl_sym.rl.algorithms.losses import loss_from_terms, sequence_means
from jaxrl_sym.rl.config import AlgorithmConfig, task_rl_config
from jaxrl_sym.rl.run.cli import add_train_parser, check_configs, train_configs
from jaxrl_sym.systems.layout import packed_layout, padded_layout, shared_prefix_layout

SHAPE = (16, 128)
"""Every layout is padded to these [rows, L] with unmasked slots, so the eager loss meets one
shape in every example and its ops compile once."""
LAYOUTS = {"packed": packed_layout, "shared": shared_prefix_layout, "padded": padded_layout}
MARGIN = 1e-5
"""GSPO's gradient jumps where a sequence ratio crosses a clip bound; examples whose ratio lies
this close to one are skipped, since float32 and float64 may then take different branches."""


# --------------------------------------------------------------------------- the oracle


@dataclass(frozen=True)
class Batch:
    """Per sample: current, generation-time and reference log-probs, entropies, per-token
    advantages; ``kept``: the sample's tokens weigh in the loss (DAPO's dropped groups do not)."""

    lp: list[np.ndarray]
    old: list[np.ndarray]
    ref: list[np.ndarray]
    ent: list[np.ndarray]
    adv: list[np.ndarray]
    kept: np.ndarray


def oracle_weights(cfg: AlgorithmConfig, b: Batch) -> list[float]:
    """Each token's weight in the sum, per sample (from the three aggregations' definitions)."""
    lengths = [len(x) for x in b.lp]
    n_kept = int(b.kept.sum())
    kept_tokens = sum(n for n, k in zip(lengths, b.kept, strict=True) if k)
    if cfg.loss_agg == "token_mean":
        per = [1.0 / max(kept_tokens, 1)] * len(lengths)
    elif cfg.loss_agg == "seq_mean":
        per = [1.0 / (max(n_kept, 1) * n) for n in lengths]
    else:
        per = [1.0 / (max(n_kept, 1) * cfg.max_new_tokens)] * len(lengths)
    return [w if k else 0.0 for w, k in zip(per, b.kept, strict=True)]


def seq_ratio(lp: np.ndarray, old: np.ndarray) -> float:
    """GSPO's length-normalised sequence ratio (pi / pi_old)^(1 / |y|)."""
    return float(np.exp(np.sum(lp - old) / len(lp)))


def oracle_pg(cfg: AlgorithmConfig, lp: np.ndarray, old: np.ndarray, adv: np.ndarray,
              frozen: np.ndarray | None = None) -> np.ndarray:
    """One sample's per-token policy term. ``frozen``: CISPO's log-probs at which its
    (stop-gradient) weights are taken; default this ``lp``."""
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_high
    lp, old, adv = (np.asarray(a, np.float64) for a in (lp, old, adv))  # no float32 rounding
    if cfg.pg_loss == "gspo":
        s = seq_ratio(lp, old)
        return -np.minimum(s * adv, np.clip(s, lo, hi) * adv)
    r = np.exp((lp if frozen is None else frozen) - old)
    return -np.clip(r, lo, hi) * adv * lp


def oracle_loss(cfg: AlgorithmConfig, b: Batch, lp: list[np.ndarray] | None = None,
                frozen: list[np.ndarray] | None = None) -> float:
    """The loss in float64 (``lp`` overrides the batch's current log-probs)."""
    lp = b.lp if lp is None else lp
    total = 0.0
    for i, w in enumerate(oracle_weights(cfg, b)):
        x = np.asarray(lp[i], np.float64)
        pg = oracle_pg(cfg, x, b.old[i], b.adv[i], None if frozen is None else frozen[i])
        d = b.ref[i] - x
        total += w * float(np.sum(pg + cfg.beta * (np.exp(d) - d - 1.0)
                                  - cfg.entropy_coef * b.ent[i]))
    return total


def oracle_grad(cfg: AlgorithmConfig, b: Batch) -> list[np.ndarray]:
    """d loss / d logp, by hand. GSPO: ``d s_i / d logp_t = s_i / |y_i|`` for every token of the
    sequence; a token's term has zero gradient where the clip binds (``clip(s) A < s A``).
    CISPO: ``-clip(r_t) A_t`` (the weight is a constant). KL: ``beta (1 - exp(d_t))``."""
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_high
    out = []
    for i, w in enumerate(oracle_weights(cfg, b)):
        lp, adv = np.asarray(b.lp[i], np.float64), np.asarray(b.adv[i], np.float64)
        if cfg.pg_loss == "gspo":
            s = seq_ratio(lp, b.old[i])
            free = s * adv <= np.clip(s, lo, hi) * adv  # min takes the unclipped branch
            g_pg = np.full(len(lp), -np.sum(np.where(free, adv, 0.0)) * s / len(lp))
        else:
            g_pg = -np.clip(np.exp(lp - b.old[i]), lo, hi) * adv
        g_kl = cfg.beta * (1.0 - np.exp(b.ref[i] - lp))
        out.append(w * (g_pg + g_kl))
    return out


def finite_differences(cfg: AlgorithmConfig, b: Batch, h: float = 1e-6) -> list[np.ndarray]:
    """Central differences of :func:`oracle_loss` in float64, CISPO's weights held at the
    batch's log-probs."""
    frozen = [np.asarray(x, np.float64) for x in b.lp] if cfg.pg_loss == "cispo" else None
    out = []
    for i, x in enumerate(b.lp):
        g = np.zeros(len(x))
        for t in range(len(x)):
            up = [np.asarray(y, np.float64).copy() for y in b.lp]
            down = [y.copy() for y in up]
            up[i][t] += h
            down[i][t] -= h
            g[t] = (oracle_loss(cfg, b, up, frozen) - oracle_loss(cfg, b, down, frozen)) / (2 * h)
        out.append(g)
    return out


# --------------------------------------------------------------------------- random batches


def _clips(pg_loss: str) -> st.SearchStrategy[tuple[float, float | None]]:
    common = [(0.2, None), (0.1, 0.28), (0.2, 0.5)]
    if pg_loss == "gspo":
        # not (0, 0): ratio 1 (on-policy) then sits on both bounds, where the clipped min has no
        # derivative (JAX splits ties, so its gradient is a subgradient, not the oracle's)
        return st.sampled_from([(3e-4, 4e-4), (3e-4, None), *common])
    # CISPO's weight is held constant, so a zero-width range is fine; >= 1: no lower bound
    return st.sampled_from([(1.0, 0.28), (5.0, 2.0), (0.0, 0.0), *common])


@st.composite
def cases(draw: st.DrawFn, pg_loss: str | None = None) -> tuple[AlgorithmConfig, Batch, str]:
    pg_loss = pg_loss or draw(st.sampled_from(["gspo", "cispo"]))
    g, n_groups = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 7), min_size=g * n_groups, max_size=g * n_groups))
    clip_eps, clip_high = draw(_clips(pg_loss))
    cfg = AlgorithmConfig(pg_loss=pg_loss, group_size=g, clip_eps=clip_eps,
                          clip_eps_high=clip_high,
                          max_new_tokens=max(lengths) + draw(st.integers(0, 3)),
                          loss_agg=draw(st.sampled_from(["token_mean", "seq_mean",
                                                         "token_sum"])),
                          beta=draw(st.sampled_from([0.0, 0.0, 0.1])),
                          entropy_coef=draw(st.sampled_from([0.0, 0.01])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # log-ratio scale: on-policy (ratio 1), GSPO-sized, inside PPO's range, mostly outside
    drift = draw(st.sampled_from([0.0, 2e-4, 0.05, 0.3, 1.0]))
    per_token_adv = draw(st.booleans())  # PPO's GAE advantages vary along the sequence
    lp, old, ref, ent, adv = [], [], [], [], []
    for n in lengths:
        x = rng.uniform(-6.0, -0.01, n).astype(np.float32)
        lp.append(x)
        old.append((x - rng.normal(0.0, drift, n)).astype(np.float32))
        ref.append((x + rng.normal(0.0, 0.3, n)).astype(np.float32))
        ent.append(rng.uniform(0.0, 2.0, n).astype(np.float32))
        a = rng.choice([0.0, -1.0, 1.0, float(rng.normal(0.0, 1.5))])  # incl. zero, negative
        adv.append((rng.normal(0.0, 1.0, n) if per_token_adv else np.full(n, a))
                   .astype(np.float32))
    kept = rng.random(len(lengths)) < 0.8
    return cfg, Batch(lp, old, ref, ent, adv, kept), draw(st.sampled_from(sorted(LAYOUTS)))


def _away_from_gspo_kinks(cfg: AlgorithmConfig, b: Batch) -> bool:
    if cfg.pg_loss != "gspo":
        return True  # CISPO's clipped weight is continuous in the ratio
    bounds = np.array([1.0 - cfg.clip_eps, 1.0 + cfg.clip_high])
    ratios = [seq_ratio(x.astype(np.float64), o) for x, o in zip(b.lp, b.old, strict=True)]
    return all(np.abs(s - bounds).min() > MARGIN or s == 1.0 for s in ratios)


# --------------------------------------------------------------------------- the library


def library_inputs(cfg: AlgorithmConfig, b: Batch, layout_name: str
                   ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array],
                              list[tuple[int, int, int]]]:
    """(log-probs per slot, the other terms, loss arrays, spans) in the layout, padded to SHAPE:
    junk log-probs off the response slots (large, and -inf: a slot the model rules out)."""
    prompts = [np.arange(1, 2 + i // cfg.group_size % 3, dtype=np.int32)
               for i in range(len(b.lp))]  # each group one prompt, so shared rows share it
    lay = LAYOUTS[layout_name](prompts, [np.ones(len(x), np.int32) for x in b.lp])
    rows, width = lay.shape
    assert rows <= SHAPE[0] and width <= SHAPE[1], lay.shape

    def pad(a: np.ndarray, fill: float = 0.0) -> np.ndarray:
        return np.pad(a, ((0, SHAPE[0] - rows), (0, SHAPE[1] - width)), constant_values=fill)

    mask = pad(lay.mask(), False)
    junk = np.random.default_rng(1).normal(-40.0, 30.0, SHAPE).astype(np.float32)
    junk[::3, ::7] = -np.inf
    lp = np.where(mask, pad(lay.scatter(b.lp)), junk)
    lengths = [len(x) for x in b.lp]
    weight = lay.scatter(token_weights(lengths, cfg.loss_agg, cfg.max_new_tokens, b.kept))
    arrays = {"targets": np.zeros(SHAPE, np.int32), "mask": mask, "weight": pad(weight),
              "old_lp": pad(lay.scatter(b.old)), "ref_lp": pad(lay.scatter(b.ref)),
              "adv": pad(lay.scatter(b.adv))}
    terms = {"ent": jnp.asarray(np.where(mask, pad(lay.scatter(b.ent)), 7.0))}
    return (jnp.asarray(lp), terms, {k: jnp.asarray(v) for k, v in arrays.items()},
            list(lay.spans))


def library_loss(cfg: AlgorithmConfig, lp: jax.Array, terms: dict[str, jax.Array],
                 arrays: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    return loss_from_terms({"lp": lp, **terms}, arrays, cfg)


def library_grad(cfg: AlgorithmConfig, lp: jax.Array, terms: dict[str, jax.Array],
                 arrays: dict[str, jax.Array]) -> np.ndarray:
    return np.asarray(jax.grad(lambda x: library_loss(cfg, x, terms, arrays)[0])(lp))


def _msg(cfg: AlgorithmConfig, b: Batch, layout: str) -> str:
    return (f"layout={layout} pg_loss={cfg.pg_loss} clip=({cfg.clip_eps}, {cfg.clip_high}) "
            f"agg={cfg.loss_agg} beta={cfg.beta} lengths={[len(x) for x in b.lp]} "
            f"kept={b.kept.tolist()}")


# --------------------------------------------------------------------------- tests


@settings(max_examples=40, deadline=None)
@given(cases())
def test_loss_and_gradient_equal_the_numpy_oracle(case: tuple[AlgorithmConfig, Batch, str]
                                                  ) -> None:
    cfg, b, layout = case
    assume(_away_from_gspo_kinks(cfg, b))
    lp, terms, arrays, spans = library_inputs(cfg, b, layout)
    msg = _msg(cfg, b, layout)
    loss, aux = library_loss(cfg, lp, terms, arrays)
    np.testing.assert_allclose(float(loss), oracle_loss(cfg, b), rtol=2e-5, atol=2e-5,
                               err_msg=msg)
    assert np.isfinite(float(aux["pg_loss"])), msg
    grad = library_grad(cfg, lp, terms, arrays)
    want = oracle_grad(cfg, b)
    scale = max(1e-3, max(float(np.abs(g).max()) for g in want))
    on_span = np.zeros(SHAPE, bool)
    for (r, s, n), g in zip(spans, want, strict=True):
        on_span[r, s:s + n] = True
        np.testing.assert_allclose(grad[r, s:s + n], g, rtol=0, atol=2e-5 * scale, err_msg=msg)
    assert np.all(grad[~on_span] == 0.0), f"gradient leaks off the response slots: {msg}"


@settings(max_examples=15, deadline=None)
@given(cases())
def test_the_hand_derived_gradient_is_the_oracles_derivative(
        case: tuple[AlgorithmConfig, Batch, str]) -> None:
    """The oracle's gradient (what the library is held to) against central differences."""
    cfg, b, _ = case
    assume(_away_from_gspo_kinks(cfg, b))
    for g, fd in zip(oracle_grad(cfg, b), finite_differences(cfg, b), strict=True):
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(cases(pg_loss="cispo"))
def test_cispo_keeps_the_gradient_of_tokens_outside_the_clip_range(
        case: tuple[AlgorithmConfig, Batch, str]) -> None:
    """What distinguishes CISPO from PPO/GRPO: a token whose ratio left the clip range in A's
    direction keeps a gradient (``-clip(r) A``, weight at the bound); ppo_clip's is zero."""
    cfg, b, layout = case
    lp, terms, arrays, spans = library_inputs(cfg, b, layout)
    cfg0 = replace(cfg, beta=0.0, entropy_coef=0.0)
    ppo = replace(cfg0, pg_loss="ppo_clip", clip_eps=min(cfg.clip_eps, 0.9))
    cispo_g = library_grad(cfg0, lp, terms, arrays)
    ppo_g = library_grad(ppo, lp, terms, arrays)
    weights = oracle_weights(cfg0, b)
    for (r, s, n), x, o, a, w in zip(spans, b.lp, b.old, b.adv, weights, strict=True):
        ratio = np.exp(x.astype(np.float64) - o)
        binds = (((ratio > 1 + cfg.clip_high + MARGIN) & (a > 0))
                 | ((ratio < 1 - ppo.clip_eps - MARGIN) & (a < 0)))
        bound = np.where(ratio > 1, 1 + cfg.clip_high, np.maximum(1 - cfg.clip_eps, ratio))
        want = np.where(binds, -w * bound * a, 0.0)
        np.testing.assert_allclose(np.where(binds, cispo_g[r, s:s + n], 0.0), want,
                                   rtol=1e-5, atol=1e-7)
        if w > 0:
            assert np.all(cispo_g[r, s:s + n][binds & (a != 0)] != 0.0)
        assert np.all(ppo_g[r, s:s + n][binds] == 0.0)


@settings(max_examples=25, deadline=None)
@given(cases(pg_loss="gspo"))
def test_gspo_takes_one_clipping_decision_per_sequence(case: tuple[AlgorithmConfig, Batch, str]
                                                       ) -> None:
    """One ratio per sequence: with a sequence-constant A (GRPO), every token of a sequence gets
    the same gradient — all zero where the sequence ratio is clipped, all ``-w s A`` where not
    (its |y| terms each give ``-w A s / |y|``) — and ``clip_frac`` counts whole sequences'
    tokens."""
    cfg, b, layout = case
    assume(_away_from_gspo_kinks(cfg, b))
    b = Batch(b.lp, b.old, b.ref, b.ent, [np.full(len(a), a[0]) for a in b.adv], b.kept)
    cfg0 = replace(cfg, beta=0.0)
    lp, terms, arrays, spans = library_inputs(cfg0, b, layout)
    grad = library_grad(cfg0, lp, terms, arrays)
    _, aux = library_loss(cfg0, lp, terms, arrays)
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_high
    clipped_tokens = 0
    for (r, s, n), x, o, a, w in zip(spans, b.lp, b.old, b.adv, oracle_weights(cfg0, b),
                                     strict=True):
        ratio = seq_ratio(x.astype(np.float64), o)
        g = grad[r, s:s + n]
        np.testing.assert_allclose(g, np.full(n, g[0]), rtol=1e-6, atol=1e-9)
        clipped = (ratio > hi and a[0] > 0) or (ratio < lo and a[0] < 0)
        clipped_tokens += n * clipped
        want = 0.0 if clipped else -w * ratio * float(a[0])  # n terms x ds/dlogp = s / n
        np.testing.assert_allclose(g[0], want, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(aux["clip_frac"]), clipped_tokens / sum(map(len, b.lp)),
                               atol=1e-6)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sequence_means_are_the_spans_means(layout: str) -> None:
    """The runs of the mask are the layout's spans, even where a shared prompt leaves one slot
    between two responses."""
    rng = np.random.default_rng(3)
    lengths = [1, 5, 2, 7, 1, 1, 3, 4]
    prompts = [np.array([1, 2, 3], np.int32)] * 4 + [np.array([4, 5], np.int32)] * 4
    lay = LAYOUTS[layout](prompts, [np.ones(n, np.int32) for n in lengths])
    vals = [rng.normal(size=n) for n in lengths]
    x = np.where(lay.mask(), lay.scatter(vals), 1e6)
    got = np.asarray(sequence_means(jnp.asarray(x), jnp.asarray(lay.mask())))
    for (r, s, n), v in zip(lay.spans, vals, strict=True):
        np.testing.assert_allclose(got[r, s:s + n], np.full(n, v.mean()), rtol=1e-6, atol=1e-6)
    assert np.all(got[~lay.mask()] == 0.0)


def test_the_oracles_are_not_vacuous() -> None:
    """Hand-checked numbers on one sample (token_mean / seq_mean weights 1/2 per token)."""
    one = lambda *v: np.array(v, np.float32)
    # GSPO: log-ratios ln 2 and 0 -> s = sqrt 2, outside [0.8, 1.2]
    b = Batch([one(-1.0, -2.0)], [one(-1.0 - np.log(2.0), -2.0)], [one(0, 0)], [one(0, 0)],
              [one(1.0, 1.0)], np.array([True]))
    gspo = AlgorithmConfig(pg_loss="gspo", max_new_tokens=2, loss_agg="seq_mean")
    assert np.isclose(oracle_loss(gspo, b), -1.2)  # A > 0: clipped at 1.2, no gradient
    assert np.allclose(oracle_grad(gspo, b)[0], 0.0)
    neg = Batch(b.lp, b.old, b.ref, b.ent, [-a for a in b.adv], b.kept)
    assert np.isclose(oracle_loss(gspo, neg), np.sqrt(2.0))  # A < 0: min keeps s A
    # d/d logp_t: two tokens' terms x weight 1/2 x -A x ds/dlogp_t (= s / 2)
    assert np.allclose(oracle_grad(gspo, neg)[0], np.sqrt(2.0) / 2)
    lp, terms, arrays, _ = library_inputs(gspo, neg, "packed")
    assert np.isclose(float(library_loss(gspo, lp, terms, arrays)[0]), np.sqrt(2.0), atol=1e-6)
    # CISPO: ratio 2 on the first token (weight clipped to 1.2), 1 on the second; A = 1:
    # (-1.2 * -1 + -1 * -2) / 2 = 1.6; gradient -clip(r) A / 2 per token, nonzero on the first
    cispo = AlgorithmConfig(pg_loss="cispo", max_new_tokens=2, loss_agg="token_mean")
    b2 = Batch(b.lp, [one(-1.0 - np.log(2.0), -2.0)], b.ref, b.ent, b.adv, b.kept)
    assert np.isclose(oracle_loss(cispo, b2), 1.6)
    assert np.allclose(oracle_grad(cispo, b2)[0], [-0.6, -0.5])
    lp, terms, arrays, spans = library_inputs(cispo, b2, "shared")
    assert np.isclose(float(library_loss(cispo, lp, terms, arrays)[0]), 1.6, atol=1e-6)
    (r, s, n), = spans
    assert np.allclose(library_grad(cispo, lp, terms, arrays)[r, s:s + n], [-0.6, -0.5])


def _train_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["train", *flags])


def test_the_cli_and_config_select_the_losses() -> None:
    args = _train_args("--pg-loss", "gspo", "--clip-low", "3e-4", "--clip-high", "4e-4")
    run, rl, _ = train_configs(args)
    cfg = task_rl_config(run.steps, 8, None, rl).algorithm
    assert (cfg.pg_loss, cfg.clip_eps, cfg.clip_high) == ("gspo", 3e-4, 4e-4)
    assert check_configs(_train_args("--pg-loss", "cispo", "--clip-low", "1")) == []
    assert AlgorithmConfig().pg_loss == "ppo_clip"
    # only CISPO may drop the lower bound; the new losses refuse TIS; unknown names are refused
    for bad in (("--pg-loss", "gspo", "--clip-low", "1"), ("--clip-low", "1"),
                ("--pg-loss", "cispo", "--tis-cap", "2")):
        assert check_configs(_train_args(*bad)), bad
    with pytest.raises(InputError, match="pg_loss"):
        AlgorithmConfig(pg_loss="gspo-token")
