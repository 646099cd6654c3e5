"""Tiny random models of real Hugging Face architectures, built locally (tests, presets' stand-ins).

Nothing is downloaded: a byte-level BPE tokenizer is trained with `tokenizers` on a small local
corpus and saved as a `PreTrainedTokenizerFast`; the model is the architecture's own transformers
class with random weights, width 128 and two heads (head_dim 64, the least vLLM's CPU attention
takes), saved in Hugging Face format. `layout` writes the checkpoint the way real hub models are
stored where that differs from transformers' own `save_pretrained`:

- `hub`: GPT-2 without its `transformer.` prefix (`h.0.attn...`, as openai-community/gpt2), and
  GPT-NeoX with its output layer as `embed_out` (as EleutherAI/pythia): the names transformers
  renames on load, which a loader that reads tensors by parameter name gets wrong.
- `bin`: `pytorch_model.bin` instead of safetensors.
- `sharded`: safetensors split over two files with a `model.safetensors.index.json`.

`chat=True` gives the tokenizer a Llama-3-style chat template (header and end-of-turn tokens as
specials, BOS written by the template) and makes it add BOS itself when encoding, as Llama's
does: the Instruct presets' (`tba_8b`, `tba_70b`) prompt path, one BOS after formatting.
`build_reward_model` writes a one-output sequence classifier of the same architecture on the
same tokenizer (a random reward model: the preference task's scorer, e.g. for `tldr_pythia`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi", "olmo", "gpt_neox", "gpt2")
"""Architectures `build_stand_in` knows (transformers `model_type`)."""
LAYOUTS = ("save_pretrained", "hub", "bin", "sharded")

_CORPUS = ["Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether in April and May?",
           "Answer: 48 / 2 = 24 clips in May. 48 + 24 = 72. The answer is 72.",
           "SUBREDDIT: r/relationships TITLE: advice POST: my friend never answers. TL;DR:",
           "Human: How do I bake bread? Assistant: Mix flour, water, salt and yeast, then wait.",
           "[MATH TASK] Problem:\n12 + 30 = ?\n\nSolution:\n42"]


CHAT_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
"""Llama 3's chat template in shape (BOS in the text, role headers, end-of-turn token)."""


def build_tokenizer(vocab_size: int = 384, *, chat: bool = False):
    """A byte-level BPE tokenizer trained here, with pad/bos/eos/unk specials at ids 0-3; `chat`
    adds the chat specials and template and a BOS the tokenizer adds itself (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"] + (CHAT_SPECIALS if chat else [])
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=CHAT_SPECIALS)
    out.chat_template = CHAT_TEMPLATE
    return out


def _config(arch: str, vocab: int, *, tie: bool | None):
    """The architecture's config at stand-in size (2 layers, width 128, head_dim 64)."""
    import transformers as tf

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    dec = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=2, max_position_embeddings=256, **ids)
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=2, n_positions=256, **ids)
    elif arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(**dec, rotary_pct=0.25, use_parallel_residual=True)
    elif arch == "phi":
        cfg = tf.PhiConfig(**dec, partial_rotary_factor=0.5)
    elif arch == "gemma":
        cfg = tf.GemmaConfig(**dec, num_key_value_heads=1, head_dim=64)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**dec, num_key_value_heads=1, head_dim=64)
    elif arch in ("llama", "qwen2", "mistral", "olmo"):
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig,
               "olmo": tf.OlmoConfig}[arch]
        cfg = cls(**dec, num_key_value_heads=1 if arch != "olmo" else 2)
    else:
        raise ValueError(f"no stand-in for architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    if tie is not None:
        cfg.tie_word_embeddings = tie
    return cfg


def build_stand_in(out: str | os.PathLike, arch: str, *, layout: str = "save_pretrained",
                   tie: bool | None = None, seed: int = 0, chat: bool = False) -> Path:
    """Write a tiny random `arch` model and its tokenizer to `out`; returns the directory.

    `tie` overrides the architecture's default `tie_word_embeddings` (None keeps it); `chat`
    gives the tokenizer a chat template (module docstring).
    """
    from transformers import AutoModelForCausalLM

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(chat=chat)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer), tie=tie), dtype=torch.float32)
    with torch.no_grad():  # random init at std 0.02 gives near-uniform logits: make them peaked
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if layout != "save_pretrained":
        _rewrite(out, arch, layout)
    return out


def build_reward_model(out: str | os.PathLike, arch: str, *, seed: int = 0) -> Path:
    """Write a tiny random one-output `arch` sequence classifier (a reward model) and the stand-in
    tokenizer to `out`; returns the directory."""
    from transformers import AutoModelForSequenceClassification

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = _config(arch, len(tokenizer), tie=None)
    cfg.num_labels = 1
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).save_pretrained(
        out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _rewrite(out: Path, arch: str, layout: str) -> None:
    """Re-store the saved weights as `layout` (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    single = out / "model.safetensors"
    state = load_file(single)
    single.unlink()
    if layout == "hub":
        state = {_hub_name(arch, k): v for k, v in state.items()}
    if layout == "bin":
        torch.save(state, out / "pytorch_model.bin")
        return
    if layout == "hub":
        save_file(state, single, metadata={"format": "pt"})
        return
    names = sorted(state)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in files.items():
        save_file({k: state[k].contiguous() for k in keys}, out / fname, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {k: f for f, keys in files.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _hub_name(arch: str, key: str) -> str:
    if arch == "gpt2":
        return key.removeprefix("transformer.")
    if arch == "gpt_neox" and key.startswith("lm_head."):
        return "embed_out." + key.removeprefix("lm_head.")
    return key
