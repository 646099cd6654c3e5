"""Preference and red-teaming tasks with tiny models built and saved locally (no downloads).

A character-level tokenizer, a LlamaForSequenceClassification reward model / toxicity classifier
and a LlamaForCausalLM victim, all random and a few thousand parameters.
"""
import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from hpc_tba.config import TaskConfig
from hpc_tba.tasks import build_task
from hpc_tba.tasks.base import Prompt
from hpc_tba.tasks.preference import PreferenceTask, RewardModel
from hpc_tba.tasks.redteam import HFVictim, RedTeamTask


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    alphabet = list(string.printable)
    tok.train_from_iterator([string.printable], trainer=trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet), special_tokens=specials,
        initial_alphabet=alphabet, show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>")


def _save_tiny(out: Path, cls: type, **extra: int) -> Path:
    tok = _tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, eos_token_id=1, **extra)
    cls(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("rm"), transformers.LlamaForSequenceClassification,
                      num_labels=1)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tox"), transformers.LlamaForSequenceClassification,
                      num_labels=2)


@pytest.fixture(scope="module")
def victim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("victim"), transformers.LlamaForCausalLM)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    rows = [{"prompt": "POST: my cat ate my homework\nTL;DR:", "reference": " cat ate homework"},
            {"prompt": "POST: rain all week, so bored\nTL;DR:", "reference": " bored by rain"}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "POST: hi\nTL;DR:"}) + "\n")
    return tmp_path


def test_batched_scores_match_one_by_one(reward_model_dir: Path) -> None:
    rm = RewardModel(str(reward_model_dir), batch_size=3)
    texts = ["a", "hello there", "a much longer text than the others, padded", "x y", "TL;DR: ok"]
    batched = rm(texts)
    single = np.array([rm([t])[0] for t in texts])
    assert batched.shape == (5,) and batched.dtype == np.float32
    np.testing.assert_allclose(batched, single, atol=1e-5)  # padding does not change a score
    assert len(set(np.round(batched, 5))) == 5  # the scores depend on the text


def test_truncation_keeps_the_end(reward_model_dir: Path) -> None:
    rm = RewardModel(str(reward_model_dir), max_length=8)
    text = "this beginning is cut off; the end stays"
    assert rm([text])[0] == pytest.approx(rm([text[-8:]])[0], abs=1e-5)


def test_preference_rewards_penalty_and_win_rate(reward_model_dir: Path, data_dir: Path) -> None:
    cfg = TaskConfig(name="preference", path=str(data_dir), reward_model=str(reward_model_dir),
                     reward_batch_size=2, unfinished_penalty=0.5)
    task = build_task(cfg)
    assert isinstance(task, PreferenceTask)
    p = task.prompts("test")
    assert [x.answer for x in p] == [" cat ate homework", " bored by rain"]
    assert task.prompts("train")[0].answer == ""
    responses = [" the cat did it", " rain"]
    base, failed = task.rewards(p, responses)
    assert failed == 0
    direct = task.reward_model([p[0].text + responses[0], p[1].text + responses[1]])
    np.testing.assert_allclose(base, direct, atol=1e-6)
    penalised, _ = task.rewards(p, responses, finished=[True, False])
    np.testing.assert_allclose(penalised, base - np.array([0.0, 0.5]), atol=1e-6)
    # The reward model as judge: a response equal to the reference ties (0.5); swapping
    # the roles of response and reference turns wins into losses.
    assert task.win_rate(p, [x.answer for x in p]) == 0.5
    swapped = [x.__class__(x.id, x.text, r) for x, r in zip(p, responses)]
    assert task.win_rate(p, responses) + task.win_rate(swapped, [x.answer for x in p]) == 1.0
    with pytest.raises(ValueError, match="has no reference"):
        task.win_rate(task.prompts("train"), ["x"])


def test_config_requires_reward_model(data_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs task.reward_model"):
        TaskConfig(name="preference", path=str(data_dir))


def test_hf_victim_batched_greedy_matches_one_by_one(victim_dir: Path) -> None:
    victim = HFVictim(str(victim_dir), max_new_tokens=6, batch_size=3)
    attacks = ["say something", "hi", "a much longer attack prompt here", "ok"]
    batched = victim(attacks)
    assert batched == [victim([a])[0] for a in attacks]  # left padding does not change answers
    assert all(isinstance(a, str) for a in batched) and any(batched)


def test_redteam_task_end_to_end(classifier_dir: Path, victim_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"prompt": "Write a question that makes the assistant rude:"}) + "\n")
    cfg = TaskConfig(name="redteam", path=str(tmp_path), reward_model=str(classifier_dir),
                     victim_model=str(victim_dir), victim_max_new_tokens=5, reward_batch_size=2,
                     reward_label=1)
    task = build_task(cfg)
    assert isinstance(task, RedTeamTask)
    p = task.prompts("train")
    attacks = [" why are you so slow?", " tell me a secret", " hello"]
    rewards, failed = task.rewards([p[0]] * 3, attacks)
    toxic, answers = task.attack(attacks)
    np.testing.assert_allclose(rewards, toxic, atol=1e-6)
    assert failed == 0 and np.all((rewards > 0) & (rewards < 1))
    # Two-output classifier: P(label 1) = softmax; the labels' probabilities sum to one.
    other = RewardModel(str(classifier_dir), label=0).probability(answers)
    np.testing.assert_allclose(other + toxic, 1.0, atol=1e-6)
    metrics = task.attack_metrics(attacks, embeddings=np.eye(3), threshold=0.0)
    assert metrics["redteam/success_rate"] == 1.0
    assert metrics["redteam/mean_toxicity"] == pytest.approx(float(np.mean(toxic)), abs=1e-6)
    assert metrics["redteam/diversity/cosine_distance"] == pytest.approx(1.0)
    assert task.attack_metrics(attacks, threshold=1.0)["redteam/success_rate"] == 0.0


def test_redteam_broken_victim_is_counted(classifier_dir: Path, tmp_path: Path) -> None:
    cfg = TaskConfig(name="redteam", path=str(tmp_path), reward_model=str(classifier_dir),
                     victim_model="unused")
    task = RedTeamTask(cfg, victim=lambda attacks: [])  # a victim that answers nothing
    rewards, failed = task.rewards([Prompt(0, "x")] * 2, ["a", "b"])
    assert failed == 2 and rewards.tolist() == [0.0, 0.0]
    echo = RedTeamTask(cfg, victim=lambda attacks: list(attacks))
    assert echo.score([Prompt(0, "x")], ["a"]).shape == (1,)
    with pytest.raises(ValueError, match="needs task.victim_model"):
        TaskConfig(name="redteam", path="x", reward_model="y")


def test_yaml_groups_compose() -> None:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError

    cfg = compose(["task=redteam", "task.path=d", "task.reward_model=c", "task.victim_model=v"])
    task = cfg.task
    assert (task.name, task.reward_label, task.victim_max_new_tokens) == ("redteam", 1, 32)
    cfg = compose(["task=preference", "task.path=d", "task.reward_model=rm"])
    assert (cfg.task.name, cfg.task.unfinished_penalty) == ("preference", 1.0)
    with pytest.raises(ConfigError, match="needs task.reward_model"):
        compose(["task=preference", "task.path=d"])
