"""Words that are true (issue 49 item 5): every backticked file path (``something.py``) and
dotted name (``jaxrl_sym.x.y``, ``bench.x.y``) in the README, ``docs/`` and the docstrings of
``jaxrl_sym/`` and ``bench/`` resolves — the file is in the repository, the name imports.

Why: modules moved (bench's helpers into ``bench/lib/``, experiments into
``bench/experiments/``) and references went stale without a test noticing. Paths may be written
from the repository root, from the package (``runtime/policy.py``) or by a tail; a reference to
another project's file or to a file the reader is asked to create is listed in ``NOT_OURS``
with the reason.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
NOT_OURS = {
    "integrations/ggml.py": "transformers' GGUF loader, which models/hf/gguf.py transcribes",
    "integrations/gguf/gguf_tokenizer_mapping.py": "transformers' GGUF tokenizer map",
    "jaxrl_sym/systems/naive.py": "docs/extending.md: the file a reader adds for a new system",
    "mypkg/padded_copy.py": "docs/extending.md: the RL half a reader adds in their package",
}
PATH = re.compile(r"`{1,2}([A-Za-z0-9_./-]+\.py)(?::[A-Za-z_0-9.]+)?`{1,2}")
DOTTED = re.compile(r"`{1,2}((?:jaxrl_sym|bench)(?:\.[A-Za-z_][A-Za-z_0-9]*)+)(?:\(\))?`{1,2}")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return [f for f in out.split() if (ROOT / f).exists()]


def _texts(files: list[str]) -> list[tuple[str, str]]:
    """(file, text) for the README, every docs page and every documenting string of the code."""
    out = []
    for f in files:
        if f == "README.md" or (f.startswith("docs/") and f.endswith(".md")):
            out.append((f, (ROOT / f).read_text()))
        elif f.endswith(".py") and f.startswith(("jaxrl_sym/", "bench/")):
            # docstrings, and the string statements that document a constant or field
            for node in ast.walk(ast.parse((ROOT / f).read_text())):
                if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str)):
                    out.append((f, node.value.value))
    return out


def _path_resolves(ref: str, files: set[str]) -> bool:
    if ref in files or any(base + ref in files for base in ("jaxrl_sym/", "bench/")):
        return True
    return any(f.endswith("/" + ref) for f in files)


def _name_resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_backticked_path_and_name_resolves() -> None:
    files = _tracked()
    known = set(files)
    texts = _texts(files)
    assert len(texts) > 500  # the walk saw the code's docstrings
    stale = set()
    for f, text in texts:
        stale |= {(f, m) for m in PATH.findall(text)
                  if m not in NOT_OURS and not _path_resolves(m, known)}
        stale |= {(f, m) for m in DOTTED.findall(text) if not _name_resolves(m)}
    assert not stale, "stale references:\n" + "\n".join(f"{f}: {m}" for f, m in sorted(stale))


def test_the_check_catches_a_stale_reference() -> None:
    known = set(_tracked())
    assert not _path_resolves("bench/no_such_module.py", known)
    assert _path_resolves("runtime/policy.py", known)
    assert not _name_resolves("jaxrl_sym.runtime.policy.no_such_function")
    assert _name_resolves("jaxrl_sym.runtime.policy.replay")
