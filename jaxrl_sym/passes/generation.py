"""Close the generation loop: ``tok[t] = sample(logits[t-1])``.

The traced model maps tokens to logits over the domain (r, t). Generation adds a ``sample`` node
(:data:`~jaxrl_sym.ops.sampling.sample_p`) over the same domain and a *feedback* edge from it
back to the tokens input at index ``t-1``: the PDG becomes cyclic, and the storage planner sees
a point access with lag 1 (a single slot).
"""

from __future__ import annotations

from dataclasses import replace

from jaxrl_sym.ops.sampling import sample_p
from jaxrl_sym.pdg.ir import PDG, Edge, Node
from jaxrl_sym.symbols import Point


def add_generation_loop(pdg: PDG) -> PDG:
    """Return a new PDG with a ``sample`` node fed by the logits and feeding the tokens input."""
    (logits_id,) = pdg.outputs
    logits = pdg.node(logits_id)
    r, t = pdg.symbols.sym("r"), pdg.symbols.sym("t")
    sid = len(pdg.nodes)
    sample = Node(
        id=sid, op="sample", domain=logits.domain, shape=logits.shape[:-1],
        axes=logits.axes[:-1], dtype="int32", name="next_token", source="jaxrl_sym.generation",
        prim=sample_p, n_inputs=1,
    )
    tokens_id = pdg.input_id("tokens")
    edges = (
        *pdg.edges,
        Edge(logits_id, sid, 0, (Point(r), Point(t))),
        Edge(sid, tokens_id, 0, (Point(r), Point(t - 1)), kind="feedback"),
    )
    return replace(pdg, nodes=(*pdg.nodes, sample), edges=edges, outputs=(logits_id, sid))
