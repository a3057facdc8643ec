"""PEFT adapter directories in and out for Hugging Face :class:`CausalLM` models.

``export_peft(plan, adapters, model, out_dir)`` writes what peft's ``save_pretrained`` writes for
a LoRA adapter — ``adapter_config.json`` and ``adapter_model.safetensors`` with tensors
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` —
so ``PeftModel.from_pretrained(base, out_dir)`` in transformers + peft gives our model's logits.
``load_peft(adapter_dir, model)`` reads such a directory back into ``(LoraConfig, LoraPlan,
adapters)``; ``export_merged`` writes the merged model as a plain checkpoint.

Why it is built this way:

* **One name table.** Module names come from :func:`jaxrl_sym.models.hf.targets
  .parameter_targets`, the loader's and exporter's own table: the HF tensor
  ``model.layers.0.self_attn.q_proj.weight`` is the kernel ``model.layers.0.self_attn.q_proj
  .kernel``, so the PEFT module is the tensor name without ``.weight``. Layouts follow from
  NNX's ``[in, out]`` kernels: our ``A`` ``[in, r]`` is PEFT's ``lora_A.weight`` transposed.
* **Refuse, never approximate.** A configuration whose adapter is not ``W + alpha/r · B A`` on
  Linear weights — rsLoRA's ``alpha/sqrt(r)``, DoRA's magnitudes, trained biases,
  ``fan_in_fan_out``, per-module ranks or alphas, layer subsets, extra trained modules, an
  embedding or norm named as a target, an initialisation that rewrote the base (PiSSA, OLoRA,
  CorDA, LoftQ) — is an ``InputError`` naming the file and key, as is a missing or extra tensor.
  ``lora_dropout`` is accepted and dropped: it only acts in training, and a loaded adapter
  continues with dropout 0 (:mod:`.lora_config` says why).
* **An adapter for another model is refused**, even when every LoRA shape fits (a Llama and a
  Qwen2 of one size share them): ``auto_mapping`` (written on export: peft's own field for the
  base class), the base at ``base_model_name_or_path`` when it is on this machine (resolved like
  peft, from the working directory) and each ``target_modules`` name are compared with the model,
  naming the field and both values. A NaN adapter is refused by the loader's ``check_weight``.
* **Atomic** like :func:`~jaxrl_sym.models.hf.export.export_pretrained`: written into a temporary
  directory renamed into place, so a crash never leaves a half adapter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.config import parse_config
from jaxrl_sym.models.hf.export import (
    DEFAULT_MAX_SHARD_BYTES,
    check_out_dir,
    export_pretrained,
    swap_into_place,
)
from jaxrl_sym.models.hf.file_checks import check_readable, check_weight, refuse_unreadable
from jaxrl_sym.models.hf.gguf import config_dict, find_gguf, open_gguf
from jaxrl_sym.models.hf.modeling import CausalLM
from jaxrl_sym.models.hf.safetensors_io import (
    ST_DTYPES,
    read_header,
    read_tensor,
    write_safetensors,
)
from jaxrl_sym.models.hf.targets import parameter_targets
from jaxrl_sym.models.hf.text import read_json
from jaxrl_sym.weights.lora import Adapter, LoraPlan, merged_model, named_leaves, plan_lora
from jaxrl_sym.weights.lora_config import ALL_LINEAR, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel → LoraModel → the transformers model
_HEAD = "lm_head"  # left out of "all-linear" by peft for a causal LM (its output embedding)
# Initialisations that change the base weights: such an adapter only fits the modified base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# model_type → transformers' class, recorded as peft's auto_mapping so a loader can tell which
# architecture an adapter was made for (peft itself ignores it when task_type is set).
_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# HFConfig field → config.json key: the fields that make two models different architectures
_ARCH_FIELDS = {"model_type": "model_type", "vocab_size": "vocab_size",
                "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
_ADAPTER_DAMAGED = ("this adapter is damaged (NaN adapters mean its training diverged): export "
                    "it again from an earlier step (--step)")


def _empty(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


# adapter_config.json keys whose non-default value this module cannot represent, and why.
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_rslora": (_empty, "rank-stabilised scaling alpha/sqrt(r)"),
    "use_dora": (_empty, "DoRA's magnitude vectors"),
    "bias": (lambda v: v in (None, "none"), "trained biases (only bias='none' is supported)"),
    "lora_bias": (_empty, "a bias on lora_B"),
    "fan_in_fan_out": (_empty, "Conv1D-layout weights (fan_in_fan_out)"),
    "modules_to_save": (_empty, "fully trained extra modules (modules_to_save)"),
    "layers_to_transform": (_empty, "adapters on a subset of layers (layers_to_transform)"),
    "layers_pattern": (_empty, "layers_pattern"),
    "rank_pattern": (_empty, "per-module ranks (rank_pattern)"),
    "alpha_pattern": (_empty, "per-module alphas (alpha_pattern)"),
    "exclude_modules": (_empty, "exclude_modules"),
    "target_parameters": (_empty, "adapters on raw parameters (target_parameters)"),
    "trainable_token_indices": (_empty, "trainable token embeddings"),
    "layer_replication": (_empty, "layer replication"),
    "alora_invocation_tokens": (_empty, "activated LoRA (aLoRA)"),
    "use_qalora": (_empty, "QA-LoRA"),
    "use_bdlora": (_empty, "block-diagonal LoRA"),
}


def linear_modules(model: CausalLM) -> dict[str, str]:
    """PEFT module name → dotted path of its kernel, for every Linear of ``model``, from the
    loader's own table (``model.layers.0.mlp.up_proj`` → ``model.layers.0.mlp.up_proj.kernel``)."""
    return {name.removesuffix(".weight"): ".".join(str(p) for p in t.path)
            for name, t in parameter_targets(model).items() if t.transpose}


