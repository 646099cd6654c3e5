"""Converters of the papers' public data sets into the tasks' row formats (`hpc-tba data ...`).

- Anthropic HH-RLHF (`Anthropic/hh-rlhf`: `<subset>/train.jsonl.gz`, `test.jsonl.gz`; rows
  `{"chosen": str, "rejected": str}`, each a whole dialogue "\\n\\nHuman: ...\\n\\nAssistant: ...")
  into task=offline rows `{"prompt", "response", "reward", "label"}`: the dialogue up to and
  including the last "\\n\\nAssistant:" is the prompt, the rest (its leading space kept, as the
  tokenizer sees it in the dialogue) the response. Each pair gives two rows with the same prompt,
  the chosen response rewarded `chosen_reward` (default 1) and the rejected one `rejected_reward`
  (default 0): A-LoL reads them as rewards (its advantage R - V(x) is computed by `hpc-tba
  preprocess`), and DPO (algo=dpo, pairing=best_worst) pairs the rows of a prompt's group by reward,
  which is the chosen/rejected pair. Pairs whose two dialogues differ before the last assistant
  turn, or whose two responses are the same, give no pair and are counted and dropped.
- TL;DR (TBA's summarisation setting) into task=preference rows `{"prompt", "reference"}`, from
  any of the layouts the hub serves: `prompt`/`completion` (trl-lib/tldr), `prompt`/`label`
  (CarperAI/openai_summarize_tldr), `prompt`/`chosen`/`rejected` (the comparisons' copies: the
  chosen summary is the reference), `post`/`summary` (+ `title`, `subreddit`), and
  openai/summarize_from_feedback (`info` + `summaries` + `choice` of its comparisons, `info` +
  `summary` of its axis split). A prompt is built from a post with `TLDR_TEMPLATE`; the reference
  gets a leading space after a prompt ending in "TL;DR:" so that prompt + reference reads as the
  policy's prompt + response does. A prompt seen before in the split (the comparisons hold several
  rows per post) keeps its first reference.

Rows are streamed from the source and written as JSONL one at a time (records.iter_rows).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_tba.tasks.layout import sources
from hpc_tba.tasks.records import DataError, Row, get_str, iter_rows

HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
TLDR_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
"""The TL;DR prompt of the summarize_from_feedback / TRL recipes; lines whose field is absent are
left out."""


def split_dialogue(path: str | Path, line: int, row: Row, field: str) -> tuple[str, str]:
    """(prompt, response) of an HH dialogue: the last assistant turn is the response."""
    text = get_str(path, line, row, field)
    i = text.rfind(ASSISTANT)
    if i < 0:
        raise DataError(path, f"has no {ASSISTANT!r} turn", line=line, field=field)
    prompt, response = text[: i + len(ASSISTANT)], text[i + len(ASSISTANT):]
    if HUMAN in response:
        raise DataError(path, "ends with a human turn (no assistant answer to use as the response)",
                        line=line, field=field)
    if HUMAN not in prompt:
        raise DataError(path, f"has no {HUMAN!r} turn before the assistant's", line=line, field=field)
    return prompt, response


def hh_rows(path: str | Path, line: int, row: Row, *, chosen_reward: float = 1.0,
            rejected_reward: float = 0.0, responses: str = "both") -> tuple[list[Row], str]:
    """Offline rows of one HH pair and what happened: ("ok" | "mismatch" | "tie")."""
    prompt, chosen = split_dialogue(path, line, row, "chosen")
    out = [{"prompt": prompt, "response": chosen, "reward": chosen_reward, "label": "chosen"}]
    if responses == "chosen":
        return out, "ok"
    rprompt, rejected = split_dialogue(path, line, row, "rejected")
    if rprompt != prompt:
        return [], "mismatch"
    if rejected == chosen:
        return [], "tie"
    out.append({"prompt": prompt, "response": rejected, "reward": rejected_reward,
                "label": "rejected"})
    return out, "ok"


def tldr_prompt(fields: Mapping[str, Any], template: str = TLDR_TEMPLATE) -> str:
    """A TL;DR prompt from a post's fields (template lines whose field is missing dropped)."""
    lines = []
    for part in template.split("\n\n"):
        try:
            lines.append(part.format(**{k: str(v).strip() for k, v in fields.items()
                                        if v is not None and str(v).strip()}))
        except KeyError:
            continue
    return "\n\n".join(lines)


