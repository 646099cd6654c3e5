"""Which checkpoint tensor fills which model parameter, named exactly as transformers names it.

A Hugging Face checkpoint's tensor names are not always the model's parameter names:
transformers renames on load (`conversion_mapping.get_model_conversion_mapping`: per-class
renames such as GPT-NeoX's `embed_out` -> `lm_head`, the legacy `LayerNorm.gamma/beta`, a user
`key_mapping`) and adds or strips the base-model prefix (hub GPT-2 stores `h.0.*`, the model has
`transformer.h.0.*`). `plan_load` applies transformers' own `rename_source_key` to every key of
the checkpoint, so the learner's streamed ZeRO-3 load reads the same tensor `from_pretrained`
would, and checks every parameter has one, of the right shape, before any tensor data is read.

`Checkpoint` reads safetensors (one file or a sharded index) or `.bin` files (one or an index)
through `torch.load(weights_only=True, mmap=True)`: no code runs, and a tensor's bytes are read
only when `tensor()` asks for it, so each rank's memory holds one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with the reason in words (one line)."""


def model_config(path: str):
    """The directory's transformers config, or a ModelLoadError naming why it has none."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        raise ModelLoadError(f"{path}: unknown architecture: transformers does not know model_type "
                             f"{model_type!r} ({str(e).strip().splitlines()[0]})") from e


def check_causal_lm(path: str, config) -> None:
    """Raise a ModelLoadError unless transformers has a causal-LM class for `config`."""
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping.keys():
        raise ModelLoadError(f"{path}: unknown architecture: model_type {config.model_type!r} "
                             f"({getattr(config, 'architectures', None)}) has no causal-LM class in "
                             "transformers (AutoModelForCausalLM)")


_FORMATS = (  # transformers' order of preference
    ("model.safetensors.index.json", "safetensors"), ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "bin"), ("pytorch_model.bin", "bin"))


class Checkpoint:
    """The tensors of a model directory, by checkpoint key; opened lazily, one file at a time."""

    def __init__(self, path: str):
        self.path = path
        for name, kind in _FORMATS:
            if os.path.isfile(os.path.join(path, name)):
                self.kind = kind
                files = self._index(os.path.join(path, name)) if name.endswith(".json") else None
                break
        else:
            raise ModelLoadError(f"{path}: no weights (none of {', '.join(n for n, _ in _FORMATS)})")
        self._files = files  # key -> file, from the index (None: one file)
        self._single = os.path.join(path, name) if files is None else None
        self._open: dict[str, object] = {}  # file -> safetensors handle or mmap'd state dict
        self.shapes = self._read_shapes()
        """Checkpoint key -> shape, from headers (no tensor data read)."""

    def _index(self, index: str) -> dict[str, str]:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {k: os.path.join(self.path, v) for k, v in weight_map.items()}
        absent = sorted({f for f in out.values() if not os.path.isfile(f)})
        if absent:
            raise ModelLoadError(f"{index} names shard files that are not there: {absent[:3]}")
        return out

    def _handle(self, file: str):
        if file not in self._open:
            if self.kind == "safetensors":
                from safetensors import safe_open

                self._open[file] = safe_open(file, "pt")
            else:
                self._open[file] = _load_bin(file)
        return self._open[file]

    def _read_shapes(self) -> dict[str, tuple[int, ...]]:
        files = sorted(set(self._files.values())) if self._files is not None else [self._single]
        shapes = {}
        for file in files:
            h = self._handle(file)
            if self.kind == "safetensors":
                shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
            else:
                shapes.update({k: tuple(t.shape) for k, t in h.items()})
        return shapes

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor, read now (the only moment its bytes are touched)."""
        file = self._files[key] if self._files is not None else self._single
        h = self._handle(file)
        return h.get_tensor(key) if self.kind == "safetensors" else h[key]

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load_bin(file: str) -> dict[str, torch.Tensor]:
    """A `.bin` state dict, memory-mapped (weights_only: a pickle that would run code is refused)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise ModelLoadError(f"{file}: not a loadable weights file: {str(e).strip().splitlines()[0]}") from e
        # the legacy (pre-zip) format cannot be mapped: read whole, once, still weights only
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for anything but plain tensors
        raise ModelLoadError(f"{file}: refused: not a plain tensor file ({str(e).strip().splitlines()[0]})") from e


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    params: dict[str, str]
    """Model parameter name -> checkpoint key holding it (tied parameters: their source's key)."""
    buffers: dict[str, str]
    """Persistent model buffer name -> checkpoint key, for buffers the checkpoint stores."""


def plan_load(model: torch.nn.Module, ckpt: Checkpoint, *, key_mapping: dict[str, str] | None = None) -> LoadPlan:
    """Map every parameter of `model` to its checkpoint tensor, as transformers' loader would.

    Raises a ModelLoadError naming the first parameters with no tensor, or with the wrong shape.
    Checkpoint keys the model does not use are ignored (as transformers ignores them).
    """
    params = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    buffers = {n: tuple(b.shape) for n, b in _persistent_buffers(model)}
    renamed = checkpoint_to_model_names(model, list(ckpt.shapes), key_mapping=key_mapping)
    found: dict[str, str] = {}
    for key, name in renamed.items():
        found.setdefault(name, key)
    tied = dict(getattr(model, "all_tied_weights_keys", {}) or {})  # target -> source
    where = {}
    for name in params:
        key = found.get(name, found.get(tied.get(name, "")))
        if key is not None:
            where[name] = key
    missing = [n for n in params if n not in where]
    if missing:
        raise ModelLoadError(f"{ckpt.path}: missing tensor: the checkpoint has nothing for {len(missing)} "
                             f"parameter(s) of {type(model).__name__}, first {missing[:3]} (checkpoint keys "
                             f"look like {sorted(ckpt.shapes)[:3]})")
    wrong = [(n, where[n], ckpt.shapes[where[n]], s) for n, s in params.items() if ckpt.shapes[where[n]] != s]
    if wrong:
        n, key, got, want = wrong[0]
        raise ModelLoadError(f"{ckpt.path}: shape mismatch: {key} is {got}, parameter {n} of "
                             f"{type(model).__name__} is {want} ({len(wrong)} tensor(s) differ)")
    bufs = {n: found[n] for n in buffers if n in found and ckpt.shapes[found[n]] == buffers[n]}
    return LoadPlan(where, bufs)


def _persistent_buffers(model: torch.nn.Module):
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def checkpoint_to_model_names(model: torch.nn.Module, keys: list[str], *,
                              key_mapping: dict[str, str] | None = None) -> dict[str, str]:
    """Checkpoint key -> the model's name for it (only keys that name a model tensor).

    transformers' renames and base-model prefix handling; a key that transformers would fuse or
    split (a `WeightConverter`, e.g. per-expert MoE tensors) is a ModelLoadError: it has no
    one-tensor-to-one-parameter streaming.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model, key_mapping)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    names = {n: True for n, _ in model.named_parameters()}
    names.update({n: True for n, _ in _persistent_buffers(model)})
    prefix = getattr(model, "base_model_prefix", None) or None
    out = {}
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters, base_model_prefix=prefix,
                                            meta_state_dict=names)
        if converter is not None and name in names:
            raise ModelLoadError(f"checkpoint tensor {key!r} is fused or split by transformers ({converter!r} "
                                 f"-> {name}); such checkpoints are not streamed: convert it with "
                                 "save_pretrained first")
        if name in names:
            out[key] = name
    return out
