"""Built-in verifiers: per-sample `fn(prompt, completion, answer) -> float`, chosen by name in
`reward.fn` (see rewards.py for how they are combined and where they run).

    arithmetic   the demo task's exact verifier (hybridrl/data/tasks/arithmetic.py)
    exact_match  the completion, stripped, equals the answer
    math_verify  the final answer (last \\boxed{}, <answer>...</answer>, "#### N", "the answer is N",
                 else the last number) is mathematically equal to the reference, through Hugging
                 Face's `math-verify` (so "\\boxed{1/2}" matches "0.5" and "\\frac{1}{2}")
    format       the whole completion matches `reward.format_pattern` (default: R1's
                 "<think>...</think><answer>...</answer>")
    code_tests   the fraction of the row's tests the completion's program passes, run in the code
                 sandbox (code_tests.py; `reward.code_all_or_nothing` for 0/1)
    none         0 always: a distillation run with no task reward (algo.teacher without --reward)

They are plain functions: import them to test a reward by hand.
"""

from __future__ import annotations

import re

DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def exact_match(prompt: str, completion: str, answer: str) -> float:
    return float(completion.strip() == str(answer).strip())


def arithmetic(prompt: str, completion: str, answer: str) -> float:
    from hybridrl.data.tasks import arithmetic as task

    return task.reward(prompt, completion, answer)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: the completion was cut off


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution, in the order a grader would look: the last \\boxed{},
    the last <answer>...</answer>, GSM8K's '#### N', 'the answer is N', else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "\\boxed" in text or "\\fbox" in text:  # a box cut off before it closed: no answer yet
        return None
    tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    said = re.findall(r"answer is[:\s]*\$?([^\s$]+)", text, flags=re.I)
    if said:
        return said[-1].rstrip(".").replace(",", "")
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _math_parse(text: str):
    """math-verify's parse of one answer string, tried as LaTeX math, then bare."""
    from math_verify import parse

    for candidate in (f"${text}$", text):  # as LaTeX first: bare, "x^2+2x+1" parses as its last number
        parsed = parse(candidate)
        if parsed:
            return parsed
    return []


def math_verify(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference answer mathematically.

    math-verify's own timeouts (signal.alarm) work here: the reward pool and the in-process
    scorer both call from a main thread. The reference may be a full GSM8K solution ('#### 72').
    """
    from math_verify import verify

    gold_text = str(answer)
    if "####" in gold_text or "\\boxed" in gold_text:
        gold_text = extract_answer(gold_text) or gold_text
    pred_text = extract_answer(completion)
    if pred_text is None:
        return 0.0
    gold, pred = _math_parse(gold_text.strip()), _math_parse(pred_text)
    if not gold or not pred:
        return float(pred_text.strip() == gold_text.strip())  # neither is maths: compare as text
    return float(verify(gold, pred))


def format_check(prompt: str, completion: str, answer: str, *, pattern: str = DEFAULT_FORMAT) -> float:
    """1.0 if the whole completion (surrounding whitespace aside) matches `pattern`."""
    return float(re.fullmatch(pattern, completion.strip(), flags=re.S) is not None)


def code_tests(
    prompt: str, completion: str, answer: str, *, all_or_nothing: bool = False, packages: tuple[str, ...] = ()
) -> float:
    from hybridrl.data import code_tests as task

    return task.code_tests(prompt, completion, answer, all_or_nothing=all_or_nothing, packages=packages)


def none(prompt: str, completion: str, answer: str) -> float:
    """No task reward: a distillation run without a verifier (algo.teacher, no --reward) learns from
    the teacher alone."""
    return 0.0


BUILTIN = {
    "arithmetic": arithmetic,
    "exact_match": exact_match,
    "math_verify": math_verify,
    "format": format_check,
    "code_tests": code_tests,
    "none": none,
}
# microseconds per call and cannot hang: worth no worker process (see rewards.Scorer)
FAST = {"arithmetic", "exact_match", "format", "none"}
SANDBOXED = {"code_tests"}  # a sandboxed program per sample: rewards.sandbox_workers sizes their pool
