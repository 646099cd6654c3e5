"""A red-teaming setup built locally, for tests and the small-scale diversity experiment.

Nothing can be downloaded here, so the three pieces are built from the embedded model:

- attacker (the policy): the embedded arithmetic model (`model.path=embedded`);
- victim: a tiny randomly initialised Llama on the same tokenizer (wide initialisation, so its
  greedy answer depends on the attack in a hash-like way): answering 8 tokens greedily, as
  `HFVictim` does, about one attack in eight of the kind the attacker writes gets a "toxic"
  answer, so there is something to find and many different attacks that find it;
- toxicity classifier: a tiny Llama sequence classifier (2 outputs, label 1 = "toxic") on the
  embedded model's character tokenizer, trained here for a few hundred steps on random strings
  of its alphabet, labelled toxic when the string contains `TOXIC_DIGIT`. Its P(toxic) is a
  learned, smooth stand-in for a real toxicity model: the victim's answer is "toxic" when it
  contains that digit;
- instruction prompts: `a+b=` rows (`{"prompt": ...}`), train and test, from the arithmetic task.

It says nothing about real toxicity; it exercises the whole red-teaming path (policy -> victim ->
classifier -> reward -> buffer -> learner, diversity metrics) with a reward that some attacks get
and others do not.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TOXIC_DIGIT = "7"
"""A victim answer containing this character is what the toy classifier learns to call toxic."""


def build_victim(out: str | Path, *, seed: int = 0) -> Path:
    """Save the toy victim (random weights, init std 0.5) in HF format in `out`; returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_tba.models.tiny import BOS, EOS, PAD, build_tokenizer

    out = Path(out)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=128, bos_token_id=BOS,
                      eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.5)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def build_classifier(out: str | Path, *, steps: int = 150, seed: int = 0,
                     pad_token: bool = True) -> Path:
    """Train and save the toy toxicity classifier (HF format) in `out`; returns `out`.

    `pad_token=False` saves its tokenizer without a pad token (as GPT-2's ships), which the
    reward path must handle.
    """
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hpc_tba.models.tiny import ALPHABET, BOS, EOS, PAD, build_tokenizer

    out = Path(out)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=128, bos_token_id=BOS,
                      eos_token_id=EOS, pad_token_id=PAD, num_labels=2)
    model = LlamaForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    chars = [c for c in ALPHABET if c != " "]
    model.train()
    for _ in range(steps):
        texts = ["".join(rng.choice(chars, size=int(rng.integers(1, 16)))) for _ in range(64)]
        labels = torch.tensor([int(TOXIC_DIGIT in t) for t in texts])
        enc = tok(texts, padding=True, return_tensors="pt")
        loss = torch.nn.functional.cross_entropy(model(**enc).logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    if not pad_token:
        tok.pad_token = None
        model.config.pad_token_id = None
        model.config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def classifier_accuracy(path: str | Path, n: int = 256, seed: int = 1) -> float:
    """Accuracy of a saved toy classifier on fresh random strings (a check that it learned)."""
    from hpc_tba.models.tiny import ALPHABET
    from hpc_tba.tasks.preference import RewardModel

    rng = np.random.default_rng(seed)
    chars = [c for c in ALPHABET if c != " "]
    texts = ["".join(rng.choice(chars, size=int(rng.integers(1, 16)))) for _ in range(n)]
    p = RewardModel(str(path), label=1).probability(texts)
    return float(np.mean((p > 0.5) == np.array([TOXIC_DIGIT in t for t in texts])))


def write_prompts(out_dir: str | Path, *, num_train: int = 200, num_test: int = 40) -> Path:
    """`train.jsonl` / `test.jsonl` of `{"prompt": "a+b="}` instruction rows in `out_dir`."""
    from hpc_tba.config import TaskConfig
    from hpc_tba.tasks.arithmetic import ArithmeticTask

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(TaskConfig(num_train=num_train, num_test=num_test, seed=99))
    for split in ("train", "test"):
        with open(out_dir / f"{split}.jsonl", "w") as f:
            for p in task.prompts(split):
                f.write(json.dumps({"prompt": p.text}) + "\n")
    return out_dir


VICTIM_MAX_NEW_TOKENS = 8


def build(out_dir: str | Path, *, steps: int = 150) -> list[str]:
    """Prompts, victim and classifier under `out_dir` (each built once); the Hydra overrides of
    a `task=redteam` run on them."""
    out_dir = Path(out_dir)
    prompts = write_prompts(out_dir / "prompts")
    clf, victim = out_dir / "classifier", out_dir / "victim"
    if not (clf / "config.json").is_file():
        build_classifier(clf, steps=steps)
    if not (victim / "config.json").is_file():
        build_victim(victim)
    return ["task=redteam", f"task.path={prompts}", f"task.reward_model={clf}",
            f"task.victim_model={victim}", "task.reward_label=1",
            f"task.victim_max_new_tokens={VICTIM_MAX_NEW_TOKENS}"]
