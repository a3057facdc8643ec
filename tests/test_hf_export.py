"""Export to Hugging Face format: our loader and transformers read back what we wrote.

Two oracles. Without torch (CI): an unmodified model exports to exactly the tensors of the
transformers-saved source (same names, dtypes, bytes) and the same config, and reloads with
identical logits. In the oracle interpreter (``tests/hf_oracle.py``; torch + transformers,
``make test`` requires it): transformers loads the exported directory and gives the logits it
gave on the source.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_oracle import oracle_python, run_oracle

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.models.hf.export import export_pretrained, plan_shards

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# Every transformers-made checkpoint fixture, including families added later.
ALL_CASES = sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))
CASES = ("qwen2_tied", "qwen2_sliding_sharded", "llama3_scaled", "llama_tied_sharded")


def expected(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / case / "expected.npz") as z:
        return dict(z)


def forward(model, prompt: np.ndarray) -> np.ndarray:
    toks = jnp.asarray(prompt[None], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


def all_tensors(root: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("case", ALL_CASES)
def test_unmodified_export_is_the_source(case: str, tmp_path: Path) -> None:
    """Same tensor names, dtypes and bytes as transformers saved; same config; same logits."""
    src = FIXTURES / case
    model, _, _ = load_pretrained(src)
    out = tmp_path / "out"
    files = export_pretrained(model, out, source_dir=src)
    assert "model.safetensors" in files and "tokenizer.json" in files
    theirs, ours = all_tensors(src), all_tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name, arr in theirs.items():
        assert ours[name].dtype == arr.dtype and ours[name].shape == arr.shape, name
        assert ours[name].tobytes() == arr.tobytes(), f"{case}: {name} bytes differ"
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text())
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    again, _, _ = load_pretrained(out)
    exp = expected(case)
    assert np.array_equal(forward(again, exp["prompt1"]), forward(model, exp["prompt1"]))


def test_sharded_export_reloads_identically(tmp_path: Path) -> None:
    src = FIXTURES / "llama3_scaled"
    model, _, _ = load_pretrained(src)
    files = export_pretrained(model, tmp_path / "out", source_dir=src, max_shard_bytes=80_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and set(shards) <= set(files) and "model.safetensors" not in files
    sizes = {n: a.nbytes for n, a in all_tensors(src).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for shard in shards:
        in_shard = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(in_shard) == 1 or sum(sizes[n] for n in in_shard) <= 80_000
    again, _, _ = load_pretrained(tmp_path / "out")
    exp = expected("llama3_scaled")
    assert np.array_equal(forward(again, exp["prompt0"]), forward(model, exp["prompt0"]))


def test_plan_shards_limits() -> None:
    assert plan_shards({"a": 5, "b": 5, "c": 5}, 10) == [["a", "b"], ["c"]]
    assert plan_shards({"a": 50, "b": 5}, 10) == [["a"], ["b"]]  # too big: a shard of its own
    assert plan_shards({"a": 1}, 10) == [["a"]]


def test_streamed_files_are_save_files_bytes(tmp_path: Path) -> None:
    """write_safetensors (one tensor at a time) writes the bytes safetensors' save_file writes
    for the same tensors, mixed dtypes included (their order in the file is by dtype, then
    name); read_tensor reads them back; a truncated file is an error naming the tensor."""
    from safetensors.numpy import save_file

    from jaxrl_sym.models.hf.safetensors_io import read_header, read_tensor, write_safetensors

    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.standard_normal((3, 5)).astype(np.float32),
               "a.bias": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
               "c": rng.standard_normal((2, 2)).astype(np.float16),
               "a.weight": rng.standard_normal((4,)).astype(np.float32),
               "d": rng.standard_normal((1, 3)), "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    asked: list[str] = []

    def tensor(name: str) -> np.ndarray:
        asked.append(name)
        return tensors[name]

    specs = {n: (a.shape, a.dtype) for n, a in tensors.items()}
    write_safetensors(tmp_path / "ours.safetensors", specs, tensor, metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors"
                                                            ).read_bytes()
    assert asked == ["d", "a.weight", "b.weight", "empty", "a.bias", "c"]
    start, header = read_header(tmp_path / "ours.safetensors")
    with open(tmp_path / "ours.safetensors", "rb") as fh:
        for name, arr in tensors.items():
            got = read_tensor(fh, start, header[name], name)
            assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes(), name
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "ours.safetensors").read_bytes()[:-4])
    with open(cut, "rb") as fh, pytest.raises(InputError, match=r"'c'.*truncated"):
        read_tensor(fh, start, header["c"], "c")


def test_bf16_cast_export(tmp_path: Path) -> None:
    """Loaded as bf16 → BF16 tensors and dtype "bfloat16" in config.json; reload is bit-equal."""
    src = FIXTURES / "qwen2_tied"
    model, _, _ = load_pretrained(src, dtype="bfloat16")
    export_pretrained(model, tmp_path / "bf", source_dir=src)
    cfg = json.loads((tmp_path / "bf" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    tensors = all_tensors(tmp_path / "bf")
    assert all(a.dtype == ml_dtypes.bfloat16 for a in tensors.values())
    again, _, _ = load_pretrained(tmp_path / "bf")
    assert again.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    exp = expected("qwen2_tied")
    assert np.array_equal(forward(again, exp["prompt0"]), forward(model, exp["prompt0"]))


def test_refusals(tmp_path: Path) -> None:
    src = FIXTURES / "qwen2_tied"
    model, _, _ = load_pretrained(src)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match=r"full is not empty.*overwrite"):
        export_pretrained(model, full, source_dir=src)
    assert (full / "keep.txt").read_text() == "mine"
    with pytest.raises(InputError, match=r"is the source directory"):
        export_pretrained(model, src, source_dir=src, overwrite=True)
    # a copy of the source: --out holding it, or inside it, would replace or pollute it
    copy = tmp_path / "models" / "base"
    shutil.copytree(src, copy)
    for out_dir, how in ((tmp_path / "models", "holds"), (copy / "tuned", "lies inside"),
                         (copy / "sub" / "..", "is")):
        with pytest.raises(InputError, match=f"{how} the source directory"):
            export_pretrained(model, out_dir, source_dir=copy, overwrite=True)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in src.iterdir())
    shutil.rmtree(tmp_path / "models")
    with pytest.raises(InputError, match=r"describes another architecture"):
        export_pretrained(model, tmp_path / "x", source_dir=FIXTURES / "llama3_scaled")
    with pytest.raises(InputError, match=r"no config\.json"):
        export_pretrained(model, tmp_path / "x", source_dir=tmp_path)
    export_pretrained(model, full, source_dir=src, overwrite=True)
    assert not (full / "keep.txt").exists() and (full / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temp dirs left over


def test_crash_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the first shard: no out_dir (or the old one intact), no temp dirs."""
    src = FIXTURES / "llama3_scaled"
    model, _, _ = load_pretrained(src)
    from jaxrl_sym.models.hf import export as export_mod

    real, calls = export_mod.write_safetensors, []

    def flaky(path, specs, tensor, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, specs, tensor, metadata=metadata)

    monkeypatch.setattr(export_mod, "write_safetensors", flaky)
    with pytest.raises(InputError, match=r"out_dir .*new: writing the checkpoint failed \(No "
                                         r"space left on device\); nothing was written"):
        export_pretrained(model, tmp_path / "new", source_dir=src, max_shard_bytes=80_000)
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    calls.clear()
    with pytest.raises(InputError, match="No space"):
        export_pretrained(model, old, source_dir=src, overwrite=True, max_shard_bytes=80_000)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert (old / "config.json").read_text() == "{}"


