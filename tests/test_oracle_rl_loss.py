"""The RL loss against a numpy oracle written from the algorithms' definitions.

Everything else checks the loss sym-vs-padded, and both systems call the same
:func:`~jaxrl_sym.rl.algorithms.losses.rl_loss`; here the library's public path — a layout
(packed, shared-prompt or padded), :func:`~jaxrl_sym.rl.step.stages.loss_arrays` (advantages,
weights, scattering) and :func:`~jaxrl_sym.rl.algorithms.losses.rl_loss` — is compared with a
float64 numpy computation that imports nothing from the library's math:

* advantages: GRPO ``(r - mean_g) / (std_g + eps)`` (population std; ``batch_std``: one std of
  ``r - mean_g`` over the batch; ``none``: Dr. GRPO's ``r - mean_g``), 0 for a group whose
  rewards are all equal; RLOO ``r_i - mean_{j != i} r_j``; PPO: the outcome reward on the last
  token, GAE written as the closed sum ``A_t = sum_l (gamma lam)^l delta_{t+l}`` (no value after
  the last token), returns ``A + V``, then advantages whitened over the batch's tokens;
* per token: PPO's clipped surrogate ``-min(rho A, clip(rho, 1 - eps_lo, 1 + eps_hi) A)`` with
  ``rho = exp(logp - logp_old)``, the k3 KL estimate ``exp(d) - d - 1``, ``d = logp_ref - logp``
  (the estimator the library documents), an entropy bonus of softmax(logits / T);
* aggregation: ``token_mean`` (every kept token equal), ``seq_mean`` (mean per sequence, then
  over sequences), ``token_sum`` (sum / (sequences x max_new_tokens)); groups with equal rewards
  dropped under ``drop_zero_var`` (GRPO/RLOO);
* PPO's value loss ``0.5 max((v - R)^2, (v_clip - R)^2)``, ``v`` a linear read-out of the logits.

The gradient of the library's loss w.r.t. every logit (and the value head) is compared with
central finite differences of the oracle, and must be exactly zero off the response slots,
where the logits are filled with large junk.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.rl.algorithms.losses import rl_loss
from jaxrl_sym.rl.knobs import AlgorithmConfig
from jaxrl_sym.rl.step.rollout import Rollout
from jaxrl_sym.rl.step.stages import loss_arrays
from jaxrl_sym.systems.layout import packed_layout, padded_layout, shared_prefix_layout

VOCAB = 5
SHAPE = (16, 128)
"""Every layout is padded to these [rows, L] with masked slots (as a padded layout's are), so the
eagerly run loss meets the same shapes in every example and its ops compile once."""
LAYOUTS = {"packed": packed_layout, "shared": shared_prefix_layout, "padded": padded_layout}


# --------------------------------------------------------------------------- the oracle


@dataclass(frozen=True)
class Batch:
    """One ragged batch, per sample (group after group): the logits that predict each response
    token, the response tokens, generation-time and reference log-probs, the reward, and (PPO)
    the critic's values at generation time."""

    prompts: list[np.ndarray]
    logits: list[np.ndarray]  # [n_i, V]
    tokens: list[np.ndarray]  # [n_i]
    old_lp: list[np.ndarray]
    ref_lp: list[np.ndarray]
    rewards: np.ndarray
    old_v: list[np.ndarray]
    head_w: np.ndarray  # [V] value head
    head_b: float


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def oracle_sample_advantages(cfg: AlgorithmConfig, rewards: np.ndarray) -> np.ndarray:
    """GRPO / RLOO: one advantage per sample."""
    g = cfg.group_size
    groups = [np.asarray(rewards[i:i + g], np.float64) for i in range(0, len(rewards), g)]
    out: list[float] = []
    if cfg.algo == "rloo":
        for r in groups:
            out += [r[i] - (r.sum() - r[i]) / (g - 1) for i in range(g)]
        return np.array(out)
    centred = [r - r.mean() for r in groups]
    batch_sd = float(np.sqrt(np.mean(np.concatenate(centred) ** 2)))  # its mean is 0
    for r, c in zip(groups, centred, strict=True):
        if r.max() == r.min():
            out += [0.0] * g
        elif cfg.adv_norm == "group_std":
            out += list(c / (np.sqrt(np.mean(c ** 2)) + cfg.adv_eps))
        elif cfg.adv_norm == "batch_std":
            out += list(c / (batch_sd + cfg.adv_eps))
        else:
            out += list(c)
    return np.array(out)


def oracle_gae(cfg: AlgorithmConfig, b: Batch) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """PPO: per-token (advantages, returns); advantages whitened unless adv_norm is none."""
    advs, rets = [], []
    for reward, v in zip(b.rewards, b.old_v, strict=True):
        v = np.asarray(v, np.float64)
        n = len(v)
        r = np.zeros(n)
        r[-1] = reward
        v_next = np.append(v[1:], 0.0)
        delta = r + cfg.gamma * v_next - v
        a = np.array([sum((cfg.gamma * cfg.lam) ** k * delta[t + k] for k in range(n - t))
                      for t in range(n)])
        advs.append(a)
        rets.append(a + v)
    if cfg.adv_norm != "none":
        flat = np.concatenate(advs)
        advs = [(a - flat.mean()) / (flat.std() + 1e-8) for a in advs]
    return advs, rets


def oracle_kept(cfg: AlgorithmConfig, rewards: np.ndarray) -> np.ndarray:
    g = cfg.group_size
    if not cfg.drop_zero_var or cfg.algo == "ppo":
        return np.ones(len(rewards), bool)
    return np.array([rewards[i - i % g:i - i % g + g].max() > rewards[i - i % g:i - i % g + g].min()
                     for i in range(len(rewards))])


def oracle_weights(cfg: AlgorithmConfig, lengths: list[int], kept: np.ndarray) -> list[float]:
    """The weight of each token of sample i in the loss's sum."""
    n_kept = int(kept.sum())
    kept_tokens = sum(n for n, k in zip(lengths, kept, strict=True) if k)
    out = []
    for n, k in zip(lengths, kept, strict=True):
        if not k:
            out.append(0.0)
        elif cfg.loss_agg == "token_mean":
            out.append(1.0 / kept_tokens)
        elif cfg.loss_agg == "seq_mean":
            out.append(1.0 / (n_kept * n))
        else:
            out.append(1.0 / (n_kept * cfg.max_new_tokens))
    return out


@dataclass(frozen=True)
class Targets:
    """What the loss holds fixed while the logits move: per-token advantages, returns (PPO) and
    per-sample weights."""

    adv: list[np.ndarray]
    ret: list[np.ndarray]
    weight: list[float]


def oracle_targets(cfg: AlgorithmConfig, b: Batch) -> Targets:
    lengths = [len(t) for t in b.tokens]
    if cfg.algo == "ppo":
        advs, rets = oracle_gae(cfg, b)
    else:
        sample_adv = oracle_sample_advantages(cfg, b.rewards)
        advs = [np.full(n, a) for n, a in zip(lengths, sample_adv, strict=True)]
        rets = [np.zeros(n) for n in lengths]
    return Targets(advs, rets, oracle_weights(cfg, lengths, oracle_kept(cfg, b.rewards)))


def oracle_lp(cfg: AlgorithmConfig, b: Batch, i: int, logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64) / cfg.temperature
    return _log_softmax(x)[np.arange(len(x)), b.tokens[i]]


def oracle_token_terms(cfg: AlgorithmConfig, b: Batch, tg: Targets, i: int, logits: np.ndarray,
                       head_w: np.ndarray, head_b: float, frozen_lp: np.ndarray | None = None
                       ) -> dict[str, np.ndarray]:
    """Sample i's per-token terms; ``loss`` is each token's weighted share of the loss (each
    token's share depends on its own logits row only).

    With ``tis_cap`` (truncated importance sampling, epochs == 1): the trainer's log-probs at the
    step's start ``lp0`` are the proximal policy, held fixed (``frozen_lp``: their value at the
    point a derivative is taken; default: this ``lp``); the term is
    ``-min(exp(lp0 - old), C) * exp(lp - lp0) * A``."""
    x = np.asarray(logits, np.float64) / cfg.temperature
    logp_all = _log_softmax(x)
    lp = logp_all[np.arange(len(x)), b.tokens[i]]
    ratio = np.exp(lp - b.old_lp[i])
    a = tg.adv[i]
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_high
    tis = np.ones(len(x))
    if cfg.tis_cap is None:
        pg = -np.minimum(ratio * a, np.clip(ratio, lo, hi) * a)
    else:
        lp0 = lp if frozen_lp is None else frozen_lp
        tis = np.minimum(np.exp(lp0 - b.old_lp[i]), cfg.tis_cap)
        pg = -tis * np.exp(lp - lp0) * a
    d = b.ref_lp[i] - lp
    kl = np.exp(d) - d - 1.0
    ent = -(np.exp(logp_all) * logp_all).sum(axis=-1)
    vl = np.zeros(len(x))
    if cfg.algo == "ppo":
        v = np.asarray(logits, np.float64) @ head_w + head_b
        old_v = np.asarray(b.old_v[i], np.float64)
        v_clip = old_v + np.clip(v - old_v, -cfg.vf_clip, cfg.vf_clip)
        vl = 0.5 * np.maximum((v - tg.ret[i]) ** 2, (v_clip - tg.ret[i]) ** 2)
    w = tg.weight[i]
    loss = w * (pg + cfg.beta * kl - cfg.entropy_coef * ent + cfg.vf_coef * vl)
    return {"loss": loss, "pg": w * pg, "vl": w * vl, "kl": kl, "entropy": ent, "ratio": ratio,
            "low": (ratio < lo) & (a < 0), "high": (ratio > hi) & (a > 0), "tis": tis,
            "mismatch": np.abs(lp - b.old_lp[i]), "outside": (ratio < 0.8) | (ratio > 1.25)}


def oracle_loss(cfg: AlgorithmConfig, b: Batch, head_w: np.ndarray | None = None,
                head_b: float | None = None) -> tuple[float, dict[str, float]]:
    """The loss and its diagnostics in float64 (``head_*`` override the batch's value head)."""
    head_w = b.head_w if head_w is None else head_w
    head_b = b.head_b if head_b is None else head_b
    tg = oracle_targets(cfg, b)
    terms = [oracle_token_terms(cfg, b, tg, i, x, head_w, head_b) for i, x in enumerate(b.logits)]
    cat = {k: np.concatenate([t[k] for t in terms]).astype(np.float64) for k in terms[0]}
    aux = {"pg_loss": cat["pg"].sum(), "n_tok": float(len(cat["loss"])), "kl": cat["kl"].mean(),
           "entropy": cat["entropy"].mean(), "ratio_mean": cat["ratio"].mean(),
           "clip_low_frac": cat["low"].mean(), "clip_high_frac": cat["high"].mean(),
           "clip_frac": cat["low"].mean() + cat["high"].mean(),
           "lp_mismatch_mean": cat["mismatch"].mean(), "lp_mismatch_max": cat["mismatch"].max(),
           "ratio_outside": cat["outside"].mean()}
    if cfg.tis_cap is not None:
        aux["tis_weight_mean"] = cat["tis"].mean()
    if cfg.algo == "ppo":
        aux["v_loss"] = cat["vl"].sum()
    return float(cat["loss"].sum()), aux


# --------------------------------------------------------------------------- random batches


@st.composite
def cases(draw: st.DrawFn) -> tuple[AlgorithmConfig, Batch, str]:
    algo = draw(st.sampled_from(["grpo", "rloo", "ppo"]))
    g = draw(st.integers(1 if algo == "ppo" else 2, 4))
    n_groups = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 6), min_size=g * n_groups, max_size=g * n_groups))
    # ties (0/1 rewards: zero-variance groups) and spread values; rounded so that no advantage
    # is a float64 speck that float32 flushes to zero (its sign would decide the clip counts)
    reward = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-2, 2).map(lambda r: round(r, 3)))
    rewards = np.array(draw(st.lists(reward, min_size=g * n_groups, max_size=g * n_groups)))
    cfg = AlgorithmConfig(
        algo=algo, group_size=g,
        max_new_tokens=max(lengths) + draw(st.integers(0, 3)),
        temperature=draw(st.sampled_from([1.0, 0.7, 1.3])),
        clip_eps=draw(st.sampled_from([0.1, 0.2, 0.3])),
        clip_eps_high=draw(st.sampled_from([None, 0.28, 0.5])),
        beta=draw(st.sampled_from([0.0, 0.04, 0.5])),
        loss_agg=draw(st.sampled_from(["token_mean", "seq_mean", "token_sum"])),
        adv_norm=draw(st.sampled_from(["group_std", "batch_std", "none"])),
        drop_zero_var=draw(st.booleans()),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, 0.2])),
        gamma=draw(st.sampled_from([1.0, 0.9])), lam=draw(st.sampled_from([0.95, 1.0, 0.5])),
        vf_coef=draw(st.sampled_from([0.5, 1.0])), vf_clip=draw(st.sampled_from([0.2, 1.0])),
        tis_cap=draw(st.sampled_from([None, None, 1.0, 2.0])),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    drift = draw(st.sampled_from([0.0, 0.1, 0.6]))  # old policy = current (epoch 1) or not
    prompts = [rng.integers(0, VOCAB, rng.integers(1, 5)).astype(np.int32)
               for _ in range(n_groups)]
    logits, tokens, old_lp, ref_lp, old_v = [], [], [], [], []
    for n in lengths:
        x = rng.normal(0.0, 2.0, (n, VOCAB))
        t = rng.integers(0, VOCAB, n).astype(np.int32)
        lp = _log_softmax(x / cfg.temperature)[np.arange(n), t]
        logits.append(x.astype(np.float32))
        tokens.append(t)
        old_lp.append((lp + rng.normal(0.0, drift, n)).astype(np.float32))
        ref_lp.append((lp + rng.normal(0.0, 0.5, n)).astype(np.float32))
        old_v.append(rng.normal(0.0, 1.0, n).astype(np.float32))
    batch = Batch([p for p in prompts for _ in range(g)], logits, tokens, old_lp, ref_lp,
                  rewards, old_v, rng.normal(0.0, 0.3, VOCAB).astype(np.float32),
                  float(rng.normal()))
    return cfg, batch, draw(st.sampled_from(sorted(LAYOUTS)))


