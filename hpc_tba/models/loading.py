"""Loading a Hugging Face causal LM for the learner, sharded at construction under ZeRO-3.

With ZeRO-3 the model is built under `deepspeed.zero.Init`, so each rank allocates only its
shard of every parameter (a 70B model never exists whole in one process), and the checkpoint is
streamed in one tensor at a time: learner rank 0 reads a tensor lazily (safetensors, or a
`.bin` memory-mapped through `torch.load(weights_only=True)`, never a pickle that runs code) and
DeepSpeed scatters it to the owners (`GatheredParameters(modifier_rank=0)`).

transformers' own ZeRO-3 path merges the whole state dict on every rank first; this one does
not, but it names tensors exactly as transformers does (`models.checkpoint_keys`: the model's
conversion mapping, legacy renames, base-model prefix), so any checkpoint `from_pretrained`
accepts for a causal LM loads here. Every rank plans the load from the checkpoint's index and
headers alone (no tensor data), so a missing tensor or a shape mismatch is found before the first
collective, by every rank at once, and reported as one `ModelLoadError`.
"""
from __future__ import annotations

import torch

from hpc_tba.models.checkpoint_keys import Checkpoint, ModelLoadError, check_causal_lm, model_config, plan_load
from hpc_tba.models.construction import building

__all__ = ["ModelLoadError", "check_dtype", "load_causal_lm"]


def load_causal_lm(path: str, *, dtype: torch.dtype, zero3_config: dict | None, rank: int,
                   weights: bool = True):
    """The model at `path`; under ZeRO-3 (a DeepSpeed config dict) partitioned as it is built.

    Dropout is switched off: the learner's log-probs must be those of the policy the engines
    sample from (no dropout in vLLM), or every ratio and TB residual carries dropout noise and the
    sync probe cannot agree (GPT-2's hub config has 0.1 everywhere; issue 19's GPT-2 gap).
    `weights=False` (ZeRO-3): the parameters are left unset, for a policy that a checkpoint
    overwrites next (a resume then reads no base weights: 141 GB at 70B); buffers still load.
    Built under `construction.building()`: zero.Init patches module construction process-wide.
    """
    with building():
        return _load(path, dtype=dtype, zero3_config=zero3_config, rank=rank, weights=weights)


def _load(path: str, *, dtype: torch.dtype, zero3_config: dict | None, rank: int, weights: bool):
    config = without_dropout(model_config(path))
    if zero3_config is None:
        model = _from_pretrained(path, config, dtype)
        check_dtype(model, dtype, where=path)
        _no_dropout_left(model, path)
        return model
    import deepspeed

    # Random init of empty shards is wasted work (every tensor is loaded next) and transformers'
    # initialisers index into parameters that are partitioned away, so it is switched off.
    # The dtype travels in the DeepSpeed config, not as zero.Init's `dtype`: DeepSpeed 0.19's
    # `dtype or fp16 if fp16_supported else bf16 if ...` makes an explicit fp32 bf16 on every
    # accelerator without fp16 (the CPU accelerator on CPUs without mkldnn fp16).
    with _no_init_weights(), deepspeed.zero.Init(config_dict_or_path=_with_precision(zero3_config, dtype)):
        model = _from_config(path, config, dtype)
        # no_init_weights also skips tying; untied, a tied head would be a second matrix that
        # trains apart from the embedding (and that vLLM, which ties it, never receives)
        model.tie_weights()
    check_dtype(model, dtype, where=path)
    _no_dropout_left(model, path)
    with Checkpoint(path) as ckpt:
        plan = plan_load(model, ckpt)  # every rank, from headers only: errors before any collective
        for name, param in model.named_parameters() if weights else ():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.data.copy_(ckpt.tensor(plan.params[name]).to(dtype))
        buffers = dict(model.named_buffers())
        for name, key in plan.buffers.items():  # not partitioned: every rank loads its copy
            buffers[name].copy_(ckpt.tensor(key).to(buffers[name].dtype))
    return model


def without_dropout(config):
    """`config` with every dropout probability 0 (`*dropout*`, GPT-2's `*_pdrop`), nested ones too."""
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            without_dropout(value)
    return config


def _no_dropout_left(model: torch.nn.Module, where: str) -> None:
    left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if left:
        raise ModelLoadError(f"{where}: dropout still active in {left[:3]} after the config's dropout "
                             "fields were zeroed; this architecture names its dropout differently")


def _from_config(path: str, config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    check_causal_lm(path, config)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _from_pretrained(path: str, config, dtype: torch.dtype):
    """transformers' own loader, with a missing or mismatched tensor an error (not a random init)."""
    from transformers import AutoModelForCausalLM

    check_causal_lm(path, config)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                           output_loading_info=True)
    except (ValueError, OSError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: {str(e).strip().splitlines()[0]}") from e
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(info.get("missing_keys", ())) - tied)
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint has no tensor for {len(missing)} parameter(s) of "
                             f"{type(model).__name__}, first {missing[:3]}")
    if info.get("mismatched_keys"):
        raise ModelLoadError(f"{path}: tensors with the wrong shape: {sorted(info['mismatched_keys'])[:3]}")
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