ORACLE_SCRIPT = """
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
out = {}
for d, src in zip(sys.argv[1::2], sys.argv[2::2]):
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    exp = np.load(src + "/expected.npz")
    diffs, same, dtypes = [], [], {str(p.dtype) for p in model.parameters()}
    for i in range(2):
        ids = torch.tensor(exp[f"prompt{i}"][None].astype(np.int64))
        with torch.no_grad():
            got, ref = model(ids).logits[0].float(), source(ids).logits[0].float()
        diffs.append(float(np.max(np.abs(got.numpy() - exp[f"logits{i}"]))))
        same.append(float(torch.max(torch.abs(got - ref))))
    out[d] = {"diff": max(diffs), "vs_source": max(same), "dtypes": sorted(dtypes),
              "source_dtypes": sorted({str(p.dtype) for p in source.parameters()})}
print(json.dumps(out))
"""


def test_transformers_loads_export(tmp_path: Path) -> None:
    """transformers' from_pretrained on our exports of every fixture family: exactly the
    logits of the source directory (same process, same torch) and its parameter dtypes; the fp32
    ones the fixture's logits within 1e-4; a bf16-cast export has bf16 parameters and logits
    near the fp32 ones."""
    python = oracle_python()
    args = []
    for case in ALL_CASES:
        model, _, _ = load_pretrained(FIXTURES / case)
        shard = 100_000 if case.endswith("sharded") else 10**9
        export_pretrained(model, tmp_path / case, source_dir=FIXTURES / case,
                          max_shard_bytes=shard)
        args += [str(tmp_path / case), str(FIXTURES / case)]
    bf, _, _ = load_pretrained(FIXTURES / "qwen2_tied", dtype="bfloat16")
    export_pretrained(bf, tmp_path / "bf16", source_dir=FIXTURES / "qwen2_tied")
    args += [str(tmp_path / "bf16"), str(FIXTURES / "qwen2_tied")]
    res = run_oracle(python, ORACLE_SCRIPT, args, tmp_path)
    for case in ALL_CASES:  # the very logits transformers gives on the source, same torch
        got = res[str(tmp_path / case)]
        assert got["dtypes"] == got["source_dtypes"] and got["vs_source"] == 0.0, (case, got)
    for case in CASES:  # fp32 checkpoints: and the fixture's logits
        assert res[str(tmp_path / case)]["dtypes"] == ["torch.float32"]
        assert res[str(tmp_path / case)]["diff"] < 1e-4, (case, res)
    scale = np.max(np.abs(expected("qwen2_tied")["logits0"]))
    assert res[str(tmp_path / "bf16")]["dtypes"] == ["torch.bfloat16"]
    assert res[str(tmp_path / "bf16")]["diff"] / scale < 0.1


