"""The one jaxpr interpreter (:mod:`jaxrl_sym.tracer.interpret`), and that it is the only one.

Oracles: ``jax.core.eval_jaxpr`` on hypothesis-drawn programs (shapes, constants, literals,
calls, loops, conditionals, custom derivatives) for the interpreter without rules, and
``jax.grad`` of the program itself for runs evaluated under ``jax.checkpoint``. Then, from the
source (``ast``, nothing imported): no other module of ``jaxrl_sym/`` walks a jaxpr's equations
to evaluate them — the tracer's unrolling, LoRA's rewrite and remat's segments are rules and runs
of this one interpreter (issue 49 item 3).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from jaxrl_sym.tracer.interpret import Interpreter, NotHandled

PKG = Path(__file__).resolve().parents[1] / "jaxrl_sym"
INTERPRETER = "tracer/interpret.py"


def _ops(n: int, seed: int) -> list:
    """Shape-preserving steps on ``[m, n]``, each emitting a different kind of equation."""
    w = jnp.asarray(np.random.default_rng(seed).normal(size=(n, n)), jnp.float32)
    return [
        jnp.sin,
        lambda x: x @ w,  # dot_general on a constant
        lambda x: x - x.mean(axis=-1, keepdims=True),
        lambda x: jax.jit(lambda y: y * 2.0 + 1.0)(x),  # a call
        lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(n), x)[1],  # a loop
        lambda x: lax.cond(x.sum() > 0, jnp.cos, jnp.tanh, x),
        jax.nn.relu,  # custom_jvp
        lambda x: jax.checkpoint(jnp.exp)(jnp.tanh(x)),
        lambda x: jnp.where(x > 0.5, x, 3.0),  # literals
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
    ]


@st.composite
def programs(draw):
    m, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 1000))
    ops = _ops(n, seed)
    picks = draw(st.lists(st.integers(0, len(ops) - 1), min_size=1, max_size=6))

    def f(x, y):
        for i in picks:
            x = ops[i](x) * y
        return x, x.sum()

    x = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(m, n)), jnp.float32)
    return f, (x, jnp.float32(0.75))


@settings(max_examples=12, deadline=None)
@given(prog=programs())
def test_without_rules_it_is_jax_eval_jaxpr(prog) -> None:
    f, args = prog
    closed = jax.make_jaxpr(f)(*args)
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = Interpreter().eval_jaxpr(closed, args)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


@settings(max_examples=6, deadline=None)
@given(prog=programs(), data=st.data())
def test_runs_under_checkpoint_keep_values_and_gradients(prog, data) -> None:
    f, args = prog
    closed = jax.make_jaxpr(f)(*args)
    n = len(closed.jaxpr.eqns)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
    runs = [(a, b, jax.checkpoint if data.draw(st.booleans()) else None)
            for a, b in itertools.pairwise(cuts)]
    got = Interpreter().eval_jaxpr(closed, args, runs=runs)
    for g, w in zip(got, f(*args), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    ran = jax.grad(lambda *a: Interpreter().eval_jaxpr(closed, a, runs=runs)[1], (0, 1))(*args)
    want = jax.grad(lambda *a: f(*a)[1], (0, 1))(*args)
    for g, w in zip(ran, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_runs_must_partition_the_equations() -> None:
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    with pytest.raises(ValueError, match="partition"):
        Interpreter().eval_jaxpr(closed, [1.0], runs=[(0, 1, None)])


def test_a_rule_beside_its_primitive_then_the_default_then_bind() -> None:
    """A rule replaces its primitive's equations; one that declines leaves them to the default;
    a default that declines leaves them to be bound; a rule can evaluate a sub-program with the
    same rules (here: inlining a call, so the rule for ``sin`` reaches inside it)."""
    closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(jnp.sin(x) + 1.0) * 2.0)(0.5)
    seen: list[str] = []

    def sin_to_cos(eqn, invals, interp):
        return [jnp.cos(invals[0])]

    def decline(eqn, invals, interp):
        return NotHandled

    def default(eqn, invals, interp):
        seen.append(eqn.primitive.name)
        if "jaxpr" in eqn.params:
            return interp.eval_jaxpr(eqn.params["jaxpr"], invals)
        return NotHandled

    rules = {lax.sin_p: sin_to_cos, lax.mul_p: decline}
    (got,) = Interpreter(rules, default=default).eval_jaxpr(closed, [0.5])
    np.testing.assert_allclose(got, np.cos(np.cos(0.5) + 1.0) * 2.0, rtol=1e-6)
    assert sorted(seen) == ["add", "jit", "mul"]


# ---- there is one interpreter ---------------------------------------------------------------

INSPECTORS = {
    # the tracer: translates each equation into PDG nodes (and inlines calls); evaluates nothing
    "equations": "jaxrl_sym.tracer.trace",
    "_inline": "jaxrl_sym.tracer.trace",
    # which model leaves the head's equations read (moving from rl/step/logprobs.py to
    # systems/forward.py at the time of writing: keyed by function, not module)
    "head_leaf_indices": "the chunked log-prob head",
}
"""Functions allowed a ``for`` loop over a jaxpr's equations: they inspect, never evaluate."""