# --------------------------------------------------------------------------- the library


def library_inputs(cfg: AlgorithmConfig, b: Batch, layout_name: str
                   ) -> tuple[jax.Array, dict, dict | None, list[tuple[int, int, int]], dict]:
    """The library's loss inputs for the batch: logits of the layout's shape (the batch's logits
    on the response-predicting slots, large junk elsewhere), loss_arrays, the value head."""
    layout = LAYOUTS[layout_name](b.prompts, b.tokens)
    rows, width = layout.shape
    assert rows <= SHAPE[0] and width <= SHAPE[1], layout.shape
    logits = np.random.default_rng(0).normal(0.0, 50.0, (*SHAPE, VOCAB)).astype(np.float32)
    for (r, s, n), x, t in zip(layout.spans, b.logits, b.tokens, strict=True):
        assert n == len(t) and np.array_equal(layout.targets[r, s:s + n], t)
        logits[r, s:s + n] = x
    rollout = Rollout(b.prompts, list(b.tokens), list(b.old_lp), cfg.group_size)
    arrays, info = loss_arrays(cfg, layout, rollout, b.rewards, layout.scatter(b.ref_lp),
                               layout.scatter(b.old_v) if cfg.algo == "ppo" else None)
    head = ({"w": jnp.asarray(b.head_w), "b": jnp.asarray(b.head_b, jnp.float32)}
            if cfg.algo == "ppo" else None)
    arrays = {k: jnp.asarray(np.pad(v, ((0, SHAPE[0] - rows), (0, SHAPE[1] - width))))
              for k, v in arrays.items()}
    return jnp.asarray(logits), arrays, head, list(layout.spans), info


