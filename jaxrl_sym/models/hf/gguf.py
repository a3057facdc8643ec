"""GGUF files (llama.cpp's format) read: metadata → config, tensors → HF names, dequantized.

``load_pretrained`` hands a ``.gguf`` file (or a directory holding exactly one, and no
``config.json``) to :func:`~jaxrl_sym.models.hf.gguf_model.load_gguf`, which builds the model
from what this module reads. Why it is built this way:

* **One config, one parameter table.** The file's ``{arch}.*`` metadata is turned into the dict
  ``config.json`` would hold and given to :func:`~jaxrl_sym.models.hf.config.parse_config`, and
  each GGUF tensor name (``blk.3.ffn_up.weight``) is renamed to transformers' name
  (``model.layers.3.mlp.up_proj.weight``) and placed by the shared ``parameter_targets``.
  A GGUF model is thus exactly the model a Hugging Face directory gives; only the reading
  differs. Both maps transcribe transformers' GGUF loader (``integrations/ggml.py``
  ``GGUF_CONFIG_MAPPING`` and gguf-py's tensor name map it uses), the oracle of the tests.
* **Dequantize one tensor at a time** with ``gguf.quants.dequantize`` (the GGUF reader maps the
  file; a tensor's blocks are read only when it is dequantized), then transpose, cast and put
  on the device before the next — never two copies of the weights.
* **llama.cpp's q/k permutation is undone.** Its converter reorders the rows of each q/k head
  from rotate-half pairs ``(i, i + d/2)`` to adjacent pairs ``(2i, 2i + 1)`` (the RoPE its
  kernels use); ``_unpermute`` applies the inverse, as transformers' ``LlamaTensorProcessor``.
  Qwen2/Qwen3 files are written without it.
* **Fail before reading.** Architecture, every tensor's type (can this ``gguf`` package
  dequantize it?), names and shapes are checked from the header; an unsupported quantization
  type is an error naming the file, the tensor and the type, before any block is decoded.
* **Nothing silent.** Every tensor passes the loaders' one ``check_weight`` as it is
  dequantized (NaN/inf, or beyond the dtype the model is loaded in); a file cut short is reported
  as truncated with the bytes expected and present (gguf-py says "cannot reshape array"); a path
  this user may not read is named with the permission it needs (:func:`refuse_unreadable`, also
  the loaders' boundary).

This module is JAX-free and imports no other reader (the CLI checks ``--model`` with
:func:`find_gguf` before JAX is loaded); the tokenizer and chat template live in
:mod:`jaxrl_sym.models.hf.gguf_text`, the model building in :mod:`~jaxrl_sym.models.hf.gguf_model`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.file_checks import (
    MAGIC,
    check_weight,
    denied,
    refuse_unreadable,
    truncation,
)

# general.architecture -> (model_type for parse_config, q/k rows permuted by llama.cpp)
ARCHS: dict[str, tuple[str, bool]] = {"llama": ("llama", True), "qwen2": ("qwen2", False),
                                      "qwen3": ("qwen3", False)}
# GGUF tensor name pieces -> transformers' (gguf-py's TENSOR_MAPPINGS, read backwards)
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.1+ scaling)


def is_gguf_file(path: str | Path) -> bool:
    """A regular file named ``*.gguf`` or starting with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the single ``*.gguf`` of a directory that has no
    ``config.json`` (a Hugging Face directory wins). None when ``path`` is neither; several
    ``.gguf`` files in one directory is an error naming them (which one is meant is unknowable).
    """
    p = Path(path)
    with refuse_unreadable("checkpoint", p):  # listing a directory this user may not read
        if is_gguf_file(p):
            return p
        if not p.is_dir() or (p / "config.json").exists():
            return None
        files = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(files) > 1:
        raise InputError(f"{p} holds {len(files)} GGUF files ({', '.join(f.name for f in files)})"
                         "; pass the one to load as the path")
    return files[0] if files else None


def _field_value(field: Any) -> Any:
    """A metadata value as Python: str, int/float/bool, or a list of those (arrays)."""
    import gguf

    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    part = field.parts[field.data[0]]
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


@dataclass(frozen=True)
class GGUFFile:
    """One opened GGUF file: its path, metadata values and tensors (not yet read)."""

    path: Path
    reader: Any  # gguf.GGUFReader

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else _field_value(field)

    @property
    def arch(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise InputError(f"GGUF file {self.path} has no general.architecture in its "
                             "metadata; it is not a model file llama.cpp wrote")
        return arch

    @property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """GGUFReader parses every metadata string in Python (seconds for a 49k-token vocabulary);
    the model and its text are read from the same file, so the last one opened is kept."""
    import gguf

    try:
        return GGUFFile(Path(path), gguf.GGUFReader(path, "r"))
    except PermissionError as err:
        raise denied(err, "GGUF file", path) from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        # a cut file reaches the reader as a numpy reshape or index error: say what happened
        raise (truncation(Path(path)) or InputError(
            f"cannot read GGUF file {path}: {type(err).__name__}: {err}")) from None


def open_gguf(path: str | Path) -> GGUFFile:
    """The file parsed by ``gguf.GGUFReader``; a malformed, truncated or unreadable one is an
    error naming it (and, cut short, the bytes it needs and has)."""
    p = Path(path).resolve()
    try:
        with refuse_unreadable("GGUF file", path):
            st = p.stat()
    except OSError as err:
        raise InputError(f"cannot read GGUF file {path}: {err}") from None
    return _open_cached(str(p), st.st_mtime_ns, st.st_size)


def _meta_int(g: GGUFFile, key: str, default: int | None = None) -> int:
    val = g.get(key, default)
    if isinstance(val, list) and val and all(v == val[0] for v in val):
        val = val[0]  # a per-layer array with one value (some converters write head_count so)
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise InputError(f"GGUF file {g.path}: metadata {key}={val!r} must be an int >= 1")
    return val


def _meta_float(g: GGUFFile, key: str, default: float) -> float:
    val = g.get(key, default)
    if isinstance(val, bool) or not isinstance(val, int | float) or not 0 < val < float("inf"):
        raise InputError(f"GGUF file {g.path}: metadata {key}={val!r} must be a number > 0")
    return float(val)


def config_dict(g: GGUFFile) -> dict[str, Any]:
    """The ``config.json`` dict transformers builds from this file's metadata.

    The head is tied exactly when the file has no ``output.weight`` (llama.cpp omits it then).
    ``head_dim`` is ``attention.key_length`` or ``rope.dimension_count`` (transformers reads the
    latter), else hidden / heads; the vocabulary is ``{arch}.vocab_size``, else the token list's
    length, else the embedding's rows.
    """
    arch = g.arch
    if arch not in ARCHS:
        raise InputError(f"GGUF file {g.path} holds a {arch!r} model; this loader reads the "
                         f"GGUF architectures {', '.join(ARCHS)} (or convert the model to a "
                         "Hugging Face directory and load that)")
    a = f"{arch}."
    hidden = _meta_int(g, a + "embedding_length")
    heads = _meta_int(g, a + "attention.head_count")
    key = next((a + k for k in ("attention.key_length", "rope.dimension_count")
                if a + k in g.reader.fields), None)
    head_dim = _meta_int(g, key) if key else hidden // heads
    _check_rope(g, a, head_dim)
    tensors = g.tensors
    vocab = g.get(a + "vocab_size") or len(g.get("tokenizer.ggml.tokens") or []) or (
        int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else None)
    raw: dict[str, Any] = {
        "model_type": ARCHS[arch][0],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(g, a + "attention.head_count_kv", heads),
        "num_hidden_layers": _meta_int(g, a + "block_count"),
        "intermediate_size": _meta_int(g, a + "feed_forward_length"),
        "rms_norm_eps": _meta_float(g, a + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _meta_float(g, a + "rope.freq_base", 10000.0),
        "max_position_embeddings": _meta_int(g, a + "context_length", 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(".attn_output.bias") for n in tensors),
    }
    if key:
        raw["head_dim"] = head_dim
    scaling = g.get(a + "rope.scaling.type")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear",
                               "factor": _meta_float(g, a + "rope.scaling.factor", 1.0)}
    return raw


def _check_rope(g: GGUFFile, a: str, head_dim: int) -> None:
    """Only what this model computes: RoPE over the whole head, no YaRN-style scaling."""
    rope_dim = g.get(a + "rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim:
        raise InputError(f"GGUF file {g.path}: {a}rope.dimension_count={rope_dim} != head "
                         f"dimension {head_dim} (partial RoPE) is not supported by this loader")
    scaling = g.get(a + "rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise InputError(f"GGUF file {g.path}: {a}rope.scaling.type={scaling!r} is not "
                         "supported; this loader implements the default RoPE, 'linear' "
                         "scaling and llama.cpp's rope_freqs tensor (Llama 3.1+)")


def hf_name(gguf_name: str) -> str | None:
    """transformers' name for a GGUF tensor, or None for one this loader does not know."""
    base, _, leaf = gguf_name.rpartition(".")
    if base in _TOP and leaf in ("weight", "bias"):
        return f"{_TOP[base]}.{leaf}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def _dequantizable(qtype: Any) -> bool:
    """Whether the installed ``gguf`` package can decode blocks of this type (asked, not
    listed: newer gguf releases add types)."""
    import gguf

    try:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def check_types(g: GGUFFile) -> None:
    """Every tensor's type must be one the ``gguf`` package dequantizes."""
    import gguf

    ok: dict[Any, bool] = {}
    for t in g.reader.tensors:
        qtype = t.tensor_type
        if qtype not in ok:
            ok[qtype] = _dequantizable(qtype)
        if not ok[qtype]:
            version = getattr(gguf, "__version__", None) or _dist_version("gguf")
            raise InputError(
                f"GGUF file {g.path}: tensor {t.name!r} has quantization type {qtype.name}, "
                f"which the installed gguf package ({version}) cannot dequantize. Re-quantize "
                "the model to a supported type with llama.cpp's llama-quantize (e.g. Q8_0, "
                "Q4_K_M or F16), or install a gguf release that dequantizes "
                f"{qtype.name}")


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown version"