def test_overwrite_swaps_atomically_so_out_is_never_missing(tmp_path: Path) -> None:
    """--overwrite replaces --out in one atomic exchange: another process polling it during 300
    replacements always finds a complete directory (old or new), never none. The two-rename
    replacement it replaced left a moment without --out (this poller saw ~900 such moments in
    300 replacements), and a kill there lost the old export."""
    import sys

    from jaxrl_sym.models.hf.export import _exchange, swap_into_place

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("0")
    probe = tmp_path / "a"
    probe.mkdir()
    if not _exchange(probe, out):  # a file system without RENAME_EXCHANGE: the fall-back
        pytest.skip("renameat2(RENAME_EXCHANGE) unsupported here")
    _exchange(probe, out)  # back as they were
    stop = tmp_path / "stop"
    poller = subprocess.Popen([sys.executable, "-c", f"""
import os, sys
p, stop, miss = {str(out / 'config.json')!r}, {str(stop)!r}, 0
print('go', flush=True)
while not os.path.exists(stop):
    miss += not os.path.exists(p)
print(miss)
"""], stdout=subprocess.PIPE, text=True)
    assert poller.stdout is not None and poller.stdout.readline().strip() == "go"
    for i in range(1, 301):
        new = tmp_path / f"new{i}"
        new.mkdir()
        (new / "config.json").write_text(str(i))
        swap_into_place(new, out)
    stop.touch()
    assert poller.communicate(timeout=60)[0].strip() == "0"
    assert (out / "config.json").read_text() == "300"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "out", "stop"]  # old ones gone