def _case_str(cfg: AlgorithmConfig, b: Batch, layout: str) -> str:
    return (f"layout={layout} cfg={cfg} lengths={[len(t) for t in b.tokens]} "
            f"rewards={b.rewards.tolist()}")


@settings(max_examples=60, deadline=None)
@given(cases())
def test_loss_and_diagnostics_equal_the_numpy_oracle(case: tuple[AlgorithmConfig, Batch, str]
                                                     ) -> None:
    cfg, b, layout = case
    logits, arrays, head, _, info = library_inputs(cfg, b, layout)
    loss, aux = rl_loss(logits, arrays, head, cfg)
    want, want_aux = oracle_loss(cfg, b)
    msg = _case_str(cfg, b, layout)
    if cfg.algo != "ppo":
        np.testing.assert_allclose(info["sample_adv"], oracle_sample_advantages(cfg, b.rewards),
                                   rtol=1e-5, atol=1e-6, err_msg=msg)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=2e-5, err_msg=msg)
    for key, val in want_aux.items():
        np.testing.assert_allclose(float(aux[key]), val, rtol=2e-5, atol=2e-5,
                                   err_msg=f"{key}: {msg}")


def _finite_differences(cfg: AlgorithmConfig, b: Batch, h: float = 1e-5
                        ) -> tuple[list[np.ndarray], np.ndarray, float]:
    """d oracle loss / d (logits, head w, head b), central differences in float64. A token's
    share of the loss reads only its own logits row, so moving logit v of every row at once
    gives each row's derivative from that row's share."""
    tg = oracle_targets(cfg, b)
    w0 = np.asarray(b.head_w, np.float64)
    grads = []
    for i, x in enumerate(b.logits):
        x = np.asarray(x, np.float64)
        g = np.zeros_like(x)
        for v in range(x.shape[1]):
            e = h * np.eye(x.shape[1])[v]
            lp0 = oracle_lp(cfg, b, i, x)  # TIS's proximal log-probs, fixed at this point
            share = lambda y, i=i, lp0=lp0: oracle_token_terms(cfg, b, tg, i, y, w0, b.head_b,
                                                               lp0)["loss"]
            g[:, v] = (share(x + e) - share(x - e)) / (2 * h)
        grads.append(g)
    f = lambda w=w0, bias=b.head_b: oracle_loss(cfg, b, w, bias)[0]
    gw = np.array([(f(w=w0 + h * e) - f(w=w0 - h * e)) / (2 * h) for e in np.eye(len(w0))])
    gb = (f(bias=b.head_b + h) - f(bias=b.head_b - h)) / (2 * h)
    return grads, gw, gb


