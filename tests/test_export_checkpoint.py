"""``jaxrl-sym export --checkpoint-dir`` writes the policy alone, and refuses a damaged run.

Its peak memory (the weights plus at most one extra copy) is a benchmark's check, not a test's:
``python -m bench.lib.export_memory --model DIR --run RUN`` (``bench/results/cpu/export_memory.md``)
exits non-zero when an export passes its bound; an RSS band in the suite flakes with the
machine's load (issue 49).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lib.checkpoints import write_random_checkpoint


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
    cfg = RLConfig.of(algo="ppo", beta=0.04, max_new_tokens=4, eos_id=0)
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
