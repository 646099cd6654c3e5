"""The learner's DeepSpeed config: every option that changes what is computed, from the config.

`deepspeed_config` is used by the learner (policy and reference), the planner (its ZeRO options
and gradient dtype) and the tests; tests/test_settings.py builds engines from it and reads the
values back.
"""
from __future__ import annotations

from hpc_tba.config import LearnerConfig


def deepspeed_config(cfg: LearnerConfig, *, micro_batch: int, train: bool) -> dict:
    """The DeepSpeed config of the policy (train) or the frozen reference (not train).

    Gradient accumulation is driven by the learner (one backward per micro-batch, one step per
    learner step, `Learner.train_step`), so DeepSpeed's own counter stays at 1.

    Every option that changes what is computed is written here from the config, never left to
    DeepSpeed's default (defaults move between releases; 0.19.8's `gradient_clipping` default is
    1.0): clipping, ZeRO stage, precision flags, the dtypes of parameters, of gradients summed
    across micro-batches (fp32, also for bf16 runs) and of the gradient reduction, and how
    gradients are averaged over ranks. Options that only move memory or time (buckets, overlap,
    prefetch) keep DeepSpeed's values, except the persistence threshold, which is a config field.
    learner.tensor_parallel_size > 1 adds the AutoTP section with our own split
    (roles.tensor_parallel.ds_section). tests/test_settings.py and tests/test_tensor_parallel.py
    build engines and read the values back.
    """
    bf16 = cfg.dtype == "bf16"
    if bf16 and cfg.zero_stage == 0:
        raise ValueError("learner.dtype=bf16 needs learner.zero_stage 1-3 (got 0): without ZeRO, "
                         "DeepSpeed sums bf16 gradients across micro-batches in bf16, not fp32")
    ds = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        # Always written: DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT, 1.0 in 0.19.8) would clip
        # every run that left it out, and learner.grad_clip=0 means no clipping (0.0 turns it off).
        "gradient_clipping": float(cfg.grad_clip) if train else 0.0,
        "zero_optimization": {"stage": cfg.zero_stage,
                              "stage3_param_persistence_threshold": cfg.param_persistence_threshold,
                              "zero_quantized_weights": False, "zero_quantized_gradients": False,
                              "zero_quantized_nontrainable_weights": False},
        "bf16": {"enabled": bf16, "bf16_master_weights_and_grads": False,
                 "bf16_optimizer_states": False, "immediate_grad_update": False,
                 "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "data_types": {"param_dtype": cfg.dtype,
                       # the sum over a step's micro-batches: fp32 (bf16's 8 bits of mantissa
                       # lose small micro-batch gradients next to large ones)
                       "grad_accum_dtype": "fp32",
                       # buffers the model's transformers class keeps in fp32 (as transformers does)
                       "keep_in_fp32_modules": "auto"},
        # the gradient all-reduce / reduce-scatter: in the training dtype, averaged over the
        # learner ranks (the loss normaliser, Learner.train_step, assumes the mean), unscaled
        "communication_data_type": cfg.dtype,
        "gradient_allreduce_op": "mean",
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    # A memory option DeepSpeed would not apply must not be dropped silently: the run would need
    # the device memory the user configured away.
    if cfg.offload_params and cfg.zero_stage != 3:
        raise ValueError(f"learner.offload_params needs learner.zero_stage=3 (got {cfg.zero_stage}): "
                         "DeepSpeed offloads parameter shards only under ZeRO-3")
    if cfg.offload_optimizer and cfg.zero_stage == 0:
        raise ValueError("learner.offload_optimizer needs learner.zero_stage 1-3 (got 0): DeepSpeed "
                         "offloads only ZeRO-partitioned optimizer states")
    if cfg.tensor_parallel_size > 1:  # AutoTP (roles.tensor_parallel); 1: no section, AutoTP off
        from hpc_tba.roles.tensor_parallel import ds_section

        ds["tensor_parallel"] = ds_section(cfg.tensor_parallel_size)
    if cfg.offload_params:
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload_optimizer and train:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        ds["zero_force_ds_cpu_optimizer"] = False  # the learner hands DeepSpeed torch's AdamW
    return ds
