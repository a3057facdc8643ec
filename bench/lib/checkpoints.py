"""Random-weight Hugging Face checkpoints at a real model's shape, for memory and time benchmarks.

``write_random_checkpoint(out_dir, SMOLLM2_135M, "float32")`` writes a directory
``load_pretrained``, ``jaxrl-sym train --model`` and ``jaxrl-sym export`` accept: the config and
tokenizer of the small transformers-made Llama fixture (``tests/fixtures/hf/llama_tied_sharded``)
with the shape fields overridden, and one ``model.safetensors`` of seeded random weights.

Why random weights at a real shape: memory and time depend on the shapes and dtype, not on what
the weights learned, and a pretrained download is neither reproducible offline nor small. Tensor
names and shapes come from the loader's own mapping (:func:`parameter_targets` on a shape-only
model), so the file always matches what the loader expects. The file is streamed one tensor at a
time (:func:`write_safetensors`), so generating a 0.5 GB checkpoint holds one tensor, not all.
:func:`write_rl_checkpoint` adds what ``jaxrl-sym train --model DIR --checkpoint-dir RUN``
would leave (parameters, Adam state, metadata naming DIR) without generating or stepping.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bench.lib.child import ROOT
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.safetensors_io import write_safetensors

TEMPLATE = ROOT / "tests" / "fixtures" / "hf" / "llama_tied_sharded"
# HuggingFaceTB/SmolLM2-135M's shape (its config.json), tied embeddings: 134.5M parameters.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "bos_token_id": 0, "eos_token_id": 0,  # SmolLM2's; `train --model` needs an EOS id
}
_NP_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                              "float16": np.float16}


def checkpoint_shapes(config: dict[str, Any], dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name → (HF-layout shape, dtype) for ``config``, by the loader's own mapping."""
    from jaxrl_sym.models.hf.config import parse_config
    from jaxrl_sym.models.hf.modeling import abstract_model
    from jaxrl_sym.models.hf.targets import parameter_targets

    model = abstract_model(parse_config(config, dtype))
    return {name: (t.hf_shape, dtype) for name, t in sorted(parameter_targets(model).items())}


def _random_tensor(names: list[str], name: str, shape: tuple[int, ...], dtype: str,
                   seed: int) -> np.ndarray:
    """Norm weights 1, everything else N(0, 0.02²) from a generator keyed by (seed, the name's
    index): each tensor is a function of its own, whatever order a writer asks in."""
    if name.endswith("norm.weight"):
        return np.ones(shape, _NP_DTYPES[dtype])
    arr = np.random.default_rng([seed, names.index(name)]).standard_normal(shape, np.float32)
    arr *= 0.02
    return arr.astype(_NP_DTYPES[dtype], copy=False)


def write_random_checkpoint(out_dir: str | Path, config_overrides: dict[str, Any] | None = None,
                            dtype: str = "float32", seed: int = 0,
                            template: str | Path = TEMPLATE) -> int:
    """Write a random-weight checkpoint directory; returns the weights' size in bytes.

    Args:
      out_dir: the directory to create (may exist; its files of the same names are replaced).
      config_overrides: ``config.json`` fields to change from ``template``'s (e.g.
        :data:`SMOLLM2_135M`); None keeps the template's tiny shape.
      dtype: ``float32``, ``bfloat16`` or ``float16`` (weights and config's ``dtype``).
      seed: the weights' seed (same seed, shape and dtype → the same bytes).
      template: a checkpoint directory whose ``config.json``, ``tokenizer.json`` and
        ``generation_config.json`` are reused.
    """
    if dtype not in _NP_DTYPES:
        raise InputError(f"dtype {dtype!r}: choose one of {', '.join(_NP_DTYPES)}")
    src, out = Path(template), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(config_overrides or {})
    config["dtype"] = dtype
    for name in ("tokenizer.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shapes = checkpoint_shapes(config, dtype)
    names = sorted(shapes)
    write_safetensors(out / "model.safetensors",
                      {n: (s, _NP_DTYPES[d]) for n, (s, d) in shapes.items()},
                      lambda n: _random_tensor(names, n, *shapes[n], seed),
                      metadata={"format": "pt"})
    return sum(int(np.prod(s)) * np.dtype(_NP_DTYPES[d]).itemsize for s, d in shapes.values())


def write_rl_checkpoint(model_dir: str | Path, run_dir: str | Path, *, beta: float = 0.0,
                        step: int = 1) -> None:
    """An RL training checkpoint of ``model_dir``'s untrained policy at ``step``, laid out as
    ``jaxrl-sym train --model`` saves one: parameters, Adam's moments, the reference when
    ``beta > 0``, and metadata whose hyper-parameters name ``model_dir`` (what export reads).

    Why not ``train --steps 1``: at a real shape one step compiles and generates for minutes on
    a CPU; the export only reads what was saved, which this writes in seconds.
    """
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.rl.config import RLConfig
    from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint
    from jaxrl_sym.rl.run.train import run_hparams
    from jaxrl_sym.rl.step.trainer import RLTrainer

    model = load_pretrained(model_dir)[0]
    cfg = RLConfig.of(beta=beta, max_new_tokens=8, eos_id=0)
    trainer = RLTrainer(model, lambda prompt, response: 0.0, cfg)
    hparams = {**run_hparams(cfg, task="word-problems", seed=0),
               "model_dir": str(Path(model_dir).absolute()), "chat_template": False,
               "model_dtype": None}
    meta = {"fingerprint": fingerprint(trainer), "hparams": hparams, "lineage": []}
    Checkpointer(run_dir).save(step, trainer, meta)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.lib.checkpoints OUT [--dtype bfloat16] [--tiny]``: write one."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--dtype", default="float32", choices=sorted(_NP_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the template's shape, not SmolLM2-135M")
    a = p.parse_args(argv)
    n = write_random_checkpoint(a.out, None if a.tiny else SMOLLM2_135M, a.dtype, a.seed)
    print(f"wrote {a.out}: {n / 1e6:.1f} MB of {a.dtype} weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
