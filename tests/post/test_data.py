import gzip
import json
import random

import pytest
import torch

from kiln.errors import DataError
from kiln.post.data import (
    IGNORE_INDEX,
    _best_fit_decreasing,
    pack_sft,
    read_preferences,
    read_prompts,
    read_sft,
    write_jsonl,
)

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731


def write_lines(path, lines):
    """Lines are dicts (written as JSON) or raw bytes/str written as they are."""
    with open(path, "wb") as fh:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            fh.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


# ---- SFT ---------------------------------------------------------------------------------------------

SFT_GOOD = [
    ({"messages": [U("hi"), A("hello")]}, [U("hi"), A("hello")]),
    (
        {"messages": [S("be brief"), U("2+2?"), A("4"), U("and 3+3?"), A("6")]},
        [S("be brief"), U("2+2?"), A("4"), U("and 3+3?"), A("6")],
    ),
    ({"prompt": "What is 1+1?", "response": "2"}, [U("What is 1+1?"), A("2")]),
    ({"prompt": "q", "response": "r", "system": "sys"}, [S("sys"), U("q"), A("r")]),
    (
        {"messages": [U("x"), {"role": "assistant", "content": "y", "name": "bot"}], "system": "s"},
        [S("s"), U("x"), A("y")],
    ),
]
SFT_BAD = [  # (line, reason)
    (b'{"messages": [', "bad_json"),
    (b"[1, 2]", "not_an_object"),
    (b'{"prompt": "caf\xe9", "response": "r"}', "bad_utf8"),
    ({"text": "pretraining text, not a conversation"}, "missing_messages"),
    ({"messages": "hi"}, "messages_not_list"),
    ({"messages": []}, "empty_messages"),
    ({"messages": ["hi", A("x")]}, "bad_message"),
    ({"messages": [{"role": "bot", "content": "x"}, A("y")]}, "unknown_role"),
    ({"messages": [U("x"), {"role": "assistant", "content": None}]}, "content_not_string"),
    ({"messages": [U("x"), S("late"), A("y")]}, "misplaced_system"),
    ({"messages": [U("only a question")]}, "no_assistant"),
    ({"messages": [U("x"), A("y")], "prompt": "q", "response": "r"}, "ambiguous_record"),
    ({"prompt": "q"}, "missing_response"),
    ({"prompt": "q", "response": ["r"]}, "bad_response"),
    ({"prompt": 7, "response": "r"}, "bad_prompt"),
    ({"prompt": "q", "response": "r", "system": 1}, "bad_system"),
    ('{"prompt": "q", "response": "\\ud800"}', "bad_utf8"),
]


def test_read_sft_keeps_good_records_and_quarantines_each_bad_kind(tmp_path):
    lines, expected_reasons = [], {}
    for i in range(max(len(SFT_GOOD), len(SFT_BAD))):
        if i < len(SFT_GOOD):
            lines.append(SFT_GOOD[i][0])
        if i < len(SFT_BAD):
            expected_reasons[len(lines) + 1] = SFT_BAD[i][1]
            lines.append(SFT_BAD[i][0])
    lines.insert(3, "   ")  # blank lines are not records
    expected_reasons = {(k + 1 if k > 3 else k): v for k, v in expected_reasons.items()}
    path = write_lines(tmp_path / "sft.jsonl", lines)
    rejected = tmp_path / "out" / "rejected" / "sft.jsonl"
    examples, stats = read_sft([path], rejected_path=rejected)
    assert examples == [want for _, want in SFT_GOOD]
    assert stats["kept"] == len(SFT_GOOD) and stats["rejected"] == len(SFT_BAD)
    assert stats["records"] == len(SFT_GOOD) + len(SFT_BAD)
    counts = {}
    for _, reason in SFT_BAD:
        counts[reason] = counts.get(reason, 0) + 1
    assert stats["reasons"] == counts
    quarantined = [json.loads(line) for line in rejected.read_text().splitlines()]
    assert {r["line"]: r["reason"] for r in quarantined} == expected_reasons
    assert all(r["file"] == str(path) and r["raw"] for r in quarantined)
    assert stats["first_rejections"] == quarantined[:5]
    by_reason = {r["reason"]: r for r in quarantined}
    assert "role 'bot'" in by_reason["unknown_role"]["detail"]


