"""Deterministic metrics against hand-computed values."""

from __future__ import annotations

import pytest

from jobs.agent.metrics import (
    coefficient_of_variation,
    hotpot_em,
    hotpot_f1,
    locomo_f1,
    mc_choice,
    normalize_answer,
    pairwise_rouge_l,
    rouge_l,
)


def test_hotpot_normalisation_em_and_f1() -> None:
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert hotpot_em("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert hotpot_em("Eiffel", "Eiffel Tower") == 0.0
    # prediction "eiffel" vs gold "eiffel tower": P = 1, R = 1/2, F1 = 2/3
    assert hotpot_f1("Eiffel", "Eiffel Tower") == pytest.approx(2 / 3)
    assert hotpot_f1("yes", "no") == 0.0 and hotpot_f1("yes it is", "yes") == 0.0 and hotpot_f1("Yes.", "yes") == 1.0
    assert hotpot_f1("", "Paris") == 0.0


def test_locomo_f1_by_category() -> None:
    # stemming: "painting" and "paints" both stem to "paint"; "and" and commas are dropped
    assert locomo_f1("painting", "paints", 4) == 1.0
    assert locomo_f1("7 May 2023", "7 May, 2023", 2) == 1.0
    # category 3 scores against the part before ";"
    assert locomo_f1("psychology", "Psychology; counseling", 3) == 1.0
    # category 1: mean over gold parts of the best-matching predicted part
    assert locomo_f1("hiking, pottery", "pottery, camping", 1) == pytest.approx(0.5)
    assert locomo_f1("It is not mentioned in the conversation.", "anything", 5) == 1.0
    assert locomo_f1("She went hiking.", "anything", 5) == 0.0


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("B", 1),
        ("(C)", 2),
        ("D. Lisbon", 3),
        ("J) Nobody", 9),
        ("**E**", 4),
        ("The answer is F.", 5),
        ("I think the correct option: (G) since...", 6),
        ("Answer: H", 7),
        ("Lisbon", 3),
        ("A dog named Rex", None),  # "A" as an article is not choice A; two choice texts are named
        ("Maybe Porto or Lisbon", None),
        ("", None),
    ],
)
def test_mc_choice_shapes(answer: str, expected: int | None) -> None:
    choices = ["Porto", "Madrid", "Paris", "Lisbon", "Faro", "Seville", "Rome", "Berlin", "Rex dog", "Nobody"]
    assert mc_choice(answer, choices) == expected


def test_stability_metrics() -> None:
    assert coefficient_of_variation([10, 10, 10]) == 0.0
    # mean 20, sample stdev 10 -> 0.5
    assert coefficient_of_variation([10, 20, 30]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        coefficient_of_variation([5])
    assert pairwise_rouge_l(["the cat sat", "the cat sat", "the cat sat"]) == 1.0
    # LCS of "a b c d" and "a c d e" is "a c d": P = R = 3/4
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert pairwise_rouge_l(["alpha beta", "gamma delta"]) == 0.0
