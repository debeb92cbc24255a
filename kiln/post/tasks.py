"""Verifiable tasks: generated problems with exact answers, for SFT data, preference pairs, RL
rewards and held-out evaluation.

Families (difficulty 1..3 sets digits, list lengths and steps):

- `arithmetic`: "What is 12+35?" -> "47"; +, - and * of 2/3/4-digit numbers (* has one short factor
  until level 3); subtraction goes negative only at level 3.
- `sort`: "Sort these numbers: 42 7 19" -> "7 19 42" (or words, alphabetically); 3/5/7 items.
- `reverse`: "Reverse: cat dog sun" -> "sun dog cat", or "Repeat: ..." (copy); words, numbers or
  single letters, 3/5/7 items (letters 3-4/5-6/7-8).
- `convert`: "Convert 37 km to m." -> "37000"; level 1 metric (factors of ten), level 2 hours,
  feet, weeks, ..., level 3 two-step factors (hours to seconds, km to cm) and larger values.
- `word_problem`: "Ann has 12 pens and gets 5 more. How many does Ann have now?" -> "17"; one step
  with +/- (level 1), also * and / (level 2), two steps (level 3).

Each example is {"id", "task", "difficulty", "prompt", "answer", "distractors"}; distractors are
plausible wrong answers (a dropped carry, a sign error, an unsorted list) for preference pairs.

Train and held-out never share a problem: a hash of the problem's canonical key (operands up to
commutativity, the multiset of items to sort, the value and units) puts it in exactly one split,
and generation rejects problems of the other split. The key does not depend on difficulty or seed,
so the splits stay disjoint across levels and across any number of generated sets.

Grading is exact on the extracted answer: the completion is cut at `<|end|>` (or `<|endoftext|>`);
a number answer is the last number in it (thousands commas allowed, "47.0" equals 47), a list
answer is the first non-empty line after any "label:", split on spaces and commas, without a final
period, compared case-insensitively.
"""

from __future__ import annotations

import hashlib
import random
import re
from decimal import Decimal, InvalidOperation

from kiln.errors import ConfigError
from kiln.post.config import TaskConfig

FAMILIES = ("arithmetic", "sort", "reverse", "convert", "word_problem")
SPLITS = ("train", "heldout")
LEVELS = (1, 2, 3)
HELDOUT_FRACTION = 0.2
ANSWER_KIND = {"arithmetic": "number", "sort": "list", "reverse": "list", "convert": "number", "word_problem": "number"}
STOP_STRINGS = ("<|end|>", "<|endoftext|>")

