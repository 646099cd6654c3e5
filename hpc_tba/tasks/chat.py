"""Prompts as the model expects them: the tokenizer's chat template, BOS once, a pad token.

Every caller turns a prompt into token ids the same way, `tok(prompt.text)["input_ids"]` (the
searcher's `VLLMEngine.tokenize`, the learner's sync probe, offline encoding), so the task hands
out text that gives the right ids under exactly that call:

- `task.chat_template` on / auto: the prompt becomes one user turn (after `task.system_prompt`
  as a system turn, if set) rendered by the tokenizer's own template with the generation prompt
  (`apply_chat_template(..., tokenize=False, add_generation_prompt=True)`).
- BOS: templates such as Llama 3's write the BOS token into the text, and tokenizers such as
  Llama's also add one when encoding, so `tok(rendered)` would start with two. When the tokenizer
  adds BOS itself, a leading BOS string is removed from the rendered text: the ids then hold
  exactly one BOS, the tokenizer's. When it does not (Qwen: no BOS at all; or add_bos_token off),
  the text is kept as the template wrote it. A template without BOS on a tokenizer that adds one
  keeps the tokenizer's BOS (the one case where `tok(text)` differs from
  `apply_chat_template(tokenize=True)`, which never adds special tokens): the model saw BOS in
  pre-training, and every caller tokenizes one way.
- Tokenizers without a pad token (GPT-2, Llama): batched scorers pad with EOS instead and say so
  once per process (`ensure_pad_token`); the learner pads with an attention mask, so the pad id
  it uses never reaches the model.
"""
from __future__ import annotations

import sys
from typing import Any

from hpc_tba.config import TaskConfig

_WARNED: set[str] = set()


def ensure_pad_token(tokenizer: Any, where: str) -> None:
    """Give a tokenizer without a pad token EOS as its pad token, and say so once per `where`."""
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise ValueError(f"{where}: the tokenizer has neither a pad nor an EOS token; batched "
                         "scoring needs one to pad with (add a pad token to its tokenizer_config)")
    tokenizer.pad_token = tokenizer.eos_token
    if where not in _WARNED:
        _WARNED.add(where)
        print(f"hpc-tba: {where}: the tokenizer has no pad token; padding with EOS "
              f"({tokenizer.eos_token!r}, id {tokenizer.eos_token_id}) under an attention mask",
              file=sys.stderr, flush=True)


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` puts a BOS token in front of the text by itself."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bool(with_special) and with_special[0] == bos and without[:1] != [bos]


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object from a tokenizer or a local directory."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


class PromptFormatter:
    """Text -> the text whose `tok(text)` ids are the prompt as the model expects it."""

    def __init__(self, cfg: TaskConfig, tokenizer: Any):
        self.tokenizer = load_tokenizer(tokenizer)
        self.system_prompt = cfg.system_prompt
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if cfg.chat_template == "on" and not has_template:
            raise ValueError("task.chat_template=on but the model's tokenizer has no chat template "
                             "(tokenizer_config.json has no `chat_template`): use "
                             "task.chat_template=off, or a tokenizer that has one")
        if cfg.system_prompt and not has_template:
            raise ValueError("task.system_prompt is set but the model's tokenizer has no chat "
                             "template to put a system turn in")
        self.active = has_template and cfg.chat_template != "off"
        bos = self.tokenizer.bos_token
        self._strip = bos if (bos and tokenizer_adds_bos(self.tokenizer)) else ""

    def __call__(self, text: str) -> str:
        if not self.active:
            return text
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns.append({"role": "user", "content": text})
        out = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        if self._strip and out.startswith(self._strip):
            out = out[len(self._strip):]  # the tokenizer adds this one itself
        return out
