"""Loading a Hugging Face causal LM for the learner, sharded at construction under ZeRO-3.

With ZeRO-3 the model is built under `deepspeed.zero.Init`, so each rank allocates only its
shard of every parameter (a 70B model never exists whole in one process), and the checkpoint's
safetensors are streamed in one tensor at a time: learner rank 0 reads a tensor lazily and
DeepSpeed scatters it to the owners (`GatheredParameters(modifier_rank=0)`). This is what
transformers' own DeepSpeed integration does, without requiring `accelerate`.
"""
from __future__ import annotations

import json
import os

import torch


def _tensor_index(path: str) -> dict[str, str]:
    """Parameter name -> safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path} has no model.safetensors (or index): only safetensors "
                                "checkpoints are loaded (no pickle)")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def load_causal_lm(path: str, *, dtype: torch.dtype, zero3_config: dict | None, rank: int):
    """The model at `path`; under ZeRO-3 (a DeepSpeed config dict) partitioned as it is built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if zero3_config is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        check_dtype(model, dtype, where=path)
        return model
    import deepspeed
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(path)
    # Random init of empty shards is wasted work (every tensor is loaded next) and transformers'
    # initialisers index into parameters that are partitioned away, so it is switched off.
    # The dtype travels in the DeepSpeed config, not as zero.Init's `dtype`: DeepSpeed 0.19's
    # `dtype or fp16 if fp16_supported else bf16 if ...` makes an explicit fp32 bf16 on every
    # accelerator without fp16 (the CPU accelerator on CPUs without mkldnn fp16).
    with _no_init_weights(), deepspeed.zero.Init(config_dict_or_path=_with_precision(zero3_config, dtype)):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_dtype(model, dtype, where=path)
    where = _tensor_index(path) if rank == 0 else {}
    handles: dict[str, object] = {}
    try:
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank != 0:
                    continue
                key = name if name in where else _tied_source(name, where, config)
                f = handles.get(where[key]) or handles.setdefault(where[key], safe_open(where[key], "pt"))
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, the model "
                                     f"expects {tuple(param.shape)}")
                param.data.copy_(tensor.to(dtype))
    finally:
        handles.clear()
    return model


def _with_precision(ds_config: dict, dtype: torch.dtype) -> dict:
    """`ds_config` with its bf16/fp16 sections saying exactly `dtype`, which zero.Init then uses."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ZeRO-3 builds fp32, bf16 or fp16 parameters, not {dtype}")
    out = dict(ds_config)
    out["bf16"] = {**ds_config.get("bf16", {}), "enabled": dtype == torch.bfloat16}
    out["fp16"] = {**ds_config.get("fp16", {}), "enabled": dtype == torch.float16}
    return out


def check_dtype(model: torch.nn.Module, dtype: torch.dtype, *, where: str) -> None:
    """Every parameter (its ZeRO-3 shard included) is `dtype`; raise naming the first that is not."""
    for name, param in model.named_parameters():
        shard = getattr(param, "ds_tensor", None)
        for what, t in (("parameter", param), ("ZeRO-3 shard of", shard)):
            if t is not None and t.dtype != dtype:
                raise TypeError(f"{where}: {what} {name} is {t.dtype}, the config asked for {dtype}")


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _tied_source(name: str, where: dict[str, str], config) -> str:
    """A tied output embedding is stored once, as the input embedding."""
    if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
        for key in ("model.embed_tokens.weight", "transformer.wte.weight"):
            if key in where:
                return key
    raise KeyError(f"checkpoint has no tensor {name!r}")