@settings(max_examples=25, deadline=None)
@given(cases())
def test_gradient_equals_finite_differences_of_the_oracle(
        case: tuple[AlgorithmConfig, Batch, str]) -> None:
    cfg, b, layout = case
    logits, arrays, head, spans, _ = library_inputs(cfg, b, layout)
    (g_logits, g_head) = jax.grad(lambda x, hd: rl_loss(x, arrays, hd, cfg)[0],
                                  argnums=(0, 1))(logits, head)
    g_logits = np.asarray(g_logits)
    want, want_w, want_b = _finite_differences(cfg, b)
    msg = _case_str(cfg, b, layout)
    on_span = np.zeros(g_logits.shape[:2], bool)
    scale = max(1e-3, max(float(np.abs(g).max()) for g in want))
    for (r, s, n), g in zip(spans, want, strict=True):
        on_span[r, s:s + n] = True
        np.testing.assert_allclose(g_logits[r, s:s + n], g, rtol=0, atol=1e-4 * scale,
                                   err_msg=msg)
    assert not np.any(g_logits[~on_span]), f"gradient leaks off the response slots: {msg}"
    if cfg.algo == "ppo":
        np.testing.assert_allclose(np.asarray(g_head["w"]), want_w, rtol=1e-4, atol=1e-5,
                                   err_msg=msg)
        np.testing.assert_allclose(float(g_head["b"]), want_b, rtol=1e-4, atol=1e-5, err_msg=msg)


