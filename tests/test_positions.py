"""The position-wise tail (``passes/positions.py``): a prefill runs the nodes after the last
attention only at the positions its sampler reads.

Oracles: the tail is checked against the PDG's own definition, recomputed here (what no
attention node reads, by a plain walk of the edges); generation with the tail against the same
engine with the pass off (tokens, log-probs and logits) and — through the suites that run every
prefill path (test_oracle_plain_model, test_contract, test_prefill) — against re-running the
plain model; the saving against XLA's own ``memory_analysis`` of the compiled prefill.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest
from zoo import zoo

from jaxrl_sym import GenerationConfig
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.passes.positions import position_tail
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.symbols import Point

MODELS = ("decoderlm", "gpt2", "scan", "shared", "gemmaish")


@cache
def _model(name: str):
    return init_model(preset("tiny"), 0) if name == "decoderlm" else zoo()[name]


def _read_by_attention(pdg) -> set[int]:
    """Every node some attention node reads, directly or not (and the attention nodes)."""
    out, todo = set(), [n.id for n in pdg.nodes if n.prim is attention_p]
    while todo:
        nid = todo.pop()
        if nid in out:
            continue
        out.add(nid)
        todo += [e.src for e in pdg.in_edges(nid) if e.kind == "data"]
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_tail_is_what_no_attention_reads(name: str) -> None:
    pdg = SymbolicLM(_model(name)).plan.builder.pdg
    tail = position_tail(pdg)
    assert tail is not None
    read = _read_by_attention(pdg)
    want = {n.id for n in pdg.nodes if n.domain and n.op != "input" and n.id not in read}
    assert set(tail.nodes) == want
    assert set(pdg.outputs) <= want  # the logits and the sample node
    crossing = {(e.src, e.src_out) for nid in want for e in pdg.in_edges(nid)
                if e.kind == "data" and pdg.node(e.src).domain and e.src not in want}
    assert {(c.node, c.out) for c in tail.crossings} == crossing
    assert all(pdg.node(c.node).axes[c.row_axis] == "B" for c in tail.crossings)


def test_a_tail_that_reads_another_position_is_not_cut() -> None:
    """Defensive: the tracer refuses position mixing outside ``attend``, but a PDG whose tail
    reads its input at ``t - 1`` must keep every position."""
    pdg = SymbolicLM(_model("gpt2")).plan.builder.pdg
    tail = position_tail(pdg)
    c = tail.crossings[0]
    t = pdg.symbols.sym("t")
    edges = tuple(
        dataclasses.replace(e, index=tuple(Point(t - 1) if str(ix) == "t" else ix
                                           for ix in e.index))
        if e.src == c.node and e.dst in tail.members else e for e in pdg.edges)
    assert position_tail(pdg.with_nodes_edges(pdg.nodes, edges)) is None


def _without_tail(lm: SymbolicLM) -> SymbolicLM:
    plan = lm.plan
    lm.plan = dataclasses.replace(plan, builder=dataclasses.replace(plan.builder, tail=None))
    return lm


@pytest.mark.parametrize("prefill", ["packed", "block"])
def test_prefill_runs_the_tail_at_the_sampled_positions_only(prefill: str) -> None:
    """A 50,000-word vocabulary, 8 prompts of 64 tokens: the prefill's compiled temporaries
    hold the sampled positions' logits, not the chunk's; the tokens, log-probs and logits equal
    those of the same engine with the pass off."""
    model = init_model(preset("tiny", vocab_size=50_000), 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, int(n)).astype(np.int32) for n in rng.integers(40, 65, 8)]
    cfg = GenerationConfig(max_new_tokens=3, return_logits=True)
    opts = EngineOptions(prefill=prefill)
    runs, temps = {}, {}
    for name, lm in (("cut", SymbolicLM(model, opts)),
                     ("every position", _without_tail(SymbolicLM(model, opts)))):
        runs[name] = lm.generate(prompts, cfg)
        temps[name] = max(v for k, v in lm.cache.temp_bytes.items() if "prefill" in str(k[0]))
    whole = 8 * 64 * 50_000 * 4  # one chunk's fp32 logits, had every position run the head
    assert temps["every position"] >= whole // 2 and temps["cut"] <= whole // 10, temps
    a, b = runs["cut"], runs["every position"]
    for x, y in zip(a.tokens, b.tokens, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    for x, y in zip(a.logits, b.logits, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)


@pytest.mark.parametrize(("name", "prefill"), [("gemmaish", "packed"), ("gpt2", "block")])
def test_tail_cut_prefill_equals_rerunning_the_plain_model(name: str, prefill: str) -> None:
    """Non-DecoderLM models, an odd batch of ragged prompts, a seed not used elsewhere: greedy
    tokens and the first token's logits (the tail's output at the sampled prompt position)
    equal re-running the plain model on the whole sequence (``naive_generate``: no runtime
    code)."""
    from zoo import naive_generate

    model = _model(name)
    rng = np.random.default_rng(20261126)
    prompts = [rng.integers(1, 50, int(n)).astype(np.int32) for n in rng.integers(1, 23, 5)]
    lm = SymbolicLM(model, EngineOptions(prefill=prefill))
    assert lm.plan.builder.tail is not None
    res = lm.generate(prompts, GenerationConfig(max_new_tokens=4, return_logits=True))
    for p, toks, logits in zip(prompts, res.tokens, res.logits, strict=True):
        want, rows = naive_generate(model, p, 4)
        np.testing.assert_array_equal(toks, want)
        np.testing.assert_allclose(logits[0], rows[0], atol=1e-4)
