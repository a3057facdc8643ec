"""``train --config run.toml`` / ``--print-config``: the file's keys are the flags; the command
line wins; what ``--print-config`` writes reads back to the same flags; a run from the file is
the run from the flags (same parameters); a bad file is refused naming the file and the key."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from jaxrl_sym.cli import _parser
from jaxrl_sym.cli import main as cli_main
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.run.config_file import with_config

FLAGS = ["--steps", "2", "--prompts", "4", "--group", "4", "--max-digits", "2",
         "--eval-prompts", "8", "--seed", "3", "--no-remat", "--lr", "0.002"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = _parser(with_train=True)
    return p.parse_args(["train", *with_config(p.commands["train"], argv)])


def settings(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if k not in ("config", "print_config")}


def test_print_config_reads_back_to_the_same_flags(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", *FLAGS, "--json", "--drop-zero-var", "--system", "padded",
                     "--print-config"]) == 0
    text = capsys.readouterr().out
    data = tomllib.loads(text)
    assert data["steps"] == 2 and data["remat"] is False and data["json"] is True
    assert data["drop-zero-var"] is True and data["system"] == "padded"
    (tmp_path / "eff.toml").write_text(text)
    assert settings(parse(["--config", str(tmp_path / "eff.toml")])) == settings(
        parse([*FLAGS, "--json", "--drop-zero-var", "--system", "padded"]))
    # a repeatable flag and a list value
    (tmp_path / "r.toml").write_text('reward = ["format", "exact_number"]\n'
                                     'reward-weights = [1, 0.5]\nmax_digits = 3\n')
    ns = parse(["--config", str(tmp_path / "r.toml")])
    assert ns.reward == ["format", "exact_number"] and ns.reward_weights == "1,0.5"
    assert ns.max_digits == 3


def test_the_command_line_overrides_the_file(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('steps = 9\nremat = false\nreward = ["format"]\n')
    ns = parse(["--config", str(tmp_path / "run.toml"), "--steps", "1", "--remat",
                "--reward", "boxed"])
    assert ns.steps == 1 and ns.remat is True and ns.reward == ["boxed"]


@pytest.mark.parametrize("text,message", [
    ("stepz = 3\n", "'stepz' is not a flag of this command (did you mean 'steps'?)"),
    ('steps = "x"\n', "steps: 'x' is not a valid int"),
    ('algo = "dpo"\n', "algo: 'dpo' is not one of grpo, rloo, ppo"),
    ("json = 3\n", "json: give true or false"),
    ("steps = [\n", "not a TOML file"),
    ("remat = 1\n", "remat: give true or false"),
])
def test_a_bad_file_is_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(InputError, match=f"--config {tmp_path / 'bad.toml'}: ") as e:
        parse(["--config", str(tmp_path / "bad.toml")])
    assert message in str(e.value)
    with pytest.raises(InputError, match="cannot be read"):
        parse(["--config", str(tmp_path / "missing.toml")])


def test_a_run_from_the_file_is_the_run_from_the_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", *FLAGS, "--json", "--no-progress"]) == 0
    by_flags = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_main(["train", *FLAGS, "--print-config"]) == 0
    (tmp_path / "run.toml").write_text(capsys.readouterr().out)
    assert cli_main(["train", "--config", str(tmp_path / "run.toml"), "--json",
                     "--no-progress"]) == 0
    by_file = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert by_file["params_sha256"] == by_flags["params_sha256"]
    assert by_file["final_exact_match"] == by_flags["final_exact_match"]
