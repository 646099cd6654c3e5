"""The chunked log-prob head (roles/policy.py) replaces the output head inside the model's own
forward, so it is exact only for families whose forward returns the head's output unchanged.
For each family: either the log-probs equal log_softmax(model(...).logits / T) at the response
tokens, or response_logprobs refuses with an error naming the problem; never a silent difference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from hpc_tba.roles.policy import pack, response_logprobs

TEMP = 0.7
SMALL = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _model(config_cls: str, **extra):
    cfg = getattr(transformers, config_cls)(**SMALL, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double().eval()


def _batch():
    rng = np.random.default_rng(0)
    return pack([rng.integers(3, 40, rng.integers(2, 7)) for _ in range(4)],
                [rng.integers(3, 40, rng.integers(1, 8)) for _ in range(4)], pad_id=0)


def _reference(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / TEMP
    idx = batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = torch.log_softmax(logits, -1).gather(1, idx).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~batch.response_mask, 0.0)


@pytest.mark.parametrize("config_cls, extra", [
    ("LlamaConfig", {}), ("Qwen2Config", {}), ("MistralConfig", {}),
    ("GemmaConfig", {"head_dim": 16}),  # scales the embeddings, before the head: exact
    ("Gemma2Config", {"head_dim": 16, "final_logit_softcapping": None}),  # no capping: exact
])
def test_supported_families_are_exact(config_cls, extra):
    model, batch = _model(config_cls, **extra), _batch()
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, batch, temperature=TEMP, chunk_tokens=3),
                                   _reference(model, batch), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config_cls, extra, field", [
    ("CohereConfig", {"logit_scale": 0.25}, "logit_scale"),
    ("GraniteConfig", {"logits_scaling": 4.0}, "logits_scaling"),
    ("Gemma2Config", {"head_dim": 16, "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
])
def test_families_that_postprocess_logits_are_refused(config_cls, extra, field):
    model, batch = _model(config_cls, **extra), _batch()
    with torch.no_grad():
        assert not torch.allclose(_head_only_logprobs(model, batch), _reference(model, batch))  # would be wrong
        with pytest.raises(ValueError, match=f"post-processes its logits \\({field}="):
            response_logprobs(model, batch, temperature=TEMP)
    assert "forward" not in vars(model.get_output_embeddings())  # nothing left swapped


def _head_only_logprobs(model, batch):
    """What the head swap computes when the name check is bypassed: the post-processing applied
    to log-probs (the silent error this test guards against)."""
    from hpc_tba.roles import policy

    head = model.get_output_embeddings()
    head.forward = policy._head_forward(head, batch, TEMP, 3)
    try:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    finally:
        del head.forward


def test_unknown_postprocessing_is_caught_at_runtime():
    """A family not in the name list that still transforms the head output (here: a bias added
    after the head) is refused by the identity check on the returned logits."""
    model = _model("LlamaConfig")
    plain = type(model).forward

    def biased_forward(self, *a, **kw):
        out = plain(self, *a, **kw)
        out.logits = out.logits + 1.0
        return out

    def capped_in_place(self, *a, **kw):  # like xLSTM's soft-cap written into the logits tensor
        out = plain(self, *a, **kw)
        out.logits.mul_(0.5)
        return out

    for forward in (biased_forward, capped_in_place):
        model.forward = forward.__get__(model)
        with torch.no_grad(), pytest.raises(ValueError, match="does not return its output head's result unchanged"):
            response_logprobs(model, _batch(), temperature=TEMP)


def test_per_token_values_longer_than_their_response_are_an_error():
    """Behaviour log-probs that do not match the responses are a data error, not cut to fit."""
    from hpc_tba.roles.policy import pad_per_token

    batch = _batch()
    t = batch.response_ids.shape[1]
    ok = pad_per_token([np.full(t, -1.0)] * 4, batch.response_ids)
    assert ok.shape == batch.response_ids.shape and float(ok.sum()) == -4.0 * t
    with pytest.raises(ValueError, match="per-token values and responses disagree"):
        pad_per_token([np.full(t + 1, -1.0)] * 4, batch.response_ids)
    with pytest.raises(ValueError, match="per-token values and responses disagree"):
        pad_per_token([np.full(t, -1.0)] * 3, batch.response_ids)
