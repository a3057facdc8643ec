"""Every notebook in ``notebooks/`` runs top to bottom at small sizes (``JAXRL_SYM_NB_QUICK=1``).

The notebooks are kept as jupytext percent-format ``.py`` files (diff-friendly); the test turns
each into an ``.ipynb`` in memory and runs it with nbclient on a ``python3`` kernel. jupyter_client
launches that kernel spec's ``python`` as ``sys.executable``, so the kernel is this interpreter
(the project's virtual environment); the first cell checks it. Set ``JAXRL_SYM_NB_OUT=DIR`` to
keep the executed notebooks (with their plots) for a look.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("quickstart", "padding_vs_symbolic", "storage", "grpo_reverse")


def test_every_notebook_is_listed() -> None:
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.py")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXRL_SYM_NB_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = jupytext.read(NOTEBOOKS / f"{name}.py")
    check = nbformat.v4.new_code_cell("import sys; print(sys.executable)")
    nb.cells.insert(0, check)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
    assert images >= 1, f"{name} drew no plot"
    keep = os.environ.get("JAXRL_SYM_NB_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(keep) / f"{name}.ipynb")
