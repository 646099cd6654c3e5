"""Weight names between the learner (transformers' parameter names) and vLLM's loader.

The learner broadcasts its parameters under transformers' *model* names. vLLM's `load_weights`
for an architecture expects *checkpoint* names, the ones `save_pretrained` writes: for most
architectures these are the same, but where transformers renames on load they differ (GPT-NeoX:
the model's `lm_head.weight` is `embed_out.weight` on disk and in vLLM's GPTNeoXForCausalLM, which
would otherwise fail with an unknown name). `EngineNames` applies transformers' own reversed
conversion mapping (`revert_weight_conversion`'s renames) to every name, computed once per model
from its config on the meta device (no weights).

`refresh_tied_heads` fixes a stale copy vLLM's CPU build keeps: a tied output layer
(`lm_head.weight is embed_tokens.weight`, GPT-2, Gemma, ...) gets its own prepacked GEMM weight
(`cpu_linear`, oneDNN or sgl-kernel) when the model is first loaded. An in-place reload updates
the shared tensor and repacks the embedding, but vLLM's layer-wise reload never processes the head
(no tensor is loaded under its name: checkpoints store a tied head once), so the engine kept
computing logits with the weights it started with. This was the GPT-2 sync gap of issue 19 (0.12
after a reload of perturbed weights): every other GPT-2 tensor, Conv1D transposes included,
arrived exactly.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch


class EngineNames:
    """Learner (transformers model) parameter name -> the checkpoint name vLLM loads it under."""

    def __init__(self, model_path: str):
        self.mapping = _engine_name_map(model_path)

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Renamed lazily, one tensor at a time: a streamed version (`staging=stream`) is never
        held whole (a list here kept every bucket alive until the load ended)."""
        m = self.mapping
        for n, t in named_tensors:
            yield m.get(n, n), t
            del t  # the caller's loader holds the only reference from here on


@functools.lru_cache(maxsize=8)
def _engine_name_map(model_path: str) -> dict[str, str]:
    """Only the names that change (an empty dict for most architectures)."""
    from transformers import AutoModelForCausalLM

    from hpc_tba.models.checkpoint_keys import check_causal_lm, model_config
    from hpc_tba.models.construction import building

    config = model_config(model_path)
    check_causal_lm(model_path, config)
    try:
        with building(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except AssertionError:
        # vLLM's Transformers backend (GPT-NeoX, Phi, OLMo ...) decorates transformers' decoder
        # class in place once an engine of it was built in this process; that class then wants
        # a vLLM config to be constructed at all
        from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
        from vllm.config.compilation import CompilationMode

        no_compile = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
        with building(), set_current_vllm_config(no_compile), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return model_to_checkpoint_names(model, [n for n, _ in model.named_parameters()])


def model_to_checkpoint_names(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """name -> checkpoint name, for the `names` that transformers renames when it saves `model`.

    transformers' `revert_weight_conversion` without the tensors: the model's conversion mapping
    (no legacy renames, no prefix changes, as `save_pretrained` does for a model built from a
    config), reversed. Fusing converters are not renames: a name they would split raises.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                   if not isinstance(c, PrefixChange)]
    if not conversions:
        return {}
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    out = {}
    for name in names:
        renamed, converter = rename_source_key(name, renamings, converters, reverse=True)
        if converter is not None:
            raise ValueError(f"parameter {name} is stored split or fused on disk ({converter!r}); "
                             "weight sync sends one tensor per parameter and cannot name it for vLLM")
        if renamed != name:
            out[name] = renamed
    return out


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Rebuild the CPU-prepacked GEMM of every output layer that shares its weight with another
    module (run on the vLLM model after each in-place reload); returns how many were rebuilt.

    Only modules that keep such a copy (`cpu_linear`, vLLM's CPU build) and whose weight tensor is
    another module's too; the embedding method's `process_weights_after_loading` keeps the weight
    (`remove_weight=False`), so running it again is safe. On GPU nothing matches.
    """
    owners: dict[int, int] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor):
            owners[id(w)] = owners.get(id(w), 0) + 1
    rebuilt = 0
    for mod in model.modules():
        w, method = getattr(mod, "weight", None), getattr(mod, "quant_method", None)
        if (hasattr(mod, "cpu_linear") and isinstance(w, torch.Tensor) and owners.get(id(w), 0) > 1
                and method is not None and w.numel() > 0):
            method.process_weights_after_loading(mod)
            rebuilt += 1
    return rebuilt
