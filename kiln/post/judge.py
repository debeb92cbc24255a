"""`kiln judge`: RLAIF preference pairs. An AI judge compares two completions of each prompt against a
written rubric (a "constitution" of principles) and says which is better.

Every pair is judged twice, once as (A = a, B = b) and once swapped, because judges favour a
position: a model that always answers "A" would otherwise pick `a` every time and look decisive. A
pair is kept only when both orders pick the same completion; one that flips with the order counts as
`disagreed`, one with a tie in either order as `tie`, one with an invalid verdict in either order as
`invalid`. The report gives these counts, the agreement rate (kept / (kept + disagreed): the pairs
where both orders gave a decisive verdict) and how often a decisive verdict named position A (0.5 over
both orders of consistent pairs; 1.0 for a judge that always says "A").

The judges (kiln/post/judge_backends.py): `KilnJudge`, a Kiln checkpoint scored by its
log-probability of replying "A" versus "B", and `OpenAIJudge`, any model behind an OpenAI-compatible
API (`kiln serve` included), asked for one letter at temperature 0.

The kept pairs are written as `{"prompt", "chosen", "rejected"}` JSONL, the format `kiln rm` and
`kiln dpo` read (`rm.files`, `dpo.files`). Candidates come from JSONL `{"prompt", "completion_a",
"completion_b"}` or are two samples per prompt from a policy checkpoint. See docs/rlaif.md.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Sequence

from kiln.checkpoint import resolve_checkpoint
from kiln.config import build, parse_override, read_toml, set_dotted, show_key
from kiln.data.chat import render_prompt
from kiln.data.tokenizer import find_tokenizer
from kiln.errors import ConfigError, DataError
from kiln.infer.load import InferenceOptions, load_for_inference
from kiln.post.config import JudgeConfig
from kiln.post.data import read_candidates, read_prompts, write_jsonl
from kiln.post.evaluate import complete, strip_stop
from kiln.post.judge_backends import LETTERS, Judge, KilnJudge, OpenAIJudge, Verdict

JUDGE_SYSTEM = (
    "You are an impartial judge. You read a conversation and two candidate responses to it, and you "
    "decide which response better follows these principles:\n\n{rubric}\n\n"
    "Judge the content, not the order or the length of the responses. "
    "Reply with a single letter: A if Response A is better, B if Response B is better."
)
JUDGE_USER = "{conversation}\n\n[Response A]\n{first}\n\n[Response B]\n{second}\n\nWhich response is better, A or B?"


def judging_conversation(rubric: str, prompt: list[dict], first: str, second: str) -> list[dict]:
    """The chat messages that ask the judge about one order of one pair."""
    if len(prompt) == 1:
        conversation = f"[Prompt]\n{prompt[0]['content']}"
    else:
        conversation = "[Conversation]\n" + "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return [
        {"role": "system", "content": JUDGE_SYSTEM.format(rubric=rubric.strip())},
        {"role": "user", "content": JUDGE_USER.format(conversation=conversation, first=first, second=second)},
    ]


# ---- both orders -----------------------------------------------------------------------------------


def combine(forward: Verdict, swapped: Verdict) -> tuple[str, str | None]:
    """(outcome, winner) of a pair judged as (a, b) and as (b, a); winner is "a", "b" or None."""
    choices = (forward.choice, swapped.choice)
    if "invalid" in choices:
        return "invalid", None
    if "tie" in choices:
        return "tie", None
    first = "a" if forward.choice == "A" else "b"
    second = "b" if swapped.choice == "A" else "a"
    return ("kept", first) if first == second else ("disagreed", None)


def judge_both_orders(
    judge: Judge, rubric: str, candidates: Sequence[tuple[list[dict], str, str]]
) -> tuple[list[dict], dict]:
    """(preference records of the kept pairs, report). `candidates`: (prompt messages, a, b)."""
    conversations = []
    for prompt, a, b in candidates:
        conversations += [judging_conversation(rubric, prompt, a, b), judging_conversation(rubric, prompt, b, a)]
    verdicts = judge.judge(conversations)
    records, outcomes, invalid = [], Counter(), Counter()
    decisive = picked_first = 0
    for k, (prompt, a, b) in enumerate(candidates):
        forward, swapped = verdicts[2 * k], verdicts[2 * k + 1]
        for verdict in (forward, swapped):
            if verdict.choice == "invalid":
                invalid[verdict.reason] += 1
            elif verdict.choice in LETTERS:
                decisive += 1
                picked_first += verdict.choice == "A"
        outcome, winner = combine(forward, swapped)
        outcomes[outcome] += 1
        if winner is not None:
            records.append(preference_record(prompt, a, b, winner, forward, swapped))
    both_decisive = outcomes["kept"] + outcomes["disagreed"]
    report = {
        "pairs": len(candidates),
        "kept": outcomes["kept"],
        "disagreed": outcomes["disagreed"],
        "ties": outcomes["tie"],
        "invalid": outcomes["invalid"],
        "agreement_rate": outcomes["kept"] / both_decisive if both_decisive else None,
        "picked_first_rate": picked_first / decisive if decisive else None,
        "invalid_verdicts": dict(sorted(invalid.items())),
    }
    return records, report


def preference_record(prompt, a: str, b: str, winner: str, forward: Verdict, swapped: Verdict) -> dict:
    chosen, rejected = (a, b) if winner == "a" else (b, a)
    record = {"prompt": prompt[0]["content"] if len(prompt) == 1 else prompt, "chosen": chosen, "rejected": rejected}
    if forward.margin is not None and swapped.margin is not None:
        # The winner's log-prob lead over the loser, averaged over the two orders: a constant
        # preference for one position cancels out.
        lead = (forward.margin - swapped.margin) / 2
        record["judge_margin"] = lead if winner == "a" else -lead
    return record


# ---- the run: candidates, the judge, the files -----------------------------------------------------


def load_checkpoint(path: str, tokenizer_path: str, device: str, key: str):
    """(model, tokenizer) of a Kiln checkpoint for inference; errors name the judge.* key."""
    try:
        resolve_checkpoint(path)
    except DataError as err:  # no such checkpoint, not a checkpoint folder, a pickle, ...
        raise ConfigError(f"judge.{key}", str(err)) from None
    if not tokenizer_path:
        try:
            tokenizer_path = find_tokenizer(path)
        except DataError:
            hint = "; set judge.tokenizer" if key == "checkpoint" else ""
            raise ConfigError(
                f"judge.{key}", f"{path}: no tokenizer.json beside it or in its run folder{hint}"
            ) from None
    try:
        return load_for_inference(path, tokenizer_path, InferenceOptions(device=device))
    except ConfigError as err:  # load_for_inference names its command-line flag
        flag = err.key.removeprefix("--")
        named = flag if flag == "device" or (flag == "tokenizer" and key == "checkpoint") else key
        raise ConfigError(f"judge.{named}", err.message) from None
    except DataError as err:  # an unreadable tokenizer or weights file
        raise ConfigError(f"judge.{key}", str(err)) from None


def read_rubric(cfg: JudgeConfig) -> str:
    if cfg.rubric.strip():
        return cfg.rubric
    try:
        text = Path(cfg.rubric_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("judge.rubric_file", f"{cfg.rubric_file}: cannot read the rubric ({err})") from None
    if not text.strip():
        raise ConfigError("judge.rubric_file", f"{cfg.rubric_file}: the rubric is empty")
    return text


def sample_candidates(cfg: JudgeConfig, rejected_path: Path) -> tuple[list, dict]:
    """Two samples per prompt from the policy checkpoint; a prompt whose samples are the same text is
    skipped (there is nothing to compare) and counted."""
    prompts, read_stats = read_prompts(cfg.prompts, rejected_path=rejected_path)
    model, tokenizer = load_checkpoint(cfg.policy, "", cfg.device, "policy")
    ids = [render_prompt(tokenizer, p["messages"]) for p in prompts]
    outs = complete(model, tokenizer, [x for x in ids for _ in LETTERS], cfg.max_new_tokens, cfg.temperature, cfg.seed)
    texts = [tokenizer.decode(strip_stop(tokenizer, o)) for o in outs]
    candidates = [(p["messages"], texts[2 * k], texts[2 * k + 1]) for k, p in enumerate(prompts)]
    distinct = [c for c in candidates if c[1] != c[2]]
    return distinct, {"prompts": read_stats, "identical_samples": len(candidates) - len(distinct)}


def build_judge(cfg: JudgeConfig) -> Judge:
    if cfg.backend == "openai":
        return OpenAIJudge.from_config(cfg)
    model, tokenizer = load_checkpoint(cfg.checkpoint, cfg.tokenizer, cfg.device, "checkpoint")
    return KilnJudge(model, tokenizer, cfg.tie_margin, cfg.batch_size)


def companion(out: Path, suffix: str) -> Path:
    """`judged.jsonl` -> `judged<suffix>` beside it."""
    return out.with_name(out.name.removesuffix(".jsonl") + suffix)


def judge_candidates(cfg: JudgeConfig) -> dict:
    """Run `kiln judge`: read or sample the candidates, judge them in both orders, write the kept
    pairs to cfg.out and the report to <out>.stats.json; returns the report. Raises DataError after
    writing the report when no pair is kept, since training on nothing is never what was meant."""
    try:
        cfg.validate()
    except ConfigError as err:
        raise err.within("judge") from None
    rubric = read_rubric(cfg)
    out = Path(cfg.out)
    rejected = companion(out, ".rejected.jsonl")
    if cfg.candidates:
        candidates, read_stats = read_candidates(cfg.candidates, rejected_path=rejected)
        source = {"candidates": read_stats}
    else:
        candidates, source = sample_candidates(cfg, rejected)
    judge = build_judge(cfg)
    records, report = judge_both_orders(judge, rubric, candidates)
    write_jsonl(out, records)
    report = {**report, "backend": cfg.backend, "out": str(out), "source": source}
    companion(out, ".stats.json").write_text(json.dumps(report, indent=2))
    if not records:
        raise DataError(f"{out}: the judge kept no pair of {report['pairs']} ({summary(report)})")
    return report


def summary(report: dict) -> str:
    agreement = report["agreement_rate"]
    shown = "n/a" if agreement is None else f"{agreement:.2f}"
    return (
        f"kept {report['kept']}, disagreed {report['disagreed']}, ties {report['ties']}, "
        f"invalid {report['invalid']}; agreement between the orders {shown}"
    )


def load_judge_config(path, overrides: Sequence[str] = ()) -> JudgeConfig:
    """The [judge] table of a TOML file, with `judge.key=value` overrides, built and validated."""
    source = str(path)
    raw = read_toml(path)
    try:
        for item in overrides:
            set_dotted(raw, *parse_override(item))
        extra = [name for name in raw if name != "judge"]
        if extra:
            raise ConfigError(show_key(extra[0]), "unknown section; a judge file holds one table, [judge]")
        if not isinstance(raw.get("judge"), dict):
            raise ConfigError("judge", "missing: the file needs a [judge] table")
        cfg = build(JudgeConfig, raw["judge"], "judge")
        try:
            cfg.validate()
        except ConfigError as err:
            raise err.within("judge") from None
    except ConfigError as err:
        raise ConfigError(err.key, err.message, source) from None
    return cfg


# ---- the `kiln judge` verb -------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "judge", help="RLAIF: an AI judge ranks two completions per prompt against a rubric; writes preference pairs"
    )
    p.add_argument("config", help="TOML file with a [judge] table (docs/rlaif.md)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. judge.tie_margin=0.5 judge.out=pairs.jsonl")


def run(args) -> int:
    cfg = load_judge_config(args.config, args.overrides)
    report = judge_candidates(cfg)
    print(json.dumps({k: v for k, v in report.items() if k != "source"}))
    print(f"[judge] {report['pairs']} pairs: {summary(report)}; wrote {report['out']}")
    return 0
