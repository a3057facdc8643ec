"""Nothing silent at load (issue 50, items 3 and 5): every loader refuses what would poison a run.

What these tests hold the loaders to, each case built here from the repository's fixtures:

* **One weight check.** A NaN/inf weight is refused by the same function
  (``loader.check_weight``) whether it comes from safetensors, a GGUF file (plain or inside a
  quantized block) or a PEFT adapter, naming the file, the tensor and the first bad index; a
  weight beyond float16's range is refused when the model is loaded in float16 (it used to load
  as inf and decode token 0), naming the file, the tensor and the largest magnitude.
* **Adapters for another model.** ``load_peft`` compares what ``adapter_config.json`` records
  (``auto_mapping``, the base at ``base_model_name_or_path``, ``target_modules``) against the
  model it is loaded into and names the field and both values.
* **Cut GGUF files** say "truncated" with the bytes expected and present, wherever the cut is.
* **Permissions.** An unreadable directory or file is an ``InputError`` naming the path and the
  permission needed. Tests run as root here, where ``chmod`` denies nothing, so denial is
  simulated by patching ``open``/``os.listdir``/``os.stat`` for the paths concerned only; the one
  real-``chmod`` test skips under root.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.models.hf import loader as loader_mod
from jaxrl_sym.weights.peft import export_peft, load_peft

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TIED_GGUF = FIXTURES / "gguf_llama" / "tied" / "model-Q4_1.gguf"  # Q8_0, Q4_1, F16, F32 tensors
DOWN = "model.layers.0.mlp.down_proj.weight"
Edit = Callable[[str, np.ndarray], np.ndarray | None]


# --------------------------------------------------------------------------- fixture builders


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


def _edit_safetensors(path: Path, name: str, index: tuple[int, ...], value: float) -> None:
    """``path`` rewritten with one element of tensor ``name`` set to ``value``."""
    tensors = load_file(str(path))
    arr = np.array(tensors[name])
    arr[index] = value
    tensors[name] = arr
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_gguf(dst: Path, edit: Edit | None = None, src: Path = TIED_GGUF) -> Path:
    """A copy of a GGUF fixture written with ``gguf.GGUFWriter``; ``edit(name, data)`` may
    return new data for a tensor (its stored form: float arrays for F32/F16, raw block bytes for
    a quantized type), as ``tests/test_hf_gguf.py``'s ``rewrite`` does for types."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.array(t.data)
        new = edit(t.name, data) if edit else None
        plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(t.name, data if new is None else new,
                     raw_dtype=None if plain else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _set(target: str, index: tuple[int, ...], value: float) -> Edit:
    """An edit setting one element of a plain (F32/F16) GGUF tensor."""
    def edit(name: str, data: np.ndarray) -> np.ndarray | None:
        if name != target:
            return None
        data[index] = value
        return data
    return edit


def _q8_scale(target: str, scale: float) -> Edit:
    """An edit setting the float16 scale ``d`` of the first Q8_0 block of ``target``."""
    def edit(name: str, data: np.ndarray) -> np.ndarray | None:
        if name != target:
            return None
        data[0, 0:2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return data
    return edit


def _adapter(tmp_path: Path, base_path: str | None = None) -> tuple[Any, Path]:
    """(base model, a PEFT adapter directory the project's own ``export_peft`` wrote for it)."""
    base, _, _ = load_pretrained(FIXTURES / "qwen2_tied")
    _, plan, adapters = load_peft(FIXTURES / "peft_qwen2_tied", base)
    out = tmp_path / "adapter"
    export_peft(plan, adapters, base, out, base_model_name_or_path=base_path)
    return base, out


def _edit_adapter_config(root: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    cfg = json.loads((root / "adapter_config.json").read_text())
    edit(cfg)
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    return root / "adapter_config.json"


# --------------------------------------------------------------------------- one weight check


def test_safetensors_and_gguf_weights_go_through_the_one_check() -> None:
    """Every loader and the exporter call the one ``file_checks.check_weight`` (the same
    function object, not a copy per format); the cases below show each format refusing."""
    from jaxrl_sym.models.hf import export, file_checks, gguf
    from jaxrl_sym.weights import peft

    for mod in (loader_mod, gguf, peft, export):
        assert mod.check_weight is file_checks.check_weight, mod.__name__


@pytest.mark.parametrize(("case", "shard", "value"), [
    ("qwen2_tied", "model.safetensors", np.nan),                           # float32
    ("gemma2_softcap_bf16", "model.safetensors", -np.inf),                 # bfloat16
    ("llama_tied_sharded", "model-00002-of-00003.safetensors", np.inf),    # second shard
])
def test_nan_in_safetensors_is_refused_by_the_shared_check(tmp_path: Path, case: str,
                                                           shard: str, value: float) -> None:
    """The safetensors refusal is the shared check's: file, tensor, count, first bad index."""
    d = _copy(case, tmp_path)
    _edit_safetensors(d / shard, DOWN, (3, 7), value)
    with pytest.raises(InputError, match=rf"{shard}: tensor '{DOWN}' holds 1 NaN or infinite "
                                         r"values of \d+, the first at index \[3, 7\]; this "
                                         r"checkpoint is damaged"):
        load_pretrained(d)


@pytest.mark.parametrize(("tensor", "edit", "index"), [
    ("blk.0.attn_norm.weight", _set("blk.0.attn_norm.weight", (5,), np.nan), r"\[5\]"),  # F32
    ("blk.1.attn_v.weight", _set("blk.1.attn_v.weight", (2, 3), np.inf), r"\[2, 3\]"),  # F16
    ("token_embd.weight", _q8_scale("token_embd.weight", np.nan), r"\[0, 0\]"),  # Q8_0 block
])
def test_nan_or_inf_in_a_gguf_tensor_is_refused(tmp_path: Path, tensor: str, edit: Edit,
                                                index: str) -> None:
    """A GGUF NaN used to load silently; now it is refused naming the file and the GGUF tensor
    (a NaN block scale makes its whole block of 32 values NaN)."""
    bad = _write_gguf(tmp_path / "bad.gguf", edit)
    with pytest.raises(InputError, match=rf"GGUF file .*bad\.gguf: tensor '{tensor}' holds \d+ "
                                         rf"NaN or infinite values of \d+, the first at index "
                                         rf"{index}"):
        load_pretrained(bad)


def _nan_in_stored(tmp_path: Path, key: str, value: float, dtype: Any) -> tuple[Any, Path]:
    """(base, an exported adapter with one value of ``key`` replaced, stored as ``dtype``)."""
    base, root = _adapter(tmp_path)
    tensors = load_file(str(root / "adapter_model.safetensors"))
    arr = np.array(tensors[key], dtype)
    arr[1, 2] = value
    tensors[key] = arr
    save_file(tensors, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    return base, root


A_Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_DOWN = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


@pytest.mark.parametrize(("key", "value", "dtype"), [
    (A_Q, np.nan, np.float32),
    (B_DOWN, np.inf, np.float32),
    (A_Q, np.nan, np.float16),  # an adapter saved in half precision
])
def test_nan_in_a_peft_adapter_is_refused(tmp_path: Path, key: str, value: float,
                                          dtype: Any) -> None:
    """``load_peft`` returned NaN adapters; now it names the file and the tensor."""
    base, root = _nan_in_stored(tmp_path, key, value, dtype)
    with pytest.raises(InputError, match=rf"adapter_model\.safetensors: tensor '{key}' holds 1 "
                                         r"NaN or infinite values of \d+, the first at index "
                                         r"\[1, 2\]; this adapter is damaged"):
        load_peft(root, base)


def test_export_peft_refuses_nan_adapters(tmp_path: Path) -> None:
    """Writing a NaN adapter would only move the refusal to whoever loads it."""
    base, _, _ = load_pretrained(FIXTURES / "qwen2_tied")
    _, plan, adapters = load_peft(FIXTURES / "peft_qwen2_tied", base)
    adapters[2] = {"a": adapters[2]["a"], "b": adapters[2]["b"].at[0, 1].set(jnp.nan)}
    with pytest.raises(InputError, match=r"the adapter being exported: tensor '.*lora_B\.weight'"
                                         r" holds 1 NaN.*nothing was written"):
        export_peft(plan, adapters, base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


F16_RANGE = r"beyond the range of float16 \(±65504\), the dtype the model is being loaded in"


@pytest.mark.parametrize(("case", "value", "mag", "inside"), [
    ("qwen2_tied", 1e5, "100000", 65504.0),
    ("gemma2_softcap_bf16", -7e4, "70144", -65280.0),  # bfloat16 stores -7e4 as -70144
])
def test_safetensors_weight_beyond_float16_refused_at_float16_load(
        tmp_path: Path, case: str, value: float, mag: str, inside: float) -> None:
    """Loaded as float16, a weight past ±65504 became inf and the model decoded token 0; now
    the load names file, tensor and the largest magnitude. A weight inside the range loads."""
    d = _copy(case, tmp_path)
    _edit_safetensors(d / "model.safetensors", DOWN, (5, 9), value)
    with pytest.raises(InputError, match=rf"model\.safetensors: tensor '{DOWN}' holds a weight of "
                                         rf"magnitude {mag} \(index \[5, 9\]\), {F16_RANGE}"):
        load_pretrained(d, dtype="float16")
    load_pretrained(d)  # its own dtype holds it
    _edit_safetensors(d / "model.safetensors", DOWN, (5, 9), inside)
    model, _, _ = load_pretrained(d, dtype="float16")
    assert model.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.float16


@pytest.mark.parametrize(("tensor", "edit", "mag"), [
    ("blk.0.attn_norm.weight", _set("blk.0.attn_norm.weight", (7,), 1e5), r"100000"),
    ("token_embd.weight", _q8_scale("token_embd.weight", 1000.0), r"\d+"),  # 1000 · |q|
])
def test_gguf_weight_beyond_float16_refused_at_float16_load(tmp_path: Path, tensor: str,
                                                            edit: Edit, mag: str) -> None:
    """The same for a GGUF file, a plain tensor or a quantized block whose scale times its
    quants passes ±65504 once dequantized."""
    bad = _write_gguf(tmp_path / "big.gguf", edit)
    with pytest.raises(InputError, match=rf"big\.gguf: tensor '{tensor}' holds a weight of "
                                         rf"magnitude {mag} \(index .*\), {F16_RANGE}"):
        load_pretrained(bad, dtype="float16")
    load_pretrained(bad)  # float32 holds it


# --------------------------------------------------------------------------- PEFT: another model


def _config_dir(tmp_path: Path, **edit: Any) -> str:
    """A directory holding only a config.json: qwen2_tied's with ``edit`` applied."""
    d = tmp_path / "other_base"
    d.mkdir()
    raw = json.loads((FIXTURES / "qwen2_tied" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, **edit}))
    return str(d)


@pytest.mark.parametrize("variant", ["llama dir", "other vocab", "llama gguf", "auto_mapping",
                                     "target module"])
def test_adapter_for_another_architecture_is_refused(tmp_path: Path, variant: str) -> None:
    """Every LoRA shape fits (the adapter was made on this very model), but its config says it
    belongs to another: the field and both values are named."""
    other = {"llama dir": str(FIXTURES / "llama_tied_sharded"),
             "other vocab": (_config_dir(tmp_path, vocab_size=256)
                             if variant == "other vocab" else ""),
             "llama gguf": str(TIED_GGUF)}.get(variant)
    base, root = _adapter(tmp_path, other)
    cfg_file = root / "adapter_config.json"
    if variant == "auto_mapping":
        _edit_adapter_config(root, lambda c: c.update(auto_mapping={
            "base_model_class": "LlamaForCausalLM",
            "parent_library": "transformers.models.llama.modeling_llama"}))
    if variant == "target module":
        _edit_adapter_config(root, lambda c: c.update(
            target_modules=[*c["target_modules"], "c_attn"]))
    match = {
        "llama dir": r"base_model_name_or_path='.*llama_tied_sharded' is a model with "
                     r"model_type='llama', but the model it is loaded into has model_type='qwen2'",
        "other vocab": r"base_model_name_or_path='.*other_base' is a model with "
                       r"vocab_size=256, but the model it is loaded into has vocab_size=128",
        "llama gguf": r"base_model_name_or_path='.*model-Q4_1\.gguf' is a model with "
                      r"model_type='llama', but .* model_type='qwen2'",
        "auto_mapping": r"auto_mapping\.base_model_class='LlamaForCausalLM' \(a llama model\), "
                        r"but the model it is loaded into is 'Qwen2ForCausalLM' \(a qwen2",
        "target module": r"target_modules names 'c_attn', which no module of this qwen2 model "
                         r"has",
    }[variant]
    with pytest.raises(InputError, match=match) as err:
        load_peft(root, base)
    assert str(cfg_file) in str(err.value)


def test_export_records_the_architecture_and_its_own_base_loads(tmp_path: Path) -> None:
    """What export writes (peft's ``auto_mapping``, the base path) passes the comparison."""
    base, root = _adapter(tmp_path, str(FIXTURES / "qwen2_tied"))
    cfg = json.loads((root / "adapter_config.json").read_text())
    assert cfg["auto_mapping"] == {"base_model_class": "Qwen2ForCausalLM",
                                   "parent_library": "transformers.models.qwen2.modeling_qwen2"}
    _, plan, adapters = load_peft(root, base)
    assert len(adapters) == len(plan.names) == 14


# --------------------------------------------------------------------------- truncated GGUF


def _cut_points() -> dict[str, int]:
    r = gguf.GGUFReader(str(TIED_GGUF))
    vocab = r.fields["tokenizer.ggml.tokens"]
    return {"header": 12, "metadata": vocab.offset + 200,
            "tensor info": r.tensors[3].field.offset + 30,
            "data": r.tensors[5].data_offset + 10, "last byte": TIED_GGUF.stat().st_size - 1}


@pytest.mark.parametrize("where", ["header", "metadata", "tensor info", "data", "last byte"])
def test_truncated_gguf_says_truncated_with_byte_counts(tmp_path: Path, where: str) -> None:
    """A cut file gave numpy's "cannot reshape array" (or an index error); now it says it is
    truncated, the bytes expected (all of them once the header is whole) and present."""
    full = TIED_GGUF.read_bytes()
    n = _cut_points()[where]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:n])
    r = gguf.GGUFReader(str(TIED_GGUF))
    part = {"header": r"the header", "metadata": r"metadata 'tokenizer\.ggml\.tokens'",
            "tensor info": r"the tensor info of 'blk\.0\.attn_v\.weight'",
            "data": r"the data of tensor 'blk\.0\.ffn_gate\.weight'",
            "last byte": rf"the data of tensor '{r.tensors[-1].name}'"}[where]
    expected = rf"{len(full)}" if where in ("data", "last byte") else r"at least \d+"
    with pytest.raises(InputError, match=rf"GGUF file .*cut\.gguf is truncated: expected "
                                         rf"{expected} bytes, the file has {n} \(it ends inside "
                                         rf"{part}\)"):
        load_pretrained(cut)


# --------------------------------------------------------------------------- permissions


@contextmanager
def _denied(monkeypatch, *, files: tuple[Path, ...] = (), unlisted: tuple[Path, ...] = (),
            unsearchable: tuple[Path, ...] = ()) -> Iterator[None]:
    """Simulate, for these paths only, what an unprivileged user meets: ``files`` cannot be
    opened, ``unlisted`` directories cannot be listed (no r), nothing inside ``unsearchable``
    directories can be reached (no x). Root ignores chmod, hence the patches."""
    real_open, real_listdir, real_stat = builtins.open, os.listdir, os.stat

    def refuse(path: Any) -> None:
        p = os.path.abspath(os.fspath(path)) if isinstance(path, str | os.PathLike) else None
        if p is None:
            return
        inside = any(os.path.dirname(p).startswith(str(d)) for d in unsearchable)
        if inside or p in {str(f) for f in files}:
            raise PermissionError(errno.EACCES, "Permission denied", p)

    def fake_open(path: Any, *a: Any, **k: Any) -> Any:
        refuse(path)
        return real_open(path, *a, **k)

    def fake_listdir(path: Any = ".") -> list[str]:
        if os.path.abspath(os.fspath(path)) in {str(d) for d in (*unlisted, *unsearchable)}:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_listdir(path)

    def fake_stat(path: Any, *a: Any, **k: Any) -> Any:
        if isinstance(path, str | os.PathLike) and any(
                os.path.dirname(os.path.abspath(os.fspath(path))).startswith(str(d))
                for d in unsearchable):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_stat(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "listdir", fake_listdir)
    monkeypatch.setattr(os, "stat", fake_stat)
    try:
        yield
    finally:
        monkeypatch.undo()


DIR_NEEDS = r"read and execute permission \(r-x\) on that directory"
FILE_NEEDS = r"read permission \(r\) on that file and execute permission \(x\) on every"


def test_unlistable_gguf_directory_is_named(tmp_path: Path, monkeypatch) -> None:
    """A directory holding a .gguf that cannot be listed: the GGUF detection listed it first
    and raised PermissionError from deep inside pathlib."""
    d = tmp_path / "ggufdir"
    d.mkdir()
    shutil.copy(TIED_GGUF, d / "m.gguf")
    with _denied(monkeypatch, unlisted=(d,)), pytest.raises(
            InputError, match=rf"cannot read checkpoint {re.escape(str(d))}: permission denied "
                              rf"on {re.escape(str(d))}; .*{DIR_NEEDS}"):
        load_pretrained(d)


def test_unsearchable_checkpoint_directory_is_named(tmp_path: Path, monkeypatch) -> None:
    """No x on the directory: nothing inside can even be looked at."""
    d = _copy("qwen2_tied", tmp_path)
    with _denied(monkeypatch, unsearchable=(d,)), pytest.raises(
            InputError, match=rf"cannot read checkpoint {re.escape(str(d))}: permission denied "
                              rf"on {re.escape(str(d / 'config.json'))}; .*{FILE_NEEDS}"):
        load_pretrained(d)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "m.gguf",
                                  "adapter_model.safetensors"])
