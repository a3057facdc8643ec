"""Peak memory of one GRPO step of a pretrained-shape checkpoint on this machine, beside its ledger.

``python -m bench pretrained_memory --preset full`` writes a random-weight checkpoint at
SmolLM2-135M's shape (:data:`bench.lib.checkpoints.SMOLLM2_135M`: 30 layers, width 576, 9/3 heads,
vocabulary 49,152; fp32, 0.54 GB), runs ``jaxrl-sym train --model DIR --task word-problems``
for one step of ``--prompts 1 --group 8 --max-new-tokens 128`` in a fresh child process and
reads the child's high-water RSS (``VmHWM``, which starts afresh at ``exec``; ``ru_maxrss``
would carry the parent's over). A second child builds the same trainer and prints the step's
ledger (:func:`jaxrl_sym.rl.step.ledger.step_ledger`: compiled, never run), so the table sets what
XLA accounts for beside what the process held.

Why a trained tokenizer: the template's word-level tokenizer maps most words of the word
problems to one unknown id, so different problems collide (the task refuses a prompt with two
answers). A byte-level BPE trained on the task's own text (1,000 merges, seconds) gives distinct
prompts of realistic length; memory does not depend on which ids they are.

The issue's target: under 4 GB peak RSS for this step (it took 11.8 GB when first tried).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib import child

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"shape": "tiny", "group": 4, "tokens": 16, "update_tokens": None,
              "out": os.path.join(presets.quick_dir("pretrained_memory"), "step")},
    "full": {"shape": "smollm2-135m", "group": 8, "tokens": 128, "update_tokens": None,
             "out": str(child.ROOT / "bench" / "results" / "cpu" / "pretrained_memory")},
    "gpu": {"shape": "smollm2-135m", "group": 8, "tokens": 128, "update_tokens": None,
            "out": None},
}
_CHILD = """
import json, sys
from jaxrl_sym.cli import main
rc = main(sys.argv[1:])
hwm = next(int(x.split()[1]) * 1024 for x in open('/proc/self/status') if x.startswith('VmHWM'))
print('@@' + json.dumps({'rc': rc, 'peak_rss': hwm}))
"""


def write_model(out: Path, shape: str) -> int:
    """The checkpoint (random weights) with a BPE tokenizer trained on the task's text."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bench.lib.checkpoints import SMOLLM2_135M, write_random_checkpoint
    from jaxrl_sym.rl.tasks.text_tasks import word_problem

    nbytes = write_random_checkpoint(out, SMOLLM2_135M if shape != "tiny" else None)
    rng = np.random.default_rng(0)
    text = [word_problem(rng).prompt + " The answer is 12345 67890." for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 1}))
    return nbytes


def train_argv(args: argparse.Namespace, model: Path) -> list[str]:
    argv = ["train", "--model", str(model), "--task", "word-problems", "--prompts", "1",
            "--group", str(args.group), "--max-new-tokens", str(args.tokens), "--steps", "1",
            "--eval-prompts", "0", "--no-progress", "--json"]
    return argv + (["--update-tokens", str(args.update_tokens)] if args.update_tokens else []) \
        + (["--no-remat"] if args.no_remat else [])


def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The training step's peak RSS in its own process, and the ledger in another."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *train_argv(args, model)], env=env,
                          capture_output=True, text=True, cwd=child.ROOT, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("@@")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"training child failed:\n{proc.stderr[-3000:]}")
    run = json.loads(line[2:])
    ledger = subprocess.run([sys.executable, "-m", "bench", "pretrained_memory", "--ledger",
                             str(model), "--group", str(args.group), "--tokens",
                             str(args.tokens)], env=env, capture_output=True, text=True,
                            cwd=child.ROOT, check=False)
    if ledger.returncode:
        raise RuntimeError(f"ledger child failed:\n{ledger.stderr[-3000:]}")
    return {"peak_rss": run["peak_rss"], "ledger": json.loads(ledger.stdout.splitlines()[-1])}


def ledger(model: str, group: int, tokens: int) -> dict[str, Any]:
    """The step's ledger for the CLI's own trainer settings (compiled, never run)."""
    import numpy as np

    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.config import task_rl_config
    from jaxrl_sym.rl.run.pretrained import setup
    from jaxrl_sym.rl.run.train import EOS
    from jaxrl_sym.rl.step.ledger import step_ledger

    hf = setup(model, "word-problems", max_new_tokens=tokens)
    assert hf is not None
    cfg = task_rl_config(1, tokens, EOS, {**hf.rl_config(False), "group_size": group})
    trainer = RLTrainer(hf.load_model(), hf.task.reward, cfg)
    prompts = hf.task.sample(np.random.default_rng(0), 1)
    d = step_ledger(trainer, [p for p in prompts for _ in range(group)], [tokens] * group)
    peak = d.ledger.to_dict()["peak"]
    return {"update_tokens": cfg.execution.update_tokens, "total": peak["total"],
            "what": peak["what"],
            "buffers": [(b["name"], b["bytes"]) for b in peak["buffers"]]}


def render(args: argparse.Namespace, nbytes: int, row: dict[str, Any]) -> str:
    led = row["ledger"]
    lines = [f"# One GRPO step of a {args.shape}-shaped checkpoint on CPU: peak memory", "",
             f"`python -m bench pretrained_memory --preset {args.preset}`: weights "
             f"{nbytes / 1e9:.3f} GB fp32, 1 prompt x {args.group} samples x {args.tokens} "
             f"tokens, update micro-batch {led['update_tokens']} token slots.", "",
             "| what | GB |", "|---|---:|",
             f"| peak RSS of the training process (VmHWM) | {row['peak_rss'] / 1e9:.2f} |",
             f"| ledger peak ({led['what']}) | {led['total'] / 1e9:.2f} |"]
    lines += [f"| &nbsp;&nbsp;{name} | {b / 1e9:.3f} |" for name, b in led["buffers"]
              if b > 1e6]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("pretrained_memory", __doc__, PRESETS)
    p.add_argument("--update-tokens", type=presets.at_least(1), default=None,
                   help="train --update-tokens (default: the pretrained recipe's)")
    p.add_argument("--no-remat", action="store_true",
                   help="train --no-remat: keep the layers' activations for the backward")
    p.add_argument("--out", default=None, help="OUT.json and OUT.md")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--ledger"]:  # the ledger child
        p = argparse.ArgumentParser()
        p.add_argument("--ledger")
        p.add_argument("--group", type=int)
        p.add_argument("--tokens", type=int)
        a = p.parse_args(argv)
        print(json.dumps(ledger(a.ledger, a.group, a.tokens)))
        return 0
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        nbytes = write_model(model, args.shape)
        row = measure(args, model)
    text = render(args, nbytes, row)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps({**vars(args), "weights": nbytes,
                                                        **row}, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)
    return 0
