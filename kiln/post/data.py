"""Post-training data: instruction conversations, preference pairs and prompt sets, and SFT packing.

Inputs are JSONL files (`.jsonl`/`.ndjson`, optionally `.gz`/`.zst`) or Parquet, given as files,
folders or globs exactly as for raw documents (kiln/data/readers.py). A malformed record never stops
a read: it is counted by reason and, when `rejected_path` is given, written there as one JSON line
`{"file", "line", "reason", "detail", "raw"}`. A read that keeps nothing raises DataError with the
counts and the first rejection, since training on nothing is never what the user meant.

Record formats (an optional `"system": str` is prepended as the system message in all of them):

- SFT: `{"messages": [{"role", "content"}, ...]}` or `{"prompt": str | messages, "response": str}`;
- preferences: `{"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}`, where
  chosen/rejected given as messages end with the assistant's reply; without "prompt", the messages
  before that reply are the prompt and must be the same in chosen and rejected;
- prompts: `{"prompt": str | messages}` with optional `"answer"` and `"task"` (the keys `grade` uses);
- judge candidates (`kiln judge`): `{"prompt": str | messages, "completion_a": str, "completion_b": str}`.

`pack_sft` packs tokenised conversations into fixed-length rows by best-fit-decreasing, with
position ids restarting at each conversation and a document id per conversation so attention can
be masked between them.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from kiln.data.chat import message_problem
from kiln.data.readers import (
    NOT_UTF8_ROW,
    decompress_errors,
    has_lone_surrogate,
    input_format,
    iter_jsonl,
    list_named_inputs,
    parquet_rows,
    rejection,
)
from kiln.errors import DataError

IGNORE_INDEX = -100
FIRST_REJECTIONS = 5  # kept in stats for the log line; the full list goes to rejected_path

Parsed = tuple[object, None] | tuple[None, tuple[str, str]]  # (item, None) or (None, (reason, detail))


# ---- record parsing ------------------------------------------------------------------------------


def _system(record: dict) -> tuple[list[dict] | None, tuple[str, str] | None]:
    system = record.get("system")
    if system is None:
        return [], None
    if not isinstance(system, str):
        return None, ("bad_system", f"system must be a string, got {type(system).__name__}")
    return [{"role": "system", "content": system}], None


def _prompt_messages(record: dict) -> tuple[list[dict] | None, tuple[str, str] | None]:
    """The prompt as messages (system + user), checked; it must end with a user message."""
    prompt = record.get("prompt")
    if prompt is None:
        return None, ("missing_prompt", "no prompt field")
    system, problem = _system(record)
    if problem:
        return None, problem
    if isinstance(prompt, str):
        messages = system + [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if system and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
            return None, ("misplaced_system", "both a system field and a system message in the prompt")
        messages = system + [_plain(m) for m in prompt]
    else:
        return None, ("bad_prompt", f"prompt must be a string or a list of messages, got {type(prompt).__name__}")
    problem = message_problem(messages)
    if problem:
        return None, problem
    if messages[-1]["role"] != "user":
        return None, ("bad_prompt", "the prompt must end with a user message")
    return messages, None


def _plain(message):
    """A message reduced to role and content (other keys such as "name" are not rendered)."""
    if isinstance(message, dict):
        return {"role": message.get("role"), "content": message.get("content")}
    return message


def parse_sft(record: dict) -> Parsed:
    has_messages = record.get("messages") is not None
    has_pair = record.get("prompt") is not None or record.get("response") is not None
    if has_messages and has_pair:
        return None, ("ambiguous_record", "both messages and prompt/response given")
    if has_messages:
        raw = record["messages"]
        system, problem = _system(record)
        if problem:
            return None, problem
        messages = system + [_plain(m) for m in raw] if isinstance(raw, list) else raw
    elif has_pair:
        messages, problem = _prompt_messages(record)
        if problem:
            return None, problem
        response = record.get("response")
        if response is None:
            return None, ("missing_response", "a prompt without a response")
        if not isinstance(response, str):
            return None, ("bad_response", f"response must be a string, got {type(response).__name__}")
        messages = messages + [{"role": "assistant", "content": response}]
    else:
        return None, ("missing_messages", "neither messages nor prompt/response")
    problem = message_problem(messages)
    if problem:
        return None, problem
    if not any(m["role"] == "assistant" for m in messages):
        return None, ("no_assistant", "no assistant message: nothing to learn")
    return messages, None


def _reply(value, name: str) -> tuple[list[dict], str] | tuple[None, tuple[str, str]]:
    """(messages before the reply, reply text) of a chosen/rejected field."""
    if isinstance(value, str):
        if has_lone_surrogate(value):
            return None, ("bad_utf8", f"{name} is not valid Unicode (lone surrogate)")
        return [], value
    if not isinstance(value, list):
        return None, (f"bad_{name}", f"{name} must be a string or a list of messages, got {type(value).__name__}")
    messages = [_plain(m) for m in value]
    problem = message_problem(messages)
    if problem:
        return None, (problem[0], f"{name}: {problem[1]}")
    if messages[-1]["role"] != "assistant":
        return None, (f"bad_{name}", f"{name} must end with an assistant message")
    return messages[:-1], messages[-1]["content"]


def parse_preference(record: dict) -> Parsed:
    for name in ("chosen", "rejected"):
        if record.get(name) is None:
            return None, (f"missing_{name}", f"no {name} field")
    chosen_history, chosen = _reply(record["chosen"], "chosen")
    if chosen_history is None:
        return None, chosen
    rejected_history, rejected = _reply(record["rejected"], "rejected")
    if rejected_history is None:
        return None, rejected
    if record.get("prompt") is not None:
        if chosen_history or rejected_history:
            return None, ("ambiguous_record", "a prompt and also a history inside chosen/rejected")
        prompt, problem = _prompt_messages(record)
        if problem:
            return None, problem
    else:
        if chosen_history != rejected_history:
            return None, ("prompt_mismatch", "chosen and rejected continue different conversations")
        system, problem = _system(record)
        if problem:
            return None, problem
        prompt = system + chosen_history
        problem = message_problem(prompt)
        if problem:
            return None, ("missing_prompt", "no prompt field and no history in chosen") if problem[
                0
            ] == "empty_messages" else problem
        if prompt[-1]["role"] != "user":
            return None, ("bad_prompt", "the prompt must end with a user message")
    if chosen == rejected:
        return None, ("identical_pair", "chosen and rejected are the same text: no preference to learn")
    return (prompt, chosen, rejected), None


def parse_prompt(record: dict) -> Parsed:
    messages, problem = _prompt_messages(record)
    if problem:
        return None, problem
    answer = record.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    elif answer is not None and not isinstance(answer, str):
        return None, ("bad_answer", f"answer must be a string or an integer, got {type(answer).__name__}")
    if answer is not None and has_lone_surrogate(answer):
        return None, ("bad_utf8", "answer is not valid Unicode (lone surrogate)")
    task = record.get("task")
    if task is not None and not isinstance(task, str):
        return None, ("bad_task", f"task must be a string, got {type(task).__name__}")
    extra = {k: v for k, v in record.items() if k not in ("prompt", "system", "answer", "task", "messages")}
    return {**extra, "messages": messages, "prompt": messages[-1]["content"], "answer": answer, "task": task}, None


def parse_candidates(record: dict) -> Parsed:
    """(prompt messages, completion_a, completion_b) for the judge to rank."""
    prompt, problem = _prompt_messages(record)
    if problem:
        return None, problem
    completions = []
    for name in ("completion_a", "completion_b"):
        value = record.get(name)
        if value is None:
            return None, (f"missing_{name}", f"no {name} field")
        if not isinstance(value, str):
            return None, (f"bad_{name}", f"{name} must be a string, got {type(value).__name__}")
        if has_lone_surrogate(value):
            return None, ("bad_utf8", f"{name} is not valid Unicode (lone surrogate)")
        completions.append(value)
    if completions[0] == completions[1]:
        return None, ("identical_pair", "completion_a and completion_b are the same text: nothing to judge")
    return (prompt, *completions), None


# ---- reading ---------------------------------------------------------------------------------------


def _iter_records(path: Path) -> Iterator[tuple[int, dict | None, dict | str]]:
    """(line, record, raw text) or (line, None, rejection) for every record of one JSONL or Parquet file."""
    fmt = input_format(path)
    if fmt == "parquet":
        yield from _iter_parquet(path)
        return
    line_no = 0
    try:
        for line in iter_jsonl(path):
            line_no = line.number
            if line.problem == "bad_json":
                yield line_no, None, {**rejection(path, line_no, "bad_json", line.raw), "detail": str(line.error)}
            elif line.problem:
                yield line_no, None, rejection(path, line_no, line.problem, line.raw)
            else:
                yield line_no, line.record, line.raw
    except decompress_errors() as err:
        yield line_no + 1, None, rejection(path, line_no + 1, "corrupt_file", f"{type(err).__name__}: {err}")


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict | None, dict | str]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs the `pyarrow` package (pip install pyarrow)") from None
    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in parquet_rows(batch):
                row += 1
                if record is None:
                    yield row, None, rejection(path, row, "bad_utf8", NOT_UTF8_ROW)
                    continue
                # A table holding several formats has nulls in the columns a row does not use.
                record = {k: v for k, v in record.items() if v is not None}
                yield row, record, json.dumps(record, default=str)
    except (pyarrow.ArrowException, OSError) as err:
        yield row + 1, None, rejection(path, row + 1, "corrupt_file", f"{type(err).__name__}: {err}")


def _list_files(paths) -> list[tuple[Path, str]]:
    """JSONL and Parquet files of the inputs. Text files found in a folder or by a glob (a README
    next to the data) are skipped; one named explicitly is an error."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files, seen = [], set()
    for entry in paths:
        for path, name in list_named_inputs([entry]):
            if input_format(path) not in ("jsonl", "parquet"):
                if Path(entry) == path:
                    raise DataError(
                        f"{path}: post-training data must be JSONL (.jsonl/.ndjson, optionally .gz/.zst) or Parquet"
                    )
                continue
            if path.resolve() not in seen:
                seen.add(path.resolve())
                files.append((path, name))
    if not files:
        raise DataError(f"{', '.join(str(p) for p in paths)}: no JSONL or Parquet files")
    return files