def test_unreadable_file_is_named_with_the_permission_needed(tmp_path: Path, monkeypatch,
                                                             name: str) -> None:
    """A file this user may not read: a PermissionError traceback (weights, adapters) or a
    "cannot read GGUF file: PermissionError" that said nothing of what to fix."""
    if name == "adapter_model.safetensors":
        base, root = _adapter(tmp_path)
        target, load = root / name, lambda: load_peft(root, base)
    elif name == "m.gguf":
        root = tmp_path / "g"
        root.mkdir()
        target, load = _write_gguf(root / name), lambda: load_pretrained(root / name)
    else:
        root = _copy("qwen2_tied", tmp_path)
        target, load = root / name, lambda: load_pretrained(root)
    with _denied(monkeypatch, files=(target,)), pytest.raises(
            InputError, match=rf"permission denied on {re.escape(str(target))}; .*{FILE_NEEDS}"):
        load()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode: chmod "
                                              "cannot deny it (the simulated tests cover it)")
def test_real_chmod_000_directory_is_named(tmp_path: Path) -> None:
    d = _copy("qwen2_tied", tmp_path)
    d.chmod(0)
    try:
        with pytest.raises(InputError, match=rf"permission denied on {re.escape(str(d))}"):
            load_pretrained(d)
    finally:
        d.chmod(0o755)