def _summary_text(path, line: int, value: Any, field: str) -> str:
    if isinstance(value, dict):
        value = value.get("text")
    if not isinstance(value, str) or not value.strip():
        raise DataError(path, "expected a summary (a string, or an object with a `text`)",
                        line=line, field=field)
    return value


def tldr_row(path: str | Path, line: int, row: Row, template: str = TLDR_TEMPLATE) -> Row:
    """The preference row `{"prompt", "reference"}` of one row in any TL;DR layout."""
    if "info" in row:  # openai/summarize_from_feedback
        info = row["info"]
        if not isinstance(info, dict) or not info.get("post"):
            raise DataError(path, "expected an object with a `post`", line=line, field="info")
        prompt = tldr_prompt(info, template)
        if "summaries" in row:
            summaries, choice = row["summaries"], row.get("choice")
            if not isinstance(summaries, list) or not isinstance(choice, int) or \
                    not 0 <= choice < len(summaries):
                raise DataError(path, "expected a list of summaries and an integer `choice` "
                                      "indexing it", line=line, field="summaries")
            reference = _summary_text(path, line, summaries[choice], "summaries")
        else:
            reference = _summary_text(path, line, row.get("summary"), "summary")
    elif "post" in row:
        prompt = tldr_prompt({k: row.get(k) for k in ("post", "title", "subreddit")}, template)
        get_str(path, line, row, "post")
        reference = get_str(path, line, row, "summary")
    elif "prompt" in row:
        prompt = get_str(path, line, row, "prompt")
        field = next((f for f in ("reference", "completion", "label", "chosen") if f in row), None)
        if field is None:
            raise DataError(path, "no summary column: expected one of reference, completion, label, "
                                  f"chosen (the row has {', '.join(sorted(row))})", line=line)
        reference = get_str(path, line, row, field)
    else:
        raise DataError(path, "not a TL;DR layout this converter knows (prompt + completion / "
                              "label / chosen, post + summary, or summarize_from_feedback's info + "
                              f"summaries); the row has {', '.join(sorted(row))}", line=line)
    if prompt.rstrip().endswith(":") and reference[:1] not in (" ", "\n"):
        reference = " " + reference
    return {"prompt": prompt, "reference": reference}


CONVERTERS = ("hh-rlhf", "tldr")


def convert(kind: str, src: str | Path, out: str | Path, splits: list[str], *,
            subsets: list[str] | tuple[str, ...] = (), chosen_reward: float = 1.0,
            rejected_reward: float = 0.0, responses: str = "both",
            template: str = TLDR_TEMPLATE) -> dict[str, dict[str, int]]:
    """Convert `splits` of the data set at `src` into `<out>/<split>.jsonl`; per split the
    counts {"rows": written, "pairs"/"duplicates"/"mismatch"/"tie": ...}."""
    if kind not in CONVERTERS:
        raise ValueError(f"unknown converter {kind!r}; expected one of {', '.join(CONVERTERS)}")
    if responses not in ("both", "chosen"):
        raise ValueError(f"responses={responses!r} must be `both` or `chosen`")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for split in splits:
        counts = {"rows": 0}
        target = out / f"{split}.jsonl"
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in _converted(kind, sources(src, split, list(subsets)), counts,
                                  chosen_reward=chosen_reward, rejected_reward=rejected_reward,
                                  responses=responses, template=template):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts["rows"] += 1
        if not counts["rows"]:
            tmp.unlink()
            raise DataError(src, f"split {split!r} gave no rows ({counts})")
        tmp.replace(target)
        report[split] = counts
    return report


def _converted(kind: str, files: list[Path], counts: dict[str, int], **opts) -> Iterator[Row]:
    seen: set[str] = set()
    for path in files:
        for line, row in iter_rows(path):
            if kind == "hh-rlhf":
                rows, what = hh_rows(path, line, row, chosen_reward=opts["chosen_reward"],
                                     rejected_reward=opts["rejected_reward"],
                                     responses=opts["responses"])
                counts[what] = counts.get(what, 0) + 1
                yield from rows
            else:
                new = tldr_row(path, line, row, opts["template"])
                key = hashlib.sha1(new["prompt"].encode()).hexdigest()  # not the whole prompts
                if key in seen:
                    counts["duplicates"] = counts.get("duplicates", 0) + 1
                    continue
                seen.add(key)
                yield new
