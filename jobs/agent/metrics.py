"""Deterministic scores: HotpotQA EM/F1, LoCoMo F1, LoCoMo-MC accuracy, summary stability.

HotpotQA follows the official evaluation script (SQuAD normalisation; yes/no/noanswer must
match exactly for F1). LoCoMo follows its `task_eval/evaluation.py`: commas and `and` dropped,
Porter-stemmed tokens, category 1 answers scored per comma-separated part, category 3 against
the part before `;`, category 5 (adversarial) correct when the answer says it is not mentioned.
ROUGE-L comes from `rouge-score`.
"""

from __future__ import annotations

import re
import statistics
import string
from collections import Counter
from collections.abc import Sequence
from functools import cache
from itertools import combinations
from typing import Any

from nltk.stem import PorterStemmer
from rouge_score import rouge_scorer

from jobs.data.episodes import Question

_PUNCT = set(string.punctuation)
_LETTERS = "ABCDEFGHIJ"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile of the values (the nearest of the sorted values); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def normalize_answer(text: str) -> str:
    """SQuAD/HotpotQA normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _token_f1(prediction: Sequence[str], gold: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def hotpot_em(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def hotpot_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    special = ("yes", "no", "noanswer")
    if (pred in special or ref in special) and pred != ref:
        return 0.0
    return _token_f1(pred.split(), ref.split())


@cache
def _stemmer() -> PorterStemmer:
    return PorterStemmer()


def _locomo_tokens(text: str) -> list[str]:
    text = text.replace(",", "")
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return [_stemmer().stem(w) for w in text.split()]


def _locomo_pair_f1(prediction: str, gold: str) -> float:
    return _token_f1(_locomo_tokens(prediction), _locomo_tokens(gold))


def locomo_f1(prediction: str, gold: str, category: int) -> float:
    """LoCoMo's per-question score for its five categories."""
    if category == 5:
        said = prediction.lower()
        return float("no information available" in said or "not mentioned" in said)
    if category == 3:
        gold = gold.split(";")[0].strip()
    if category == 1:
        parts = [p.strip() for p in prediction.split(",")]
        golds = [g.strip() for g in gold.split(",")]
        return statistics.fmean(max(_locomo_pair_f1(p, g) for p in parts) for g in golds)
    return _locomo_pair_f1(prediction, gold)


def mc_choice(prediction: str, choices: Sequence[str]) -> int | None:
    """Which choice an answer picks: a letter (A-J) in the usual shapes, else a unique choice text."""
    letters = _LETTERS[: len(choices)]
    text = prediction.strip()
    patterns = (  # letters are upper case: a lone "a" is an article, not choice A
        rf"^\**\(?([{letters}])\)?\**(?:[.:),\]]|\s*$)",  # "B", "(B)", "B.", "B) Lisbon", "**B**"
        rf"(?i:answer|choice|option)\s*(?:is|:)?\s*\**\(?([{letters}])(?![\w'])",  # "The answer is B"
        rf"\(([{letters}])\)",  # "... (B) ..."
    )
    for pattern in patterns:
        match = re.search(pattern, text)
        if match:
            return letters.index(match.group(1).upper())
    said = normalize_answer(text)
    hits = [i for i, c in enumerate(choices) if normalize_answer(c) and normalize_answer(c) in said]
    return hits[0] if len(hits) == 1 else None


def score_answer(dataset: str, question: Question, prediction: str) -> dict[str, Any]:
    """The dataset's metrics of one answer: MC accuracy, HotpotQA EM/F1, or LoCoMo F1."""
    if dataset == "locomo_mc":
        return {"mc_correct": mc_choice(prediction, question.choices) == question.correct_index}
    if dataset == "hotpotqa":
        return {"em": hotpot_em(prediction, question.gold), "f1": hotpot_f1(prediction, question.gold)}
    return {"f1": locomo_f1(prediction, question.gold, int(question.category))}


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Sample standard deviation over the mean (0 for identical values; needs two values)."""
    if len(values) < 2:
        raise ValueError("the coefficient of variation needs at least two values")
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean else 0.0


@cache
def _rouge() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(a: str, b: str) -> float:
    return float(_rouge().score(a, b)["rougeL"].fmeasure)


def pairwise_rouge_l(texts: Sequence[str]) -> float:
    """Mean ROUGE-L F1 over all pairs of texts: 1.0 when every run wrote the same summary."""
    pairs = list(combinations(texts, 2))
    if not pairs:
        raise ValueError("pairwise ROUGE-L needs at least two texts")
    return statistics.fmean(rouge_l(a, b) for a, b in pairs)
