"""``jaxrl-sym export`` holds the weights plus at most one extra copy (peak RSS, measured).

A 92 MB random-weight Llama (:func:`bench.lib.checkpoints.write_random_checkpoint`) and an RL
checkpoint of it (parameters + Adam's two moments, :func:`write_rl_checkpoint`) are exported in
child processes that first export a tiny checkpoint the same way, so their baseline already
holds JAX, orbax and tokenizers (:mod:`bench.lib.export_memory`). What the real export adds on top
of that baseline is compared with the weights' size W:

* ``--checkpoint-dir``: at most 2 W, the policy plus one extra copy (measured 1.6-1.85 W here,
  1.2 W at 538 MB: orbax's read buffers and a fixed ~30-40 MB of restore machinery weigh more
  on small weights). Before the fix it restored the whole training state into a trainer: 9.4 W.
* ``--model``: at most 1.5 W (measured 1.15 W: the model plus a tensor at a time). A memory map
  kept resident while loading, or ``save_file``'s dict of every host tensor, each add a whole W
  (both were there before: 2.16 W).

``SLACK`` covers what does not scale with the weights (allocator arenas, thread stacks, Python
objects of the export itself): 32 MiB, a third of W here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lib.checkpoints import write_random_checkpoint, write_rl_checkpoint
from bench.lib.export_memory import measure, weights_bytes

# 23M parameters in fp32, no tensor above 3.2 MB (vocabulary 8192): the weights dominate.
SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "vocab_size": 8192, "eos_token_id": 0}
SLACK = 32 * 2**20


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_memory")
    paths = {k: root / k for k in ("model", "tiny", "run", "tiny_run")}
    write_random_checkpoint(paths["model"], SHAPE, "float32", seed=1)
    write_random_checkpoint(paths["tiny"], {"eos_token_id": 0})
    write_rl_checkpoint(paths["model"], paths["run"])
    write_rl_checkpoint(paths["tiny"], paths["tiny_run"])
    return paths


@pytest.mark.parametrize(("flag", "source", "warmup", "bound"), [
    ("--model", "model", "tiny", 1.5), ("--checkpoint-dir", "run", "tiny_run", 2.0)])
def test_export_peak_memory(sources: dict[str, Path], tmp_path: Path, flag: str, source: str,
                            warmup: str, bound: float) -> None:
    weights = weights_bytes(sources["model"])
    assert 85e6 < weights < 100e6
    out = tmp_path / "out"
    rep = measure(flag, sources[source], sources[warmup], out)
    added = rep["peak_bytes"] - rep["baseline_bytes"]
    assert added <= bound * weights + SLACK, (
        f"export {flag} added {added / 1e6:.0f} MB of peak RSS for {weights / 1e6:.0f} MB of "
        f"weights ({added / weights:.2f} W; bound {bound} W + {SLACK / 1e6:.0f} MB)")
    # untrained policy: the export is the source file, byte for byte
    assert (out / "model.safetensors").read_bytes() == (
        sources["model"] / "model.safetensors").read_bytes()


def test_checkpoint_export_reads_and_verifies_only_the_policy(tmp_path: Path) -> None:
    """With a reference and a PPO value head saved beside the policy, the export still writes
    exactly the policy (untrained: the source file); flipped bytes in the saved arrays are
    refused by the parameters' digest, naming the step."""
    from bench.lib.checkpoints import TEMPLATE
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.rl.config import RLConfig
    from jaxrl_sym.rl.run.checkpoint import Checkpointer, CheckpointError, fingerprint
    from jaxrl_sym.rl.run.export import export_checkpoint
    from jaxrl_sym.rl.step.trainer import RLTrainer

    src = tmp_path / "src"
    write_random_checkpoint(src, {"eos_token_id": 0}, template=TEMPLATE)
    cfg = RLConfig(algo="ppo", beta=0.04, max_new_tokens=4, eos_id=0)
    trainer = RLTrainer(load_pretrained(src)[0], lambda p, r: 0.0, cfg)
    meta = {"fingerprint": fingerprint(trainer), "lineage": [],
            "hparams": {**cfg.to_dict(), "model_dir": str(src), "model_dtype": None}}
    Checkpointer(tmp_path / "run").save(1, trainer, meta)
    files, info = export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert info["step"] == 1 and "model.safetensors" in files
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        src / "model.safetensors").read_bytes()
    # every data file (OCDBT spreads the arrays over several, in an order set by its async
    # writers: the policy's need not be in the largest), flipped at 19 places each
    data_files = sorted((tmp_path / "run" / "1" / "state").rglob("d/*"))
    assert data_files
    for data_file in data_files:
        data = bytearray(data_file.read_bytes())
        for k in range(1, 20):
            data[len(data) * k // 20:len(data) * k // 20 + 16] = b"\xa5" * 16
        data_file.write_bytes(bytes(data))
    # refused either way: the bytes decode to other values (digest) or do not decode at all
    # (which of the two depends on where OCDBT placed the arrays in the file)
    with pytest.raises(CheckpointError, match=r"run/1( is unusable: the digest of its restored "
                                              r"parameters differs|: its parameters cannot be "
                                              r"read)"):
        export_checkpoint(tmp_path / "run", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