def test_read_sft_gzip_parquet_and_folders(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    with gzip.open(data / "a.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"prompt": "p1", "response": "r1"}) + "\n")
    rows = [
        {"messages": [U("p2"), A("r2")], "prompt": None, "response": None},
        {"messages": None, "prompt": "p3", "response": "r3"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), data / "sub" / "b.parquet")
    (data / "README.md").write_text("# not data: skipped inside a folder")
    examples, stats = read_sft(data)
    assert examples == [[U("p1"), A("r1")], [U("p2"), A("r2")], [U("p3"), A("r3")]]
    assert stats["files"] == 2
    with pytest.raises(DataError, match="must be JSONL"):
        read_sft(data / "README.md")


def test_nothing_valid_is_a_clear_error(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [b"{oops", {"messages": [U("q")]}])
    with pytest.raises(
        DataError,
        match=r"no valid SFT records; 2 rejected \(bad_json=1, no_assistant=1\); "
        r"first: .*bad.jsonl:1 bad_json",
    ):
        read_sft(path)
    write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="no SFT records"):
        read_sft(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="no such file"):
        read_sft(tmp_path / "missing.jsonl")


# ---- preferences and prompts -------------------------------------------------------------------------


def test_read_preferences_formats_and_rejections(tmp_path):
    good = [
        ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, ([U("2+2?")], "4", "5")),
        (
            {"prompt": [U("hi"), A("hello"), U("2+2?")], "chosen": [A("4")], "rejected": [A("22")], "system": "s"},
            ([S("s"), U("hi"), A("hello"), U("2+2?")], "4", "22"),
        ),
        ({"chosen": [U("q"), A("good")], "rejected": [U("q"), A("bad")]}, ([U("q")], "good", "bad")),
    ]
    bad = [
        ({"prompt": "q", "rejected": "x"}, "missing_chosen"),
        ({"prompt": "q", "chosen": "x"}, "missing_rejected"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical_pair"),
        ({"chosen": [U("q1"), A("a")], "rejected": [U("q2"), A("b")]}, "prompt_mismatch"),
        ({"prompt": "q", "chosen": [U("q"), A("a")], "rejected": "b"}, "ambiguous_record"),
        ({"prompt": "q", "chosen": [U("not a reply")], "rejected": "b"}, "bad_chosen"),
        ({"prompt": "q", "chosen": "a", "rejected": 3}, "bad_rejected"),
        ({"chosen": "a", "rejected": "b"}, "missing_prompt"),
        ({"prompt": [U("q"), A("a")], "chosen": "a", "rejected": "b"}, "bad_prompt"),
        ('{"prompt": "q", "chosen": "\\udfff", "rejected": "b"}', "bad_utf8"),
    ]
    path = write_lines(tmp_path / "pairs.jsonl", [g for g, _ in good] + [b for b, _ in bad])
    pairs, stats = read_preferences(path, rejected_path=tmp_path / "rejected.jsonl")
    assert pairs == [want for _, want in good]
    assert stats["reasons"] == {reason: 1 for _, reason in bad}
    lines = [json.loads(x) for x in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in lines] == [
        (len(good) + 1 + i, reason) for i, (_, reason) in enumerate(bad)
    ]


def test_read_prompts_ids_answers_and_extra_fields(tmp_path):
    path = write_lines(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "task": "arithmetic", "difficulty": 1},
            {"prompt": [S("s"), U("Name a colour")], "id": "c1"},
            {"prompt": "q", "answer": [4]},
            {"prompt": "q", "task": 5},
            {"answer": "4"},
        ],
    )
    prompts, stats = read_prompts(path)
    assert prompts == [
        {
            "id": "prompts.jsonl:1",
            "difficulty": 1,
            "messages": [U("What is 2+2?")],
            "prompt": "What is 2+2?",
            "answer": "4",
            "task": "arithmetic",
        },
        {"id": "c1", "messages": [S("s"), U("Name a colour")], "prompt": "Name a colour", "answer": None, "task": None},
    ]
    assert stats["reasons"] == {"bad_answer": 1, "bad_task": 1, "missing_prompt": 1}


def test_generated_tasks_round_trip_through_jsonl(tmp_path):
    from kiln.post.tasks import generate_tasks, grade

    tasks = generate_tasks("arithmetic", 20, split="heldout", seed=3)
    prompts, _ = read_prompts(write_jsonl(tmp_path / "heldout.jsonl", tasks))
    for original, read in zip(tasks, prompts):
        assert {k: read[k] for k in original} == original
        assert read["messages"] == [U(original["prompt"])]
        assert grade(read, original["answer"]) == 1.0


# ---- packing -------------------------------------------------------------------------------------------


