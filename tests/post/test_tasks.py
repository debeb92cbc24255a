import re

import pytest

from kiln.errors import ConfigError
from kiln.post import tasks
from kiln.post.tasks import (
    FAMILIES,
    answer_kind,
    extract_answer,
    generate_tasks,
    grade,
    task_preference_pairs,
    task_sft_examples,
)

# Conversion factors written out here, not imported, so a wrong table in the module shows.
TO_BASE = {
    "mm": 1,
    "cm": 10,
    "m": 1000,
    "km": 1_000_000,
    "mg": 1,
    "g": 1000,
    "kg": 1_000_000,
    "tonne": 1_000_000_000,
    "tonnes": 1_000_000_000,
    "mL": 1,
    "L": 1000,
    "cent": 1,
    "cents": 1,
    "dollar": 100,
    "dollars": 100,
    "second": 1,
    "seconds": 1,
    "minute": 60,
    "minutes": 60,
    "hour": 3600,
    "hours": 3600,
    "day": 86400,
    "days": 86400,
    "week": 604800,
    "weeks": 604800,
    "inch": 1,
    "inches": 1,
    "foot": 12,
    "feet": 12,
    "yard": 36,
    "yards": 36,
    "month": 1,
    "months": 1,
    "year": 12,
    "years": 12,
}

