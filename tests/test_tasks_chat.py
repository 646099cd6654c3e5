"""Prompts as the model expects them: chat templates, one BOS, tokenizers without a pad token."""
import json

import numpy as np
import pytest

from hpc_tba.config import TaskConfig
from hpc_tba.tasks import build_task
from hpc_tba.tasks.chat import PromptFormatter, ensure_pad_token, tokenizer_adds_bos

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def _tokenizer(*, adds_bos: bool, template: str | None = TEMPLATE, pad: bool = True):
    """A character tokenizer built locally, Llama-like (adds BOS) or Qwen-like (does not)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789+=?.,: \n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(["".join(alphabet)], trainer=trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + len(alphabet), special_tokens=SPECIALS,
        initial_alphabet=alphabet, show_progress=False))
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>" if pad else None, unk_token="<unk>",
                                  additional_special_tokens=SPECIALS[4:])
    out.chat_template = template
    return out


def _gsm8k(tmp_path, **kw) -> TaskConfig:
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "what is 2+2?", "answer": "#### 4"}) + "\n")
    return TaskConfig(name="gsm8k", path=str(tmp_path), **kw)


@pytest.mark.parametrize("adds_bos", [True, False])
def test_chat_template_prompt_has_exactly_one_bos(tmp_path, adds_bos):
    tok = _tokenizer(adds_bos=adds_bos)
    assert tokenizer_adds_bos(tok) is adds_bos
    task = build_task(_gsm8k(tmp_path, chat_template="on", system_prompt="be brief"), tokenizer=tok)
    text = task.prompts("train")[0].text
    assert text.endswith("<|assistant|>") and "<|system|>be brief\n<|user|>" in text
    ids = tok(text)["input_ids"]  # how the searcher, the probe and offline encoding tokenize
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    turns = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "[MATH TASK] Problem:\nwhat is 2+2?\n\nSolution:\n"}]
    assert ids == tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                          return_dict=False)


def test_chat_template_auto_off_and_missing(tmp_path):
    plain = _tokenizer(adds_bos=True, template=None)
    cfg = _gsm8k(tmp_path, chat_template="auto")
    assert build_task(cfg, tokenizer=plain).prompts("train")[0].text.startswith("[MATH TASK]")
    assert build_task(cfg, tokenizer=_tokenizer(adds_bos=True)).prompts("train")[0].text.startswith("<|user|>")
    assert build_task(_gsm8k(tmp_path)).prompts("train")[0].text.startswith("[MATH TASK]")  # off
    with pytest.raises(ValueError, match="has no chat template"):
        build_task(_gsm8k(tmp_path, chat_template="on"), tokenizer=plain)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        build_task(_gsm8k(tmp_path, chat_template="on"))
    with pytest.raises(ValueError, match="system turn needs the chat template"):
        _gsm8k(tmp_path, system_prompt="x")
    with pytest.raises(ValueError, match="must be on, off or auto"):
        _gsm8k(tmp_path, chat_template="maybe")


def test_chat_template_from_the_config(tmp_path):
    from hpc_tba.assembly.compose import compose

    _gsm8k(tmp_path)
    cfg = compose(["task=gsm8k", f"task.path={tmp_path}", "task.chat_template=true"])
    assert cfg.task.chat_template == "on"
    tok = _tokenizer(adds_bos=True)
    assert build_task(cfg.task, tokenizer=tok).prompts("train")[0].text.startswith("<|user|>")


def test_offline_prompts_are_formatted_and_still_scored(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "response": "2", "reward": 1}) + "\n")
    task = build_task(TaskConfig(name="offline", path=str(path), chat_template="on"),
                      tokenizer=_tokenizer(adds_bos=True))
    p = task.prompts("train")[0]
    assert p.text == "<|user|>1+1=\n<|assistant|>"
    assert task.rewards([p], ["2"])[0].tolist() == [1.0]  # rewards keyed by the file's prompt


def test_no_pad_token_falls_back_to_eos_and_says_so_once(capsys):
    tok = _tokenizer(adds_bos=True, pad=False)
    assert tok.pad_token is None
    ensure_pad_token(tok, "reward model /x")
    ensure_pad_token(_tokenizer(adds_bos=True, pad=False), "reward model /x")
    assert tok.pad_token == tok.eos_token
    err = capsys.readouterr().err
    assert err.count("has no pad token") == 1 and "reward model /x" in err


def test_reward_model_without_pad_token_scores_batches(tmp_path, capsys):
    """A classifier saved without a pad token (as GPT-2's) scores a padded batch like one by one."""
    from hpc_tba.tasks.preference import RewardModel
    from hpc_tba.tasks.redteam_toy import build_classifier

    path = build_classifier(tmp_path / "clf", steps=2, pad_token=False)
    rm = RewardModel(str(path), label=1, batch_size=4)
    assert "has no pad token" in capsys.readouterr().err
    texts = ["1", "12+7", "777777", "3"]
    batched = rm.probability(texts)
    alone = np.concatenate([rm.probability([t]) for t in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_formatter_is_inactive_without_template():
    f = PromptFormatter(TaskConfig(chat_template="auto"), _tokenizer(adds_bos=False, template=None))
    assert not f.active and f("x") == "x"
