"""The embedded policy's recipe: a character-level tokenizer trained locally, and its special ids.

Nothing is downloaded. The tokenizer is a BPE model trained on the arithmetic task's alphabet with
no merges (so one character = one token: arithmetic wants digit-level tokens), saved as a Hugging
Face `tokenizer.json`. The policy built on it and warm-started on the task is
hpc_tba/tasks/embedded.py's.
"""
from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS = 0, 1, 2
ALPHABET = list("0123456789+-*=() ")


def build_tokenizer():
    """Character-level tokenizer trained locally (BPE with no merges), in HF fast format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(ALPHABET), special_tokens=SPECIALS,
                                  initial_alphabet=ALPHABET, show_progress=False)
    tok.train_from_iterator(["".join(ALPHABET)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    assert [tok.token_to_id(s) for s in SPECIALS[:3]] == [PAD, BOS, EOS]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