WORD_PROBLEMS = [  # (pattern, answer from the numbers in order, positions that commute)
    (r"\w+ has (\d+) \w+ and gets (\d+) more\. How many does \w+ have now\?", lambda a, b: a + b, True),
    (r"\w+ has (\d+) \w+ and gives (\d+) away\. How many are left\?", lambda a, b: a - b, False),
    (r"\w+ buys (\d+) bags with (\d+) \w+ in each\. How many \w+ is that\?", lambda a, b: a * b, True),
    (r"\w+ shares (\d+) \w+ equally among (\d+) friends\. How many does each friend get\?", lambda a, b: a // b, False),
    (r"\w+ has (\d+) \w+, buys (\d+) more and gives (\d+) away\. How many are left\?", lambda a, b, c: a + b - c, True),
    (
        r"\w+ has (\d+) \w+ and buys (\d+) bags with (\d+) in each\. How many \w+ now\?",
        lambda c, a, b: a * b + c,
        False,
    ),
    (
        r"\w+ has (\d+) \w+ and gives (\d+) to each of (\d+) friends\. How many are left\?",
        lambda a, b, c: a - b * c,
        False,
    ),
]


def solve(example):
    """(canonical problem, answer) computed from the prompt text alone."""
    family, prompt = example["task"], example["prompt"]
    if family == "arithmetic":
        a, op, b = re.fullmatch(r"What is (\d+)([-+*])(\d+)\?", prompt).groups()
        a, b = int(a), int(b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return (op, *(sorted((a, b)) if op != "-" else (a, b))), str(value)
    if family == "sort":
        kind, items = re.fullmatch(r"Sort these (numbers|words): (.+)", prompt).groups()
        items = items.split(" ")
        ordered = sorted(items, key=int) if kind == "numbers" else sorted(items)
        return (kind, *ordered), " ".join(ordered)
    if family == "reverse":
        op, items = re.fullmatch(r"(Reverse|Repeat): (.+)", prompt).groups()
        items = items.split(" ")
        return (op, *items), " ".join(items[::-1] if op == "Reverse" else items)
    if family == "convert":
        value, src, dst = re.fullmatch(r"Convert (\d+) (\w+) to (\w+)\.", prompt).groups()
        total = int(value) * TO_BASE[src]
        assert total % TO_BASE[dst] == 0, prompt
        return (int(value), src, dst), str(total // TO_BASE[dst])
    for k, (pattern, fn, commutes) in enumerate(WORD_PROBLEMS):
        m = re.fullmatch(pattern, prompt)
        if m:
            nums = [int(x) for x in m.groups()]
            key = tuple(sorted(nums[:2]) + nums[2:]) if commutes else tuple(nums)
            return (k, *key), str(fn(*nums))
    raise AssertionError(f"unparsed word problem: {prompt}")


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_are_right_and_splits_are_disjoint(family):
    """Thousands of problems per family over all levels: every answer checks out independently and
    no held-out problem (up to commutativity, or the multiset for sorting) is in train."""
    train, heldout = set(), set()
    for level in (1, 2, 3):
        for split, n, store in (("train", 1200, train), ("heldout", 400, heldout)):
            examples = generate_tasks(family, n, split=split, difficulty=level, seed=level)
            assert len(examples) == n and len({ex["id"] for ex in examples}) == n  # unique by default
            for ex in examples:
                assert ex["task"] == family and ex["difficulty"] == level
                key, answer = solve(ex)
                assert ex["answer"] == answer, ex
                store.add(key)
    assert len(train) > 3000 and len(heldout) > 1000
    assert not train & heldout


def test_config_families_match():
    from kiln.post.config import TASK_FAMILIES

    assert tuple(TASK_FAMILIES) == FAMILIES


def test_generation_is_deterministic_and_seeded():
    a = generate_tasks("sort", 50, seed=1)
    assert a == generate_tasks("sort", 50, seed=1)
    assert a != generate_tasks("sort", 50, seed=2)
    assert generate_tasks("sort", 0) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_difficulty_grows(family):
    sizes = []
    for level in (1, 2, 3):
        examples = generate_tasks(family, 300, difficulty=level)
        sizes.append(sum(len(ex["prompt"]) + len(ex["answer"]) for ex in examples))
    assert sizes[0] < sizes[1] < sizes[2]


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"family": "calculus"}, "family"),
        ({"split": "test"}, "split"),
        ({"difficulty": 4}, "difficulty"),
        ({"n": -1}, "n"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, key):
    args = {"family": "arithmetic", "n": 3, **kwargs}
    with pytest.raises(ConfigError) as err:
        generate_tasks(**args)
    assert err.value.key == key


def test_exhausted_problem_space_is_an_error_not_a_hang(monkeypatch):
    def tiny(rng, level):
        x = rng.randint(0, 9)
        return str(x), f"Echo {x}", str(x), [str(x + 1)]

    monkeypatch.setitem(tasks.GENERATORS, "arithmetic", tiny)
    train = [k for k in map(str, range(10)) if tasks.split_of("arithmetic", k) == "train"]
    assert len(generate_tasks("arithmetic", len(train))) == len(train)
    with pytest.raises(ConfigError, match=f"found only {len(train)} distinct train") as err:
        generate_tasks("arithmetic", len(train) + 1)
    assert err.value.key == "n"
    assert len(generate_tasks("arithmetic", 50, unique=False)) == 50


# ---- graders ---------------------------------------------------------------------------------------

NUMBER = {"task": "arithmetic", "answer": "1234"}
NUMBER_RIGHT = [
    "1234",
    "  1234  ",
    "1234<|end|>",
    "1234<|end|>5678",
    "1234<|endoftext|>99",
    "The answer is 1234.",
    "1,234",
    "1234.0",
    "12+35=1234",
    "x = 1234\n",
    "1234 apples",
]
NUMBER_WRONG = ["1235", "", "no idea", "-1234", "12 34", "1234 or 1235", "1234.5", "123<|end|>4", "12340"]
LIST = {"task": "sort", "answer": "apple fig pear"}
LIST_RIGHT = [
    "apple fig pear",
    "  apple   fig pear ",
    "apple, fig, pear",
    "Apple Fig Pear",
    "apple fig pear.",
    "Sorted: apple fig pear",
    "apple fig pear<|end|>more",
    "apple fig pear\nbecause a < f < p",
    "\napple fig pear",
]
LIST_WRONG = [
    "apple pear fig",
    "apple fig",
    "apple fig pear kiwi",
    "apple fig pear because",
    "applefigpear",
    "",
    "pear fig apple",
    "apple<|end|> fig pear",
]


@pytest.mark.parametrize("text", NUMBER_RIGHT)
def test_number_grader_accepts(text):
    assert grade(NUMBER, text) == 1.0


@pytest.mark.parametrize("text", NUMBER_WRONG)
def test_number_grader_rejects(text):
    assert grade(NUMBER, text) == 0.0


@pytest.mark.parametrize("text", LIST_RIGHT)
def test_list_grader_accepts(text):
    assert grade(LIST, text) == 1.0


@pytest.mark.parametrize("text", LIST_WRONG)
def test_list_grader_rejects(text):
    assert grade(LIST, text) == 0.0


def test_negative_and_zero_answers():
    ex = {"task": "arithmetic", "answer": "-23"}
    assert grade(ex, "-23") == grade(ex, "12-35=-23") == 1.0
    assert grade(ex, "23") == 0.0
    assert grade({"task": "arithmetic", "answer": "0"}, "0") == 1.0


def test_extract_answer_and_kinds():
    assert extract_answer("  it is 1,234.<|end|>9", "number") == "1234"
    assert extract_answer("nothing", "number") is None
    assert extract_answer("Answer: B, A.", "list") == "b a"
    assert extract_answer("  hi there <|end|>x") == "hi there"
    assert answer_kind({"task": None, "answer": "42"}) == "number"
    assert answer_kind({"answer": "Paris"}) == "list"
    assert grade({"answer": "Paris"}, "paris.") == 1.0 and grade({"answer": "Paris"}, "Lyon") == 0.0
    with pytest.raises(ValueError, match="no answer"):
        grade({"id": "x"}, "1")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_answer_grades_right_and_every_distractor_wrong(family):
    for level in (1, 2, 3):
        for ex in generate_tasks(family, 200, difficulty=level, seed=5):
            assert grade(ex, ex["answer"]) == 1.0
            assert grade(ex, ex["answer"] + "<|end|>") == 1.0
            assert ex["distractors"] and all(grade(ex, w) == 0.0 for w in ex["distractors"])
            assert answer_kind(ex) == ("list" if family in ("sort", "reverse") else "number")


def test_sft_examples_and_preference_pairs():
    generated = generate_tasks("convert", 30, difficulty=2, seed=4)
    assert task_sft_examples(generated) == [
        [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}] for ex in generated
    ]
    examples = generate_tasks("word_problem", 100, difficulty=3, seed=4)
    pairs = task_preference_pairs(examples, seed=4)
    assert pairs == task_preference_pairs(examples, seed=4)
    assert pairs != task_preference_pairs(examples, seed=5)
    for (prompt, chosen, rejected), ex in zip(pairs, examples):
        assert prompt == [{"role": "user", "content": ex["prompt"]}]
        assert chosen == ex["answer"] and rejected in ex["distractors"]
        assert grade(ex, chosen) == 1.0 and grade(ex, rejected) == 0.0
    assert len({rejected for _, _, rejected in pairs}) > 20  # not one fixed wrong answer
    with pytest.raises(ValueError, match="no wrong answer"):
        task_preference_pairs([{"id": "q", "task": "sort", "prompt": "p", "answer": "a", "distractors": ["A"]}])
