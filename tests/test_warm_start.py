"""The embedded warm start stops inside its band of held-out greedy pass@1, or says why not."""
import json

import pytest

from hpc_tba.config import ConfigError, ModelConfig, TaskConfig
from hpc_tba.models import tiny
from hpc_tba.tasks import build_task, embedded


def test_warm_start_stops_inside_the_band_measured_on_the_held_out_prompts(tmp_path):
    model = ModelConfig(cache_dir=str(tmp_path))
    out = embedded.ensure_embedded_model(model, TaskConfig())
    record = json.loads((out / "warm_start.json").read_text())
    low, high = model.warm_start_band
    assert low <= record["held_out_pass@1"] <= high and record["steps"] < model.sft_steps
    assert record["history"][-1] == [record["steps"], record["held_out_pass@1"]]
    assert all(a < low for _, a in record["history"][:-1])  # it stopped at the first check inside
    # The saved model measures the same on the held-out split (the RL run's test prompts).
    from transformers import AutoTokenizer, LlamaForCausalLM

    task = build_task(TaskConfig())
    policy = LlamaForCausalLM.from_pretrained(out)
    again = embedded.greedy_pass_at_1(policy, AutoTokenizer.from_pretrained(out), task, task.prompts("test"))
    assert again == record["held_out_pass@1"]


def test_old_caches_are_not_reused():
    """The recipe changed: the cache key differs from the fixed-550-step model's."""
    assert embedded._BUILD_VERSION >= 3
    a = embedded.embedded_model_dir(ModelConfig(), TaskConfig())
    b = embedded.embedded_model_dir(ModelConfig(warm_start_band=[0.5, 0.7]), TaskConfig())
    assert a != b


@pytest.mark.parametrize("checks, what", [([0.1, 0.3, 0.7], "jumped over"), ([0.1, 0.2, 0.3], "never reached")])
def test_a_band_it_cannot_stop_in_is_a_clear_error(checks, what, monkeypatch):
    seq = iter(checks)
    monkeypatch.setattr(embedded, "greedy_pass_at_1", lambda *a, **k: next(seq))
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny.build_tokenizer()
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=1))
    task = build_task(TaskConfig(num_train=50, num_test=10))
    with pytest.raises(ConfigError, match=f"warm start {what} its band of 40-60%.*model.sft_steps"):
        embedded.supervised_warm_start(policy, tok, task.prompts("train"), steps=15, seed=0, band=[0.4, 0.6],
                                   held_out=(task, task.prompts("test")), eval_every=5, batch_size=4)


def test_band_is_validated():
    with pytest.raises(ValueError, match="warm_start_band"):
        ModelConfig(warm_start_band=[0.6, 0.4])


@pytest.mark.parametrize("field, value", [("sft_steps", -1), ("sft_lr", 0.0), ("warm_start_eval_every", 0)])
def test_warm_start_settings_are_validated_by_name(field, value):
    """The error names the field that is wrong and its value, not the three rules at once."""
    with pytest.raises(ValueError, match=f"^model.{field}={value} is out of range: must be"):
        ModelConfig(**{field: value})