def reference_bfd(lengths, capacity):
    """Best-fit-decreasing the slow, obvious way: each item (longest first, ties by index) goes to
    the open bin with the least room left that still fits it (ties: the earliest bin)."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
        else:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def test_best_fit_decreasing_matches_reference_and_fills_perfect_instances():
    rng = random.Random(0)
    for _ in range(200):
        capacity = rng.randint(5, 40)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 60))]
        assert _best_fit_decreasing(lengths, capacity) == reference_bfd(lengths, capacity)
    assert sorted(map(sorted, _best_fit_decreasing([6, 4, 5, 5, 3, 7], 10))) == [[0, 1], [2, 3], [4, 5]]


def synthetic(rng, n, max_len):
    """Conversations whose tokens encode (conversation, position), so any mix-up shows."""
    out = []
    for c in range(n):
        length = rng.randint(2, max_len)
        ids = [16 + c * 1000 + k for k in range(length)]
        mask = [int(rng.random() < 0.6) for _ in range(length)]
        mask[-1] = 1
        out.append((ids, mask))
    return out


def test_packed_rows_reproduce_every_conversation(tmp_path):
    rng = random.Random(1)
    seq_len = 32
    tokenized = synthetic(rng, 150, 50)
    tokenized.append(([16 + 999_000, 16 + 999_001], [1, 0]))  # nothing to learn: dropped
    rows = pack_sft(tokenized, seq_len, pad_id=1)
    seen = []
    for row in rows:
        T = seq_len
        for t in (row.inputs, row.targets, row.position_ids, row.document_ids):
            assert t.shape == (T,) and t.dtype == torch.long
        docs = row.document_ids.tolist()
        assert docs == sorted(docs) and docs[0] == 0
        for d, source in enumerate(row.sources):
            pos = [t for t in range(T) if docs[t] == d]
            assert pos == list(range(pos[0], pos[0] + len(pos)))  # contiguous
            ids, mask = tokenized[source]
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            n = len(pos)
            # Every token is an input, except the last one of a conversation that ends the row.
            assert n == len(ids) or (n == len(ids) - 1 and pos[-1] == T - 1)
            assert row.inputs[pos].tolist() == ids[:n]
            assert row.position_ids[pos].tolist() == list(range(n))
            want = [ids[k + 1] if k + 1 < len(ids) and mask[k + 1] else IGNORE_INDEX for k in range(n)]
            assert row.targets[pos].tolist() == want
            seen.append(source)
        padding = [t for t in range(T) if docs[t] == len(row.sources)]
        assert all(row.inputs[t] == 1 and row.targets[t] == IGNORE_INDEX for t in padding)
        assert padding == list(range(T - len(padding), T))
    assert sorted(seen) == list(range(150))  # each once, the dropped one nowhere
    long = [i for i, (ids, _) in enumerate(tokenized[:150]) if len(ids) > seq_len + 1]
    assert rows.stats["truncated"] == len(long) > 0
    assert rows.stats["dropped"] == 1 and rows.stats["rows"] == len(rows)
    assert (
        rows.stats["target_tokens"]
        == sum(int((r.targets != IGNORE_INDEX).sum()) for r in rows)
        == sum(sum(mask[1 : seq_len + 1]) for _, mask in tokenized[:150])
    )


def test_pack_rendered_task_conversations(tmp_path):
    """Real chat rows: every learned target is an answer token or <|end|>, never a prompt token."""
    from kiln.data.chat import render_conversations
    from kiln.data.config import TokenizerConfig
    from kiln.data.tokenizer import Tokenizer, train_tokenizer
    from kiln.post.tasks import generate_tasks, task_sft_examples

    conversations = task_sft_examples(generate_tasks("sort", 60) + generate_tasks("arithmetic", 60))
    texts = [m["content"] for c in conversations for m in c]
    train_tokenizer(texts, TokenizerConfig(vocab_size=512), tmp_path, heldout=[])
    tok = Tokenizer.load(tmp_path)
    tokenized = render_conversations(tok, conversations)
    rows = pack_sft(tokenized, 64, pad_id=tok.token_id("<|pad|>"))
    assert rows.stats["truncated"] == rows.stats["dropped"] == 0 and rows.stats["fill"] > 0.8
    learned = {}
    for row in rows:
        for d, source in enumerate(row.sources):
            keep = (row.document_ids == d) & (row.targets != IGNORE_INDEX)
            learned[source] = row.targets[keep].tolist()
    for source, conversation in enumerate(conversations):
        assert tok.decode(learned[source]) == conversation[-1]["content"] + "<|end|>"


def test_pack_rejects_bad_input():
    with pytest.raises(DataError, match="2 ids but 1 mask"):
        pack_sft([([1, 2], [1])], 8)
    with pytest.raises(ValueError, match="seq_len"):
        pack_sft([([1, 2], [1, 1])], 0)


def test_read_sft_parquet_row_that_is_not_utf8_is_quarantined(tmp_path):
    pytest.importorskip("pyarrow")
    from kiln_testing.text import write_parquet_with_bad_utf8

    path = tmp_path / "sft.parquet"
    write_parquet_with_bad_utf8(path, {"prompt": ["q1", "q2", "q3"], "response": ["r1", "r2", "r3"]}, "response", 2)
    examples, stats = read_sft([path], rejected_path=tmp_path / "rejected.jsonl")
    assert stats["kept"] == 2 and stats["reasons"] == {"bad_utf8": 1}
    assert json.loads((tmp_path / "rejected.jsonl").read_text())["line"] == 3