def tensor_map(g: GGUFFile, targets: dict[str, Any]) -> dict[str, Any]:
    """HF name → GGUF tensor for every parameter; names and shapes checked, nothing read.

    ``targets`` is the shared ``parameter_targets(model)``, so the parameter table is the
    Hugging Face one. A GGUF tensor with no parameter is an error, except ``rope_freqs``
    (folded into RoPE).
    """
    by_hf: dict[str, Any] = {}
    for name, t in g.tensors.items():
        hf = hf_name(name)
        if name == ROPE_FREQS:
            continue
        if hf is None or hf not in targets:
            raise InputError(f"unexpected tensor {name!r} in GGUF file {g.path}: a "
                             f"{g.arch} model with this metadata has no such parameter "
                             f"({hf or 'no transformers name'}); the file's variant of the "
                             "architecture is not supported")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        if shape != targets[hf].hf_shape:
            raise InputError(f"tensor {name!r} in GGUF file {g.path} has shape {list(shape)}, "
                             f"but its metadata implies {list(targets[hf].hf_shape)} for "
                             f"{hf}; the tensors do not match the metadata")
        by_hf[hf] = t
    missing = sorted(set(targets) - set(by_hf))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"GGUF file {g.path} lacks the tensor for {missing[0]!r}{more} that "
                         f"a {g.arch} model with its metadata needs")
    return by_hf


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k ``permute`` (rows of each head from adjacent RoPE pairs back
    to rotate-half halves); ``LlamaTensorProcessor._reverse_permute_weights``."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantized(t: Any, cfg: Any, permuted: bool) -> np.ndarray:
    """One tensor as float32 in transformers' layout (``[out, in]`` for a Linear), refused if
    it holds NaN/inf or a value beyond ``cfg.dtype``'s range — the safetensors loader's own
    check (imported here, not at the top: this module stays JAX-free until a model loads)."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    check_weight(arr, t.name, f"GGUF file {getattr(t.data, 'filename', None) or '?'}",
                 None if t.name == ROPE_FREQS else cfg.dtype)  # rope factors stay float32
    if permuted and ".attn_q." in t.name:
        arr = _unpermute(arr, cfg.num_heads)
    elif permuted and ".attn_k." in t.name:
        arr = _unpermute(arr, cfg.num_kv_heads)
    return arr


def default_dtype(g: GGUFFile) -> str:
    """The dtype a file of only half-precision matrices is in; quantized or F32: float32
    (transformers' ``GgufHeader.dtype``)."""
    import gguf

    q = gguf.GGMLQuantizationType
    types = {t.tensor_type for t in g.reader.tensors}
    if not types <= {q.F32, q.F16, q.BF16}:
        return "float32"
    return "bfloat16" if q.BF16 in types else "float16" if q.F16 in types else "float32"