def _mentions_eqns(node: ast.AST, names: set[str]) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == "eqns")
               or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))


def _hits(node: ast.AST, names: set[str]) -> list[str]:
    if isinstance(node, ast.Attribute) and node.attr == "get_bind_params":
        return ["get_bind_params"]
    if isinstance(node, ast.Attribute) and node.attr == "bind" and \
            isinstance(node.value, ast.Attribute) and node.value.attr == "primitive":
        return [".primitive.bind"]
    if isinstance(node, ast.For) and _mentions_eqns(node.iter, names):
        return ["for over .eqns"]
    return []


def walkers(source: str) -> list[tuple[int, str, str]]:
    """What in ``source`` evaluates a jaxpr's equations itself, as (line, enclosing function or
    ``""``, what):

    * binding an equation's own primitive (``<x>.primitive.bind``) or its bind parameters
      (``get_bind_params``): evaluating an equation, which only the interpreter does;
    * a ``for`` statement over a jaxpr's ``.eqns`` (directly, sliced, enumerated, or through a
      name assigned from them anywhere in the module): walking equations. Comprehensions that
      find or count equations (``attention_eqns``) are inspection and are not counted.
    """
    tree = ast.parse(source)
    names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and _mentions_eqns(node.value, set())
             for t in node.targets if isinstance(t, ast.Name)}
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, fn: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            fn = node.name
        found.extend((node.lineno, fn, what) for what in _hits(node, names))
        for child in ast.iter_child_nodes(node):
            visit(child, fn)

    visit(tree, "")
    return sorted(found)


def test_the_check_sees_a_walker() -> None:
    """The checker on made-up sources: each way a private interpreter loop was written."""
    assert walkers("def run(closed):\n    for e in closed.jaxpr.eqns:\n"
                   "        e.primitive.bind(*xs, **e.params)\n") == [
        (2, "run", "for over .eqns"), (3, "run", ".primitive.bind")]
    assert walkers("eqns = jaxpr.eqns\nfor a, b in segments(eqns):\n    run(eqns[a:b])\n")
    assert walkers("p = eqn.primitive.get_bind_params(eqn.params)\n")
    assert not walkers("calls = [e for e in jaxpr.eqns if e.primitive is attention_p]\n")
    assert not walkers("out = attention_p.bind(q, k, v)\n")


def test_one_interpreter() -> None:
    """Only :mod:`jaxrl_sym.tracer.interpret` evaluates equations; the functions in
    :data:`INSPECTORS` loop over them to read them, and nothing else does."""
    found, inspecting = {}, set()
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).as_posix()
        hits = walkers(f.read_text())
        inspecting |= {fn for _, fn, what in hits if what == "for over .eqns"}
        hits = [h for h in hits if not (h[2] == "for over .eqns" and h[1] in INSPECTORS)]
        if hits and rel != INTERPRETER:
            found[rel] = hits
    assert not found, f"jaxpr walkers besides {INTERPRETER}: {found}"
    stale = set(INSPECTORS) - inspecting
    assert not stale, f"INSPECTORS lists functions that no longer loop over equations: {stale}"
    assert walkers((PKG / INTERPRETER).read_text()), "the check no longer sees the interpreter"
