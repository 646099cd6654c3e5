"""The learner's DeepSpeed engines: the policy (trained) and the frozen reference, built under
ZeRO-3 from the config (roles.ds_config) with the learner's parallel layout: Ulysses attention
(roles.parallel) or AutoTP (roles.tensor_parallel, refused by name before the build's first
collective and read back after it). Dtypes are asserted on every parameter and shard."""
from __future__ import annotations

import torch

from hpc_tba.config import AlgoConfig, LearnerConfig
from hpc_tba.losses import needs
from hpc_tba.roles import parallel, tensor_parallel
from hpc_tba.roles.ds_config import deepspeed_config


def build_engines(cfg: LearnerConfig, loss: AlgoConfig, model_path: str, *, micro: int, lrank: int,
                  sp: parallel.SequenceParallel, tp: parallel.Peers, resume_from: str | None):
    """(policy engine, reference engine or None, pad token id) of this learner rank."""
    import deepspeed
    from transformers import AutoTokenizer

    from hpc_tba.models.loading import check_dtype, load_causal_lm

    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    ds_train = deepspeed_config(cfg, micro_batch=micro, train=True)
    zero3 = ds_train if cfg.zero_stage == 3 else None
    # a resume overwrites every policy tensor: under ZeRO-3 it reads no base weights for it
    policy = load_causal_lm(model_path, dtype=dtype, zero3_config=zero3, rank=lrank,
                            weights=resume_from is None)
    parallel.enable(policy, sp)  # Ulysses attention when learner.sequence_parallel_size > 1
    if tp.enabled:  # refused by name before any collective of the engine's build
        tensor_parallel.check_model(policy, tp.size)
    if cfg.gradient_checkpointing:  # non-reentrant: the variant that works under ZeRO-3
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            weight_decay=0.0)
    warmup = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    # (AutoTP replaces the split layers' parameters; DeepSpeed re-points the optimizer to them)
    engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=opt, lr_scheduler=sched, config=ds_train)
    check_dtype(engine.module, dtype, where=f"learner.dtype={cfg.dtype}: the policy")
    if tp.enabled:
        tensor_parallel.check_engine(engine, tp, vocab_size=policy.config.vocab_size)
    ref = None
    if needs(loss).reference:
        ref_model = load_causal_lm(model_path, dtype=dtype, zero3_config=zero3, rank=lrank).eval()
        ref_model.requires_grad_(False)
        parallel.enable(ref_model, sp)
        ref, *_ = deepspeed.initialize(model=ref_model, config=deepspeed_config(cfg, micro_batch=micro, train=False))
        check_dtype(ref.module, dtype, where=f"learner.dtype={cfg.dtype}: the reference model")
        if tp.enabled:
            tensor_parallel.check_engine(ref, tp, vocab_size=ref_model.config.vocab_size)
    pad = AutoTokenizer.from_pretrained(model_path).pad_token_id
    return engine, ref, 0 if pad is None else pad