def _read(
    paths, parse: Callable[[dict], Parsed], kind: str, rejected_path, with_location: bool = False
) -> tuple[list, dict]:
    files = _list_files(paths)
    items: list = []
    reasons: Counter = Counter()
    first: list[dict] = []
    records = 0
    out = None
    if rejected_path is not None:
        Path(rejected_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(rejected_path, "w", encoding="utf-8")
    try:
        for path, name in files:
            for line, record, rejected in _iter_records(path):
                records += 1
                if record is not None:
                    item, problem = parse(record)
                    if problem is None:
                        items.append((item, name, line) if with_location else item)
                        continue
                    rejected = {**rejection(path, line, problem[0], rejected), "detail": problem[1]}
                reasons[rejected["reason"]] += 1
                if len(first) < FIRST_REJECTIONS:
                    first.append(rejected)
                if out is not None:
                    out.write(json.dumps(rejected, ensure_ascii=False) + "\n")
    finally:
        if out is not None:
            out.close()
    stats = {
        "kind": kind,
        "files": len(files),
        "records": records,
        "kept": len(items),
        "rejected": records - len(items),
        "reasons": dict(sorted(reasons.items())),
        "first_rejections": first,
    }
    if not items:
        where = ", ".join(str(p) for p, _ in files[:3]) + (" ..." if len(files) > 3 else "")
        if not records:
            raise DataError(f"{where}: no {kind} records (the files are empty)")
        sample = first[0]
        raise DataError(
            f"{where}: no valid {kind} records; {records} rejected "
            f"({', '.join(f'{r}={n}' for r, n in sorted(reasons.items()))}); first: "
            f"{sample['file']}:{sample['line']} {sample['reason']}"
            + (f" ({sample['detail']})" if sample.get("detail") else "")
        )
    return items, stats


def read_sft(paths, rejected_path=None) -> tuple[list[list[dict]], dict]:
    """Conversations (lists of {"role", "content"} messages with at least one assistant turn)."""
    return _read(paths, parse_sft, "SFT", rejected_path)


def read_preferences(paths, rejected_path=None) -> tuple[list[tuple[list[dict], str, str]], dict]:
    """(prompt messages, chosen reply, rejected reply) triples."""
    return _read(paths, parse_preference, "preference", rejected_path)


def read_candidates(paths, rejected_path=None) -> tuple[list[tuple[list[dict], str, str]], dict]:
    """(prompt messages, completion_a, completion_b) triples for `kiln judge`."""
    return _read(paths, parse_candidates, "judge candidate", rejected_path)


def read_prompts(paths, rejected_path=None) -> tuple[list[dict], dict]:
    """Dicts with "messages" (to render), "prompt" (the last user text), "answer" and "task" (None
    when absent), plus the record's other fields; "id" defaults to `<file>:<line>`."""
    located, stats = _read(paths, parse_prompt, "prompt", rejected_path, with_location=True)
    out = []
    for item, name, line in located:
        if item.get("id") is None:
            item["id"] = f"{name}:{line}"
        out.append(item)
    return out, stats


def write_jsonl(path, records: Iterable) -> Path:
    """One JSON object per line (e.g. generated tasks, to feed `kiln sft` or keep as an eval set)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


# ---- SFT packing -----------------------------------------------------------------------------------


@dataclass
class PackedRow:
    """One training row of T = seq_len positions holding whole conversations.

    targets[t] is the token at t+1 when it belongs to the same conversation as t and its loss mask
    is 1, else IGNORE_INDEX (-100): the first token of a conversation is never predicted from the
    one before it. document_ids number the conversations 0, 1, ... in row order; padding gets the
    next id, so with document masking it attends to nothing real. `sources` are the indices of the
    conversations in the list given to pack_sft.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    sources: list[int]


class PackedRows(list):
    """The rows, plus `stats`: conversations, truncated, dropped, rows, tokens, target_tokens, fill."""

    stats: dict


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, bin index), sorted: the best fit is the first >= need
    for i in order:
        need = lengths[i]
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - need > 0:
            bisect.insort(free, (room - need, b))
    return bins


