"""Final-answer extraction and equivalence for math reasoning, without evaluating model output.

Rewards on GSM8K and MATH are "is the final answer right", so two steps decide every reward:

1. `extract_answer(response)`: the answer the model committed to. In order of precedence: the last
   `\\boxed{...}` (nested braces allowed; MATH's convention), the last `#### ...` line (GSM8K's),
   the text after the last "answer is" / "answer:", and finally the last number in the text (TBA's
   GSM8K reward: "exact match of the last number").
2. `answers_equal(predicted, reference)`: both sides are normalised (LaTeX spacing, `\\dfrac`,
   `\\left`, dollars, percent signs, degrees, units, thousands separators, `x = ` prefixes), then
   compared as exact rationals with `fractions.Fraction` when both parse as numbers (so `0.5`,
   `1/2`, `\\frac{1}{2}` and `\\dfrac12` agree, and `0.333` does not equal `1/3`), element-wise for
   tuples and intervals, else as normalised strings.

Model output is never passed to `eval`, `sympy` or any parser that can execute code: numbers are
read by regular expressions and `Fraction`, with a length cap so a 10,000-digit "number" costs
nothing. Conventions worth knowing: a percent sign is dropped, not divided by 100 (both data sets
write "50\\%" for fifty percent); a mixed number such as `2\\frac{1}{2}` is not recognised; words
after a number are treated as units (`18 dollars` == `18`), except a single letter (`5 x`).
"""
from __future__ import annotations

import re
from fractions import Fraction

_MAX_NUMBER_CHARS = 80
"""Longer strings are never parsed as numbers (cheap guard against adversarial output)."""

# A plain number: optional sign (only when not glued to a preceding operand, so "3-5" gives 5),
# thousands groups or digits, optional decimals; or a bare decimal such as ".5".
_SIGN = r"(?:(?<![\w)\]}])-)?"
_PLAIN = r"(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?|\.\d+"
_LATEX_FRAC = r"\\[dt]?frac\s*(?:\{\s*-?[\d.,]+\s*\}\s*\{\s*-?[\d.,]+\s*\}|\d\d)"
_NUMBER_RE = re.compile(
    rf"{_SIGN}(?:{_LATEX_FRAC}|(?:{_PLAIN})\s*/\s*(?:{_PLAIN})(?![\d.])|(?:{_PLAIN}))(?:\s*\\?%)?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is\b|:)\s*:?", re.IGNORECASE)
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH_RE = re.compile(r"([^/]+)/([^/]+)")
_UNIT_WORDS_RE = re.compile(r"^(.*?\d\.?)\s*(?:[a-zA-Z]{2,}\.?)(?:\s+[a-zA-Z]+\.?)*$")
_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_TEXT_UNIT_RE = re.compile(
    r"^(.*?\S)\s*\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][a-zA-Z\s.]*\}(?:\^\{?\d\}?)?$")
_VAR_PREFIX_RE = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?=\S)")

_REMOVE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~",
           "^{\\circ}", "^\\circ", "\\circ", "°", "\\%", "%", "\\$", "$",
           "\\(", "\\)", "\\[", "\\]")


def extract_boxed(text: str) -> str | None:
    """Contents of the last well-formed `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed.

    `\\boxed 5` (no braces) gives the next token. Escaped braces `\\{` `\\}` inside do not count.
    """
    found, closing = None, None
    for m in _BOXED_RE.finditer(text):
        start = m.end()
        if start < len(text) and text[start] == "{":
            closing = closing if closing is not None else _matching_braces(text)
            if start in closing:
                found = text[start + 1:closing[start]]
        elif m.group(0)[-1].isspace() and m.group(0).startswith("\\boxed"):
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                found = token.group(0)
    return found


