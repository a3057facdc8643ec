"""Beyond the model's range (issue 29): a prompt plus its new tokens past the checkpoint's
``max_position_embeddings`` is refused before any work, naming the flag and the limit, in the
generate CLI and in RL text tasks; ``--extrapolate`` opts in. The text fixture states 1024."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxrl_sym.errors import InputError

TEXT = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
GGUF = Path(__file__).parent / "fixtures" / "hf" / "gguf_llama"


def _generate(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    from jaxrl_sym.cli import main

    rc = main(["generate", "--model", str(TEXT), "--system", "padded", "--ignore-eos",
               "--prompt-ids", "1,2,3,4,5,6,7,8,9,10", *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_past_the_trained_positions_is_refused_then_opted_into(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _generate(capsys, "--max-new-tokens", "1015")
    assert rc == 2
    assert ("--max-new-tokens 1015 after the longest prompt (10 tokens) needs 1025 positions, but "
            "the checkpoint was trained for max_position_embeddings=1024") in err
    assert "--extrapolate" in err
    rc, out, _ = _generate(capsys, "--max-new-tokens", "1014", "--json")  # exactly 1024: fits
    assert rc == 0 and len(json.loads(out)["rows"][0]["tokens"]) == 1014
    rc, out, _ = _generate(capsys, "--max-new-tokens", "1020", "--json", "--extrapolate")
    assert rc == 0 and len(json.loads(out)["rows"][0]["tokens"]) == 1020


def test_rl_text_task_prompts_past_the_trained_positions_are_refused() -> None:
    from jaxrl_sym.rl.run.pretrained import setup

    rng = np.random.default_rng(0)
    fits = setup(str(TEXT), "word-problems", max_new_tokens=64)
    longest = max(len(p) for p in fits.task.sample(rng, 8))
    run = setup(str(TEXT), "word-problems", max_new_tokens=1025 - longest)
    with pytest.raises(InputError, match=r"task word-problems: a prompt of \d+ tokens .* with "
                                         r"--max-new-tokens \d+ needs \d+ positions, but .*"
                                         r"max_position_embeddings=1024; lower --max-new-tokens"):
        run.task.sample(np.random.default_rng(0), 8)


def test_max_positions_from_config_and_gguf(tmp_path: Path) -> None:
    from jaxrl_sym.models.hf.config import parse_config
    from jaxrl_sym.models.hf.text import HFText

    raw = json.loads((TEXT / "config.json").read_text())
    assert parse_config(raw).max_position_embeddings == raw["max_position_embeddings"] == 1024
    assert parse_config({k: v for k, v in raw.items()
                         if k != "max_position_embeddings"}).max_position_embeddings is None
    for bad in (0, "4k", True):
        with pytest.raises(InputError, match=rf"max_position_embeddings={bad!r} must be an int"):
            parse_config({**raw, "max_position_embeddings": bad})
    gguf = next(GGUF.rglob("*.gguf"))  # the file's context length, as transformers reads it
    import gguf as gguf_lib

    r = gguf_lib.GGUFReader(gguf)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    field = r.fields[f"{arch}.context_length"]
    assert HFText(gguf).max_positions == int(field.parts[field.data[0]][0]) == 256
    no_limit = tmp_path / "m"
    shutil.copytree(TEXT, no_limit)
    (no_limit / "config.json").write_text(json.dumps(
        {k: v for k, v in raw.items() if k != "max_position_embeddings"}))
    assert HFText(no_limit).max_positions is None and HFText(TEXT).max_positions == 1024


@pytest.mark.parametrize("system", ["padded", "sym"])
def test_a_generation_that_cannot_fit_is_refused_before_it_starts(
        system: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A billion new tokens: padded died in XLA with a 64 GB RESOURCE_EXHAUSTED traceback and
    sym ran without a word; both are now refused by their estimate before generating."""
    rc, _, err = _generate(capsys, "--max-new-tokens", str(10**9), "--extrapolate",
                           "--system", system)
    assert rc == 2
    assert f"{system}: estimated " in err and "Lower --max-new-tokens or the prompts, or " \
        "pass --no-memory-check" in err


@pytest.mark.parametrize(("p", "n"), [(3, 40), (17, 300), (64, 1000)])
def test_the_unreplayed_sym_estimate_is_a_lower_bound(p: int, n: int, monkeypatch) -> None:
    """Past REPLAY_MAX_TOKENS the estimate sizes growing stores at exactly p + n slots instead
    of replaying the policy: never more than the replayed estimate, so it refuses only what
    cannot fit."""
    from jaxrl_sym import systems
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.runtime.memory import estimate

    model, _, _ = load_pretrained(TEXT)
    bound = systems.get("sym").bind(model, systems.BindOptions())
    cfg = GenerationConfig(max_new_tokens=n)
    replayed = bound.estimate([p] * 4, cfg)
    monkeypatch.setattr(estimate, "REPLAY_MAX_TOKENS", n - 1)
    low = bound.estimate([p] * 4, cfg)
    assert "lower bound" in low.caches_what and "lower bound" not in replayed.caches_what
    assert low.caches <= replayed.caches and low.total <= replayed.total
    assert low.weights == replayed.weights and low.caches > 0


def test_a_jsonl_row_past_the_positions_is_refused_at_setup(tmp_path: Path) -> None:
    """A fixed list's longest row is checked when the run is set up, naming it, not when a step
    happens to sample it (issue 50: it was found only then, or never)."""
    from jaxrl_sym.rl.run.pretrained import setup

    rows = [{"prompt": "What is 2 + 3?", "answer": 5}] * 3
    rows.insert(2, {"prompt": "What is " + " + ".join(["1"] * 700) + "?", "answer": 700})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"task jsonl:.*long\.jsonl: a prompt of \d+ tokens "
                                         r"\(row 3\).*max_position_embeddings=1024"):
        setup(str(TEXT), f"jsonl:{path}", max_new_tokens=16)
    path.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i != 2))
    assert setup(str(TEXT), f"jsonl:{path}", max_new_tokens=16) is not None