def pack_sft(tokenized: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int = 1) -> PackedRows:
    """Pack (ids, mask) conversations into rows of seq_len + 1 tokens (inputs and targets are the
    row shifted by one). A conversation longer than seq_len + 1 keeps its start and is counted in
    stats["truncated"]; one left with no target token (nothing to learn) is dropped and counted."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    capacity = seq_len + 1
    kept: list[tuple[list[int], list[int], int]] = []
    truncated = dropped = 0
    for index, (ids, mask) in enumerate(tokenized):
        if len(ids) != len(mask):
            raise DataError(f"conversation {index}: {len(ids)} ids but {len(mask)} mask values")
        if len(ids) > capacity:
            truncated += 1
            ids, mask = ids[:capacity], mask[:capacity]
        if not any(mask[1:]):  # the first token is never a target
            dropped += 1
            continue
        kept.append((list(ids), list(mask), index))
    rows = PackedRows()
    tokens = targets_counted = 0
    for members in _best_fit_decreasing([len(ids) for ids, _, _ in kept], capacity):
        row_ids: list[int] = []
        row_targets: list[int] = []
        positions: list[int] = []
        documents: list[int] = []
        for doc, member in enumerate(members):
            ids, mask, _ = kept[member]
            row_ids += ids
            row_targets += [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])] + [IGNORE_INDEX]
            positions += range(len(ids))
            documents += [doc] * len(ids)
        used = len(row_ids)
        pad = capacity - used
        tokens += used
        targets_counted += sum(t != IGNORE_INDEX for t in row_targets)
        row_ids += [pad_id] * pad
        row_targets += [IGNORE_INDEX] * pad
        positions += range(pad)
        documents += [len(members)] * pad
        # The row has capacity slots; inputs are the first seq_len and targets[t] predicts slot t+1,
        # which row_targets already holds at t.
        rows.append(
            PackedRow(
                inputs=torch.tensor(row_ids[:seq_len], dtype=torch.long),
                targets=torch.tensor(row_targets[:seq_len], dtype=torch.long),
                position_ids=torch.tensor(positions[:seq_len], dtype=torch.long),
                document_ids=torch.tensor(documents[:seq_len], dtype=torch.long),
                sources=[kept[m][2] for m in members],
            )
        )
    rows.stats = {
        "conversations": len(tokenized),
        "truncated": truncated,
        "dropped": dropped,
        "rows": len(rows),
        "tokens": tokens,
        "target_tokens": targets_counted,
        "fill": round(tokens / (len(rows) * capacity), 4) if rows else 0.0,
    }
    return rows