def _other_modules(model: CausalLM) -> set[str]:
    """Modules that hold parameters but no Linear kernel (embedding, norms)."""
    linear = linear_modules(model)
    return {name.rpartition(".")[0] for name in parameter_targets(model)} - set(linear)


# --------------------------------------------------------------------------- export


def target_modules_for(modules: Sequence[str], model: CausalLM) -> list[str]:
    """peft's ``target_modules`` for exactly these modules: the short names (``q_proj``) when
    peft's suffix rule on them selects exactly this set, else the full module names."""
    short = sorted({m.rpartition(".")[2] for m in modules})
    chosen = {m for m in linear_modules(model) if m.rpartition(".")[2] in short}
    return short if chosen == set(modules) else sorted(modules)


def peft_config(plan: LoraPlan, model: CausalLM, modules: Sequence[str],
                base_model_name_or_path: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` dict: peft's ``LoraConfig`` fields that decide the adapter,
    each with the value of this plan, plus the long-standing bookkeeping fields (fields added
    in recent peft releases are left to their defaults, so older peft reads the file too);
    ``auto_mapping`` records the base's architecture, which :func:`check_base` compares."""
    alpha = plan.cfg.alpha
    return {
        "alpha_pattern": {}, "auto_mapping": auto_mapping(model.cfg.model_type),
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": plan.rank,
        "rank_pattern": {}, "revision": None,
        "target_modules": target_modules_for(modules, model), "task_type": "CAUSAL_LM",
        "use_dora": False, "use_rslora": False,
    }


def family(model_type: str) -> str:
    """transformers' package of a model type (``gemma3_text`` lives in ``models/gemma3``)."""
    return model_type.removesuffix("_text")


def auto_mapping(model_type: str) -> dict[str, str] | None:
    """peft's ``auto_mapping`` for the base class of this model type (None: unknown)."""
    cls = _CLASSES.get(model_type)
    fam = family(model_type)
    return None if cls is None else {"base_model_class": cls,
                                     "parent_library": f"transformers.models.{fam}.modeling_{fam}"}


def _modules_of(plan: LoraPlan, model: CausalLM) -> list[str]:
    by_path = {path: module for module, path in linear_modules(model).items()}
    missing = [n for n in plan.names if n not in by_path]
    if missing:
        raise InputError(f"LoRA target {missing[0]} is not a Linear weight of this Hugging Face "
                         "model, so a PEFT adapter cannot name it; plan the adapters on this "
                         "model (plan_lora(model, cfg))")
    return [by_path[n] for n in plan.names]


def _write_atomically(out: Path, write: Any) -> None:
    """``write(tmp)`` into a temporary directory beside ``out``, then swapped into place as
    :func:`~jaxrl_sym.models.hf.export.export_pretrained` does."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_peft(plan: LoraPlan, adapters: Sequence[Adapter], model: CausalLM,
                out_dir: str | Path, *, base_model_name_or_path: str | None = None,
                overwrite: bool = False) -> list[str]:
    """Write ``adapters`` as a PEFT LoRA adapter directory transformers + peft load.

    ``model`` is the base :class:`CausalLM` the plan was made on (it supplies module names).
    Returns the names of the files written. A non-empty ``out_dir`` is refused unless
    ``overwrite``.
    """
    if not isinstance(model, CausalLM):
        raise InputError(f"export_peft needs a jaxrl_sym.models.hf CausalLM, got "
                         f"{type(model).__name__}")
    if len(adapters) != len(plan.names):
        raise InputError(f"export_peft got {len(adapters)} adapters for a plan of "
                         f"{len(plan.names)} targets")
    modules = _modules_of(plan, model)
    out = Path(out_dir).absolute()
    base_dir = base_model_name_or_path  # a hub name is no path: nothing of it to overwrite
    check_out_dir(out, None, overwrite, {"the base model": base_dir if base_dir is not None
                                         and Path(base_dir).exists() else None})
    tensors: dict[str, np.ndarray] = {}
    for module, (n_in, n_out), ad in zip(modules, plan.shapes, adapters, strict=True):
        a, b = np.asarray(ad["a"], np.float32), np.asarray(ad["b"], np.float32)
        if a.shape != (n_in, plan.rank) or b.shape != (plan.rank, n_out):
            raise InputError(f"adapter for {module} has shapes {a.shape}, {b.shape}; the plan "
                             f"wants {(n_in, plan.rank)}, {(plan.rank, n_out)}")
        for part, arr in (("lora_A", a.T), ("lora_B", b.T)):  # loading would refuse NaN
            name = f"{PREFIX}{module}.{part}.weight"
            check_weight(arr, name, "the adapter being exported", remedy="nothing was written. "
                         "NaN adapters mean the run diverged: export an earlier step (--step)")
            tensors[name] = np.ascontiguousarray(arr)
    config = peft_config(plan, model, modules, base_model_name_or_path)

    def write(tmp: Path) -> None:
        specs = {n: (t.shape, t.dtype) for n, t in tensors.items()}
        write_safetensors(tmp / ADAPTER_WEIGHTS, specs, tensors.__getitem__,
                          metadata={"format": "pt"})  # transformers/peft want a format
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    _write_atomically(out, write)
    return sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])


def export_merged(plan: LoraPlan, adapters: Sequence[Adapter], model: CausalLM,
                  out_dir: str | Path, *, source_dir: str | Path, overwrite: bool = False,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """The merged model (``W + scale · A @ B`` in each target, in the base's dtype) written by
    :func:`export_pretrained` as a plain checkpoint: no peft needed to load it."""
    return export_pretrained(merged_model(model, plan, adapters), out_dir, source_dir=source_dir,
                             overwrite=overwrite, max_shard_bytes=max_shard_bytes)


# --------------------------------------------------------------------------- load


def _check_config(raw: dict[str, Any], file: Path) -> None:
    """Every key whose value this module cannot represent, refused by name."""
    if raw.get("peft_type") != "LORA":
        raise InputError(f"{file}: peft_type={raw.get('peft_type')!r}; only LORA adapters can "
                         "be loaded")
    if raw.get("task_type") not in (None, "CAUSAL_LM"):
        raise InputError(f"{file}: task_type={raw.get('task_type')!r}; only CAUSAL_LM adapters "
                         "fit a causal LM")
    for key, (ok, what) in _REFUSED.items():
        if not ok(raw.get(key)):
            raise InputError(f"{file}: {key}={raw[key]!r} is not supported ({what}); only plain "
                             "LoRA W + lora_alpha/r · B A on Linear weights can be loaded")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise InputError(f"{file}: init_lora_weights={init!r} changes the base weights at "
                         "initialisation, so this adapter only fits that modified base; convert "
                         "it to a plain LoRA with peft (path_initial_model_for_weight_conversion)")
    for key in ("r", "lora_alpha"):
        val = raw.get(key)
        if not isinstance(val, int | float) or isinstance(val, bool) or val <= 0:
            raise InputError(f"{file}: {key}={val!r} must be a positive number")
    if not isinstance(raw["r"], int):
        raise InputError(f"{file}: r={raw['r']!r} must be an integer")


def _recorded_family(mapping: Any) -> str | None:
    """The transformers family ``auto_mapping`` names: ``parent_library``'s package
    (``transformers.models.llama.…``), else ``base_model_class``'s prefix (``LlamaFor…``)."""
    if not isinstance(mapping, dict):
        return None
    lib, cls = mapping.get("parent_library"), mapping.get("base_model_class")
    m = re.match(r"transformers\.models\.(\w+)\.", lib) if isinstance(lib, str) else None
    if m is None and isinstance(cls, str):
        m = re.fullmatch(r"([A-Za-z0-9]+?)(?:For[A-Z]\w*|LMHeadModel|Model)", cls)
    return m.group(1).lower() if m else None


def _base_config(base: Any) -> dict[str, Any] | None:
    """The config of the base ``base_model_name_or_path`` records, when it is a checkpoint on
    this machine (a Hugging Face directory or a GGUF file); None for a hub name or anything
    unreadable (nothing here to compare with)."""
    if not isinstance(base, str) or not base:
        return None
    root = Path(base)
    try:
        if (root / "config.json").is_file():
            return read_json(root / "config.json", "config")
        g = find_gguf(root)
        return config_dict(open_gguf(g)) if g is not None else None
    except (InputError, OSError):
        return None


def check_base(raw: dict[str, Any], model: CausalLM, file: Path) -> None:
    """Refuse an adapter made for another model whose tensors happen to fit this one (a Llama
    and a Qwen2 of one size share every LoRA shape): the architecture ``auto_mapping`` records,
    and the base ``base_model_name_or_path`` names when it is on this machine, must be the
    model's own (family, vocabulary, sizes, layers, heads)."""
    ours = model.cfg
    mine = family(ours.model_type)
    fam = _recorded_family(raw.get("auto_mapping"))
    if fam is not None and fam != mine:
        cls = raw["auto_mapping"].get("base_model_class")
        raise InputError(f"{file}: auto_mapping.base_model_class={cls!r} (a {fam} model), but "
                         f"the model it is loaded into is {_CLASSES.get(ours.model_type)!r} (a "
                         f"{mine} model); this adapter was made for another architecture")
    base = raw.get("base_model_name_or_path")
    theirs_raw = _base_config(base)
    if theirs_raw is None:
        return
    try:
        theirs: Any = parse_config(theirs_raw)
    except InputError:  # an architecture this loader does not build: compare its model_type
        theirs = None
    for field, key in _ARCH_FIELDS.items():
        if theirs is None and field != "model_type":
            break
        other = theirs_raw.get(key) if theirs is None else getattr(theirs, field)
        if other != getattr(ours, field):
            raise InputError(f"{file}: base_model_name_or_path={base!r} is a model with "
                             f"{key}={other!r}, but the model it is loaded into has "
                             f"{key}={getattr(ours, field)!r}; this adapter was made for "
                             "another model — load it into its base")


def _check_target_names(target_modules: list[str], model: CausalLM, every: Sequence[str],
                        file: Path) -> None:
    """Each name of a ``target_modules`` list must name a module of this model: a name only
    another architecture has (GPT-2's ``c_attn``) means the adapter was made for that one."""
    for t in target_modules:
        if not any(m == t or m.endswith(f".{t}") for m in every):
            short = sorted({m.rpartition(".")[2] for m in linear_modules(model)})
            raise InputError(f"{file}: target_modules names {t!r}, which no module of this "
                             f"{model.cfg.model_type} model has (its Linear modules are "
                             f"{', '.join(short)}); this adapter was made for another "
                             "architecture")


def resolve_modules(target_modules: Any, model: CausalLM, file: Path) -> list[str]:
    """The model's modules peft would wrap for ``target_modules`` (a list: exact names or
    ``.``-suffixes; a string: ``re.fullmatch``; ``"all-linear"``: every Linear but the head),
    in the loader table's order; each must be a Linear."""
    linear = linear_modules(model)
    every = [*linear, *sorted(_other_modules(model))]
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        chosen = [m for m in linear if m.rpartition(".")[2] != _HEAD]
    elif isinstance(target_modules, str):
        chosen = [m for m in every if re.fullmatch(target_modules, m)]
    elif isinstance(target_modules, list) and all(isinstance(t, str) for t in target_modules):
        chosen = [m for m in every
                  if m in target_modules or any(m.endswith(f".{t}") for t in target_modules)]
    else:
        raise InputError(f"{file}: target_modules={target_modules!r} must be a list of module "
                         "names or a regular expression")
    if not chosen:
        raise InputError(f"{file}: target_modules={target_modules!r} match no module of this "
                         f"model; its Linear modules are e.g. {', '.join(list(linear)[:4])}")
    if isinstance(target_modules, list):  # some names match, another is foreign
        _check_target_names(target_modules, model, every, file)
    for m in chosen:
        if m not in linear:
            raise InputError(f"{file}: target_modules={target_modules!r} select {m}, which is "
                             "not a Linear layer (an embedding or a norm); only LoRA on Linear "
                             "weights can be loaded")
    return chosen


def targets_regex(modules: Sequence[str], model: CausalLM) -> str:
    """A ``LoraConfig.targets`` that selects exactly these modules' kernels: the short form
    ``.*\\.(?:q_proj|v_proj)\\.kernel`` when it does, else the paths spelled out."""
    linear = linear_modules(model)
    paths = [linear[m] for m in modules]
    short = sorted({m.rpartition(".")[2] for m in modules})
    regex = r".*\.(?:" + "|".join(re.escape(s) for s in short) + r")\.kernel"
    hits = {n for n, _ in named_leaves(model) if re.fullmatch(regex, n)}
    if hits == set(paths):
        return regex
    return "(?:" + "|".join(re.escape(p) for p in paths) + ")"


def _read_tensors(file: Path, modules: Sequence[str], shapes: Sequence[tuple[int, int]],
                  rank: int) -> list[Adapter]:
    """lora_A/lora_B of each module from ``file``, checked by name, shape and dtype."""
    start, header = read_header(file)
    names = {k for k in header if k != "__metadata__"}
    wanted: dict[str, tuple[int, int]] = {}
    for m, (n_in, n_out) in zip(modules, shapes, strict=True):
        wanted[f"{PREFIX}{m}.lora_A.weight"] = (rank, n_in)
        wanted[f"{PREFIX}{m}.lora_B.weight"] = (n_out, rank)
    extra = sorted(names - set(wanted))
    if extra:
        raise InputError(f"{file} holds tensor {extra[0]!r}, which a plain LoRA on the modules "
                         "adapter_config.json targets does not have (DoRA, embedding or "
                         "bias adapters, or a module outside target_modules)")
    arrays: dict[str, np.ndarray] = {}
    with open(file, "rb") as fh:
        for key, shape in wanted.items():
            entry = header.get(key)
            if entry is None:
                raise InputError(f"{file} lacks tensor {key!r} (target_modules select its module)")
            if tuple(entry["shape"]) != shape or entry["dtype"] not in ST_DTYPES:
                raise InputError(f"tensor {key!r} in {file} is {entry['dtype']}{entry['shape']}; "
                                 f"expected a floating tensor of shape {list(shape)}")
            arr = read_tensor(fh, start, entry, key)
            check_weight(arr, key, file, np.float32, remedy=_ADAPTER_DAMAGED)
            arrays[key] = arr.astype(np.float32)
    return [{"a": jnp.asarray(arrays[f"{PREFIX}{m}.lora_A.weight"].T),
             "b": jnp.asarray(arrays[f"{PREFIX}{m}.lora_B.weight"].T)} for m in modules]


def load_peft(adapter_dir: str | Path, model: CausalLM,
              ) -> tuple[LoraConfig, LoraPlan, list[Adapter]]:
    """Read a PEFT LoRA adapter directory made for ``model``'s architecture.

    Returns ``(cfg, plan, adapters)`` with adapters in the plan's order (float32, our layout:
    ``a = lora_A.weight.T``, ``b = lora_B.weight.T``), ready for :func:`merged_leaves`.
    """
    root = Path(adapter_dir)
    if not isinstance(model, CausalLM):
        raise InputError(f"load_peft needs a jaxrl_sym.models.hf CausalLM, got "
                         f"{type(model).__name__}")
    with refuse_unreadable("PEFT adapter", root):  # the user's directory named, no traceback
        return _load(root, model)


def _load(root: Path, model: CausalLM) -> tuple[LoraConfig, LoraPlan, list[Adapter]]:
    """:func:`load_peft`'s body, inside its permission boundary."""
    cfg_file, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not cfg_file.is_file():
        raise InputError(f"{root} has no {ADAPTER_CONFIG}; point at a PEFT adapter directory")
    check_readable(cfg_file, "adapter config")
    raw = read_json(cfg_file, "adapter config")
    _check_config(raw, cfg_file)
    check_base(raw, model, cfg_file)
    if not weights.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization=True)" if (
            root / "adapter_model.bin").exists() else ""
        raise InputError(f"{root} has no {ADAPTER_WEIGHTS}{extra}")
    modules = resolve_modules(raw.get("target_modules"), model, cfg_file)
    cfg = LoraConfig(rank=raw["r"], alpha=raw["lora_alpha"], dropout=0.0,
                     targets=targets_regex(modules, model))
    plan = plan_lora(model, cfg)
    by_path = {p: m for m, p in linear_modules(model).items()}
    ordered = [by_path[n] for n in plan.names]
    if set(ordered) != set(modules):  # the table and the state's paths disagree: a bug here
        raise AssertionError(f"LoRA plan {plan.names} does not cover modules {modules}")
    return cfg, plan, _read_tensors(weights, ordered, plan.shapes, plan.rank)