WORDS = (
    "ant",
    "bee",
    "cat",
    "dog",
    "elk",
    "fox",
    "gnu",
    "hen",
    "owl",
    "pig",
    "ram",
    "yak",
    "apple",
    "bread",
    "cheese",
    "grape",
    "lemon",
    "mango",
    "olive",
    "pear",
    "plum",
    "rice",
    "blue",
    "gold",
    "green",
    "pink",
    "red",
    "gray",
    "black",
    "white",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "cloud",
    "storm",
    "river",
    "hill",
    "book",
    "cup",
    "door",
    "key",
    "lamp",
    "pen",
    "ring",
    "shoe",
    "box",
    "hat",
    "kiln",
    "clay",
    "fire",
    "glass",
    "stone",
    "wood",
    "iron",
    "salt",
    "milk",
    "tea",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAMES = (
    "Ann",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kai",
    "Lena",
    "Max",
    "Nia",
    "Omar",
    "Pia",
    "Raj",
    "Sara",
    "Tom",
    "Uma",
    "Vic",
    "Wes",
    "Yara",
    "Zoe",
)
ITEMS = (
    "apples",
    "pens",
    "books",
    "coins",
    "cards",
    "eggs",
    "stamps",
    "marbles",
    "cookies",
    "shells",
    "stickers",
    "balloons",
)

# (big unit, small unit, small units per big unit); units are (singular, plural).
_U = {name: (name, name) for name in ("km", "m", "cm", "mm", "kg", "g", "mg", "L", "mL")}
_U.update(
    {
        p: (s, p)
        for s, p in (
            ("tonne", "tonnes"),
            ("dollar", "dollars"),
            ("cent", "cents"),
            ("hour", "hours"),
            ("minute", "minutes"),
            ("second", "seconds"),
            ("day", "days"),
            ("week", "weeks"),
            ("year", "years"),
            ("month", "months"),
            ("foot", "feet"),
            ("inch", "inches"),
            ("yard", "yards"),
        )
    }
)
DECIMAL_UNITS = (
    ("km", "m", 1000),
    ("m", "cm", 100),
    ("cm", "mm", 10),
    ("m", "mm", 1000),
    ("kg", "g", 1000),
    ("g", "mg", 1000),
    ("L", "mL", 1000),
    ("dollars", "cents", 100),
    ("tonnes", "kg", 1000),
)
OTHER_UNITS = (
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("years", "months", 12),
    ("feet", "inches", 12),
    ("yards", "feet", 3),
)
TWO_STEP_UNITS = (
    ("hours", "seconds", 3600),
    ("days", "minutes", 1440),
    ("weeks", "hours", 168),
    ("km", "cm", 100000),
    ("yards", "inches", 36),
    ("kg", "mg", 1000000),
)


def _unit(name: str, value: int) -> str:
    singular, plural = _U[name]
    return singular if value == 1 else plural


def _near_misses(value: int, *extra: int) -> list[int]:
    return [*extra, value + 1, value - 1, value + 10, value - 10]


def _no_carry_sum(a: int, b: int) -> int:
    """a + b with every carry dropped: the classic column-addition slip."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


# ---- generators: rng, level -> (canonical key, prompt, answer, distractors) -----------------------------


def _arithmetic(rng: random.Random, level: int):
    op = rng.choices("+-*", weights=(2, 2, 1))[0]
    top = (99, 999, 9999)[level - 1]
    if op == "*":
        if level == 3:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        else:
            a, b = rng.randint(0, 9), rng.randint(0, top)
        value = a * b
        key = f"{min(a, b)}*{max(a, b)}"
        wrong = _near_misses(value, value + a, value - b, a + b)
    elif op == "+":
        a, b = rng.randint(0, top), rng.randint(0, top)
        value = a + b
        key = f"{min(a, b)}+{max(a, b)}"
        wrong = _near_misses(value, _no_carry_sum(a, b))
    else:
        a, b = rng.randint(0, top), rng.randint(0, top)
        if level < 3 and a < b:
            a, b = b, a
        value = a - b
        key = f"{a}-{b}"
        wrong = _near_misses(value, b - a, a + b)
    if op == "*" and rng.random() < 0.5:
        a, b = b, a
    return key, f"What is {a}{op}{b}?", str(value), [str(w) for w in wrong]


def _items(rng: random.Random, pool: str, count: int, level: int) -> list[str]:
    if pool == "numbers":
        top = 999 if level == 3 else 99
        return [str(x) for x in rng.sample(range(top + 1), count)]
    if pool == "letters":
        return [rng.choice(LETTERS) for _ in range(count)]
    return rng.sample(WORDS, count)


def _shuffled_wrong(rng: random.Random, right: list[str], *candidates: list[str]) -> list[str]:
    """Wrong lists: the given candidates, one adjacent swap and one dropped item."""
    swap = list(right)
    i = rng.randrange(len(swap) - 1)
    swap[i], swap[i + 1] = swap[i + 1], swap[i]
    return [" ".join(c) for c in (*candidates, swap, right[:-1])]


def _sort(rng: random.Random, level: int):
    count = (3, 5, 7)[level - 1]
    pool = rng.choice(("numbers", "words"))
    items = _items(rng, pool, count, level)
    ordered = sorted(items, key=int) if pool == "numbers" else sorted(items)
    key = f"{pool}|{' '.join(ordered)}"
    prompt = f"Sort these {pool}: {' '.join(items)}"
    return key, prompt, " ".join(ordered), _shuffled_wrong(rng, ordered, items, ordered[::-1])


def _reverse(rng: random.Random, level: int):
    pool = rng.choice(("numbers", "words", "letters"))
    count = (3, 5, 7)[level - 1] + (rng.randint(0, 1) if pool == "letters" else 0)
    items = _items(rng, pool, count, level)
    copy = rng.random() < 0.25
    answer = items if copy else items[::-1]
    key = f"{'copy' if copy else 'reverse'}|{' '.join(items)}"
    prompt = f"{'Repeat' if copy else 'Reverse'}: {' '.join(items)}"
    return key, prompt, " ".join(answer), _shuffled_wrong(rng, answer, items[::-1] if copy else items)


def _convert(rng: random.Random, level: int):
    if level == 1:
        table, low, high = DECIMAL_UNITS, 1, 999
    elif level == 2:
        table, low, high = (DECIMAL_UNITS, 1000, 9999) if rng.random() < 0.3 else (OTHER_UNITS, 1, 99)
    else:
        table, low, high = (TWO_STEP_UNITS, 1, 99) if rng.random() < 0.5 else (OTHER_UNITS, 100, 999)
    big, small, factor = rng.choice(table)
    value = rng.randint(low, high)
    if rng.random() < 0.5:  # big -> small: multiply
        given, answer, src, dst = value, value * factor, big, small
        wrong = _near_misses(answer, given, answer * 10, answer + factor)
    else:  # small -> big: an exact division
        given, answer, src, dst = value * factor, value, small, big
        wrong = _near_misses(answer, given, given * factor, answer * 10)
    key = f"{value}|{big}|{small}|{'down' if src == big else 'up'}"
    prompt = f"Convert {given} {_unit(src, given)} to {dst}."
    return key, prompt, str(answer), [str(w) for w in wrong]


def _word_problem(rng: random.Random, level: int):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kinds = {1: ("add", "sub"), 2: ("add", "sub", "mul", "div"), 3: ("add_sub", "mul_add", "give_each")}[level]
    kind = rng.choice(kinds)
    top = 99 if level == 1 else 999
    if kind == "add":
        a, b = rng.randint(1, top), rng.randint(1, top)
        value, key = a + b, f"add|{min(a, b)}|{max(a, b)}"
        prompt = f"{name} has {a} {item} and gets {b} more. How many does {name} have now?"
        wrong = _near_misses(value, abs(a - b), _no_carry_sum(a, b))
    elif kind == "sub":
        a, b = sorted((rng.randint(1, top), rng.randint(1, top)), reverse=True)
        value, key = a - b, f"sub|{a}|{b}"
        prompt = f"{name} has {a} {item} and gives {b} away. How many are left?"
        wrong = _near_misses(value, a + b)
    elif kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        value, key = a * b, f"mul|{min(a, b)}|{max(a, b)}"
        prompt = f"{name} buys {a} bags with {b} {item} in each. How many {item} is that?"
        wrong = _near_misses(value, a + b, value + b)
    elif kind == "div":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        value, key = b, f"div|{a * b}|{a}"
        prompt = f"{name} shares {a * b} {item} equally among {a} friends. How many does each friend get?"
        wrong = _near_misses(value, a * b - a, a)
    elif kind == "add_sub":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        c = rng.randint(1, a + b)
        value, key = a + b - c, f"add_sub|{min(a, b)}|{max(a, b)}|{c}"
        prompt = f"{name} has {a} {item}, buys {b} more and gives {c} away. How many are left?"
        wrong = _near_misses(value, a + b + c, a + b)
    elif kind == "mul_add":
        a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 99)
        value, key = a * b + c, f"mul_add|{min(a, b)}|{max(a, b)}|{c}"
        prompt = f"{name} has {c} {item} and buys {a} bags with {b} in each. How many {item} now?"
        wrong = _near_misses(value, a * b, a + b + c)
    else:  # give_each
        b, c = rng.randint(2, 9), rng.randint(2, 9)
        a = b * c + rng.randint(0, 99)
        value, key = a - b * c, f"give_each|{a}|{min(b, c)}|{max(b, c)}"
        prompt = f"{name} has {a} {item} and gives {b} to each of {c} friends. How many are left?"
        wrong = _near_misses(value, a - b, a - c)
    return key, prompt, str(value), [str(w) for w in wrong]


GENERATORS = {
    "arithmetic": _arithmetic,
    "sort": _sort,
    "reverse": _reverse,
    "convert": _convert,
    "word_problem": _word_problem,
}


# ---- splits and generation -------------------------------------------------------------------------


def _digest(family: str, key: str) -> bytes:
    return hashlib.sha256(f"{family}|{key}".encode()).digest()


def split_of(family: str, key: str) -> str:
    """The split a problem belongs to, from its canonical key alone."""
    return "heldout" if int.from_bytes(_digest(family, key)[:8], "big") < HELDOUT_FRACTION * 2**64 else "train"


def _check(family: str, n: int, split: str, difficulty: int) -> None:
    if family not in GENERATORS:
        raise ConfigError("family", f"unknown task family {family!r}; expected one of {', '.join(FAMILIES)}")
    if split not in SPLITS:
        raise ConfigError("split", f"must be 'train' or 'heldout', got {split!r}")
    if difficulty not in LEVELS:
        raise ConfigError("difficulty", f"must be 1, 2 or 3, got {difficulty!r}")
    if not isinstance(n, int) or n < 0:
        raise ConfigError("n", f"must be a non-negative integer, got {n!r}")


def generate_tasks(
    family: str, n: int, split: str = "train", difficulty: int = 1, seed: int = 0, unique: bool = True
) -> list[dict]:
    """n problems of one family from one split. The same arguments always give the same list.

    unique=True never repeats a problem (same canonical key); a request larger than the split's
    supply at that difficulty raises ConfigError instead of looping.
    """
    _check(family, n, split, difficulty)
    make = GENERATORS[family]
    rng = random.Random(f"kiln-tasks|{family}|{split}|{difficulty}|{seed}")
    out: list[dict] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        key, prompt, answer, wrong = make(rng, difficulty)
        digest = _digest(family, key)
        if split_of(family, key) != split or (unique and key in seen):
            misses += 1
            if misses > 20_000 + 20 * n:
                raise ConfigError(
                    "n",
                    f"found only {len(out)} distinct {split} {family} problems at difficulty "
                    f"{difficulty} (asked for {n}); ask for fewer, or pass unique=False",
                )
            continue
        seen.add(key)
        distractors = list(dict.fromkeys(w for w in wrong if w != answer and not _matches(family, answer, w)))
        out.append(
            {
                "id": f"{family}-{digest.hex()[:12]}",
                "task": family,
                "difficulty": difficulty,
                "prompt": prompt,
                "answer": answer,
                "distractors": distractors,
            }
        )
    return out


# ---- answers and grading ---------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _cut(completion: str) -> str:
    for stop in STOP_STRINGS:
        completion = completion.split(stop, 1)[0]
    return completion.strip()


def _last_number(text: str) -> Decimal | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:
        return None


def _normal_list(text: str) -> str:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    if ":" in line:
        line = line.rsplit(":", 1)[1]  # "Sorted: 1 2 3" -> "1 2 3"
    line = line.strip().removesuffix(".")
    return " ".join(part for part in re.split(r"[\s,]+", line) if part).casefold()


def extract_answer(completion: str, kind: str = "text") -> str | None:
    """The answer in a completion: "text" is the stripped text up to the stop token, "number" the
    last number in it (None if there is none), "list" the normalised item list."""
    text = _cut(completion)
    if kind == "number":
        value = _last_number(text)
        return None if value is None else _format_number(value)
    if kind == "list":
        return _normal_list(text)
    if kind == "text":
        return text
    raise ValueError(f"unknown answer kind {kind!r}")


def _format_number(value: Decimal) -> str:
    return str(int(value)) if value == value.to_integral_value() else str(value.normalize())


def answer_kind(example: dict) -> str:
    """'number' or 'list': from the task family, else from the answer's own form."""
    kind = ANSWER_KIND.get(example.get("task") or "")
    if kind:
        return kind
    return "number" if _NUMBER.fullmatch(str(example["answer"]).strip()) else "list"


def _matches(family: str, answer: str, completion: str) -> bool:
    return grade({"task": family, "answer": answer}, completion) == 1.0


def grade(example: dict, completion: str) -> float:
    """1.0 when the completion's extracted answer equals example["answer"], else 0.0."""
    answer = example.get("answer")
    if answer is None:
        raise ValueError(f"example {example.get('id', '?')} has no answer to grade against")
    if answer_kind(example) == "number":
        got, want = _last_number(_cut(completion)), _last_number(str(answer))
        return 1.0 if got is not None and got == want else 0.0
    return 1.0 if _normal_list(_cut(completion)) == _normal_list(str(answer)) else 0.0


# ---- training views --------------------------------------------------------------------------------


def to_messages(example: dict, with_answer: bool = True) -> list[dict]:
    messages = [{"role": "user", "content": example["prompt"]}]
    if with_answer:
        messages.append({"role": "assistant", "content": example["answer"]})
    return messages


def preference_pair(example: dict, rng: random.Random) -> tuple[list[dict], str, str]:
    """(prompt messages, correct answer, one of the example's plausible wrong answers)."""
    wrong = [w for w in example.get("distractors", []) if grade(example, w) == 0.0]
    if not wrong:
        raise ValueError(f"example {example.get('id', '?')} has no wrong answer to pair with")
    return to_messages(example, with_answer=False), example["answer"], rng.choice(wrong)


def task_sft_examples(examples: list[dict]) -> list[list[dict]]:
    """SFT conversations [user prompt, assistant answer], one per example (from generate_tasks)."""
    return [to_messages(ex) for ex in examples]


def task_preference_pairs(examples: list[dict], seed: int = 0) -> list[tuple[list[dict], str, str]]:
    """(prompt messages, chosen = the correct answer, rejected = one of its distractors) per example,
    the shape read_preferences returns; the seed picks the distractors."""
    rng = random.Random(f"kiln-pairs|{seed}")
    return [preference_pair(ex, rng) for ex in examples]


def train_tasks(cfg: TaskConfig) -> list[dict]:
    """The [tasks] train split: `train_per_family` problems of each family (SFT data, pairs, RL prompts)."""
    return [
        ex
        for i, family in enumerate(cfg.families)
        for ex in generate_tasks(
            family, cfg.train_per_family, split="train", difficulty=cfg.difficulty, seed=cfg.seed + 104729 * (i + 1)
        )
    ]


def heldout_tasks(cfg: TaskConfig) -> list[dict]:
    """The [tasks] held-out split: the problems every stage's held-out accuracy is measured on."""
    return [
        ex
        for i, family in enumerate(cfg.families)
        for ex in generate_tasks(
            family, cfg.heldout_per_family, split="heldout", difficulty=cfg.difficulty, seed=cfg.seed + 7919 * (i + 1)
        )
    ]