def test_the_oracle_is_not_vacuous() -> None:
    """Hand-checked numbers: one GRPO group of two one-token samples, ratio 1 (epoch 1)."""
    x = np.zeros((1, VOCAB), np.float32)  # uniform: lp = -log V for either token
    lp = np.full(1, -np.log(VOCAB), np.float32)
    cfg = AlgorithmConfig(algo="grpo", group_size=2, max_new_tokens=1, adv_eps=0.0)
    b = Batch([np.array([1], np.int32)] * 2, [x, x], [np.array([0]), np.array([1])], [lp, lp],
              [lp, lp], np.array([1.0, 0.0]), [lp, lp], np.zeros(VOCAB, np.float32), 0.0)
    # advantages +1 and -1 (std 0.5), ratio 1: pg = -A, token_mean: (-1 + 1) / 2 = 0
    assert oracle_loss(cfg, b)[0] == 0.0
    assert list(oracle_sample_advantages(cfg, b.rewards)) == [1.0, -1.0]
    logits, arrays, head, _, _ = library_inputs(cfg, b, "packed")
    assert abs(float(rl_loss(logits, arrays, head, cfg)[0])) < 1e-7
    # beta = 1 with ref = lp + log 2 on both: kl = 2 - log 2 - 1 per token
    ref = [lp + np.log(2.0).astype(np.float32)] * 2
    b2 = Batch(b.prompts, b.logits, b.tokens, b.old_lp, ref, b.rewards, b.old_v, b.head_w, 0.0)
    cfg2 = AlgorithmConfig(algo="grpo", group_size=2, max_new_tokens=1, beta=1.0)
    assert np.isclose(oracle_loss(cfg2, b2)[0], 1.0 - np.log(2.0))
    logits, arrays, head, _, _ = library_inputs(cfg2, b2, "padded")
    assert np.isclose(float(rl_loss(logits, arrays, head, cfg2)[0]), 1.0 - np.log(2.0),
                      atol=1e-6)
    # TIS, hand-checked: the generation gave the first sample's token log-prob lp - log 4 (the
    # trainer's is 4x as likely), capped at 2: its term is -2 * 1 * A = -2, the second's
    # (old = lp, weight 1) is -(-1) = 1; token_mean: (-2 + 1) / 2 = -0.5; mismatch |log 4| max
    old = [lp - np.log(4.0).astype(np.float32), lp]
    b3 = Batch(b.prompts, b.logits, b.tokens, old, b.ref_lp, b.rewards, b.old_v, b.head_w, 0.0)
    cfg3 = AlgorithmConfig(algo="grpo", group_size=2, max_new_tokens=1, adv_eps=0.0, tis_cap=2.0)
    loss3, aux3 = oracle_loss(cfg3, b3)
    assert np.isclose(loss3, -0.5) and np.isclose(aux3["lp_mismatch_max"], np.log(4.0))
    logits, arrays, head, _, _ = library_inputs(cfg3, b3, "packed")
    got, got_aux = rl_loss(logits, arrays, head, cfg3)
    assert np.isclose(float(got), -0.5, atol=1e-6)
    assert np.isclose(float(got_aux["ratio_outside"]), 0.5)  # ratio 4 is outside [0.8, 1.25]