def _matching_braces(text: str) -> dict[int, int]:
    """{index of '{': index of its '}'} for every balanced pair, in one pass (escapes skipped).

    One pass keeps extraction linear even for output full of unclosed `\\boxed{`.
    """
    pairs, stack, i = {}, [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace group opening at text[start] == '{', or None if unbalanced."""
    end = _matching_braces(text[start:]).get(0)
    return None if end is None else text[start + 1:start + end]


def numbers_in(text: str) -> list[str]:
    """Every number in `text` as written (integers, decimals, 1,000s, a/b, \\frac{a}{b}, 50%)."""
    text = text.replace("{,}", ",")  # LaTeX's 1{,}000
    return [m.group(0).strip() for m in _NUMBER_RE.finditer(text)]


def last_number(text: str) -> str | None:
    """The last number in `text`, as written; None if there is none."""
    found = numbers_in(text)
    return found[-1] if found else None


def gsm8k_reference(answer: str) -> str | None:
    """The final answer of a GSM8K `answer` field: what follows the last `####`."""
    idx = answer.rfind("####")
    if idx < 0:
        return None
    rest = answer[idx + 4:].strip().splitlines()
    return rest[0].strip() if rest and rest[0].strip() else None


def extract_answer(text: str) -> str | None:
    """The final answer a response commits to (see the module docstring for the precedence)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    hashes = gsm8k_reference(text)
    if hashes is not None:
        return _answer_from_segment(hashes)
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        segment = text[matches[-1].end():].strip().split("\n", 1)[0]
        found = _answer_from_segment(segment)
        if found is not None:
            return found
    return last_number(text)


def _answer_from_segment(segment: str) -> str | None:
    """The answer in the text after "answer is": a $math$ span, the whole phrase if it is a
    number with units, else its first number."""
    segment = segment.strip().rstrip(".").strip()
    math = re.match(r"^\$([^$]+)\$", segment) or re.match(r"^\\\((.+?)\\\)", segment)
    if math:
        return math.group(1).strip()
    if parse_number(normalize_answer(segment)) is not None:
        return segment
    found = numbers_in(segment)
    if found:
        return found[0]
    return segment or None


def normalize_answer(answer: str) -> str:
    """A canonical string for an answer: LaTeX spacing, wrappers, units and separators removed.

    Idempotent. Not a LaTeX parser: it removes the notational variation seen in GSM8K/MATH
    answers (e.g. `\\$1{,}000.` -> `1000`, `\\dfrac12` -> `\\frac{1}{2}`, `x = 5` -> `5`).
    """
    s = answer.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\n", " ").replace("{,}", ",")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in _REMOVE:
        s = s.replace(token, " " if token == "\\ " else "")
    s = _strip_units(s.strip())
    s = _TEXT_CMD_RE.sub(lambda m: m.group(1), s)
    s = _VAR_PREFIX_RE.sub("", s.strip())
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"^(-?)0+(?=\d)", r"\1", s)  # "007" -> "7", keeps "0.5"
    return s


def _strip_units(s: str) -> str:
    """Drop a unit after a number: `18 \\text{ cm}`, `18 dollars`, `90^\\circ` (already gone)."""
    m = _TEXT_UNIT_RE.match(s)
    if m and _looks_numeric(m.group(1)):
        return m.group(1)
    m = _UNIT_WORDS_RE.match(s)
    if m and _looks_numeric(m.group(1)):
        return m.group(1)
    return s


def _looks_numeric(s: str) -> bool:
    return parse_number(re.sub(r"\s+", "", s).rstrip(".")) is not None


def parse_number(s: str) -> Fraction | None:
    """An exact rational for a normalised numeric string, else None (never raises).

    Accepts integers, decimals, thousands separators, `a/b`, `\\frac{a}{b}` (recursively, so
    `-\\frac{-1}{2.5}` works) and a leading sign. Rejects anything longer than 80 characters.
    """
    s = s.strip()
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    if s[0] in "+-":
        rest = parse_number(s[1:])
        return None if rest is None else (-rest if s[0] == "-" else rest)
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s)
        if _THOUSANDS_RE.fullmatch(s):
            return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    parts = _frac_parts(s)
    if parts is None:
        m = _SLASH_RE.fullmatch(s)
        parts = (m.group(1), m.group(2)) if m else None
    if parts is None:
        return None
    num, den = parse_number(parts[0]), parse_number(parts[1])
    if num is None or den is None or den == 0:
        return None
    return num / den


def _frac_parts(s: str) -> tuple[str, str] | None:
    """(numerator, denominator) if `s` is exactly `\\frac{A}{B}`, else None."""
    if not s.startswith("\\frac{"):
        return None
    num = _braced(s, 5)
    if num is None:
        return None
    rest = 5 + len(num) + 2
    if rest >= len(s) or s[rest] != "{":
        return None
    den = _braced(s, rest)
    if den is None or rest + len(den) + 2 != len(s):
        return None
    return num, den


def _split_tuple(s: str) -> tuple[str, list[str]] | None:
    """(brackets, elements) of a tuple, interval or set like `(1,2]`, split at top-level commas."""
    s = s.replace("\\{", "{").replace("\\}", "}")
    if len(s) < 2 or s[0] not in "([{" or s[-1] not in ")]}":
        return None
    items, depth, cur = [], 0, []
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return s[0] + s[-1], items


def answers_equal(predicted: str | None, reference: str | None) -> bool:
    """True iff `predicted` states the same answer as `reference` (see the module docstring)."""
    if predicted is None or reference is None:
        return False
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    ta, tb = _split_tuple(a), _split_tuple(b)
    if ta and tb and ta[0] == tb[0] and len(ta[1]) == len(tb[1]) > 1:
        return all(answers_equal(p, q) for p, q in zip(ta[1], tb[1]))
    return False


def is_correct(response: str, reference: str) -> bool:
    """Does the final answer extracted from `response` equal `reference`? (the math reward)."""
    return answers_equal(extract_answer(response), reference)
