"""`kiln judge`: an AI judge ranks two completions per prompt against a rubric, in both orders.

The judges are real models whose preference the test controls: `PrefersMarked` pushes a tiny
Transformer towards the letter of the response that contains a marker word (a judge that reads the
content), `ForcesToken` makes one reply "A" whatever it reads (a judge with pure position bias). The
OpenAI backend talks to a real `kiln serve` app over HTTP with the official client."""

import json

import openai
import pytest
import torch
from fastapi import FastAPI
from kiln_testing.models import ForcesToken, randomise
from kiln_testing.serving import serving

from kiln.checkpoint import save_weights
from kiln.cli import main
from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.post.config import JudgeConfig
from kiln.post.data import read_candidates, read_preferences
from kiln.post.judge import (
    combine,
    judge_both_orders,
    judge_candidates,
    judging_conversation,
    load_judge_config,
    sample_candidates,
)
from kiln.post.judge_backends import KilnJudge, OpenAIJudge, Verdict, parse_reply
from kiln.serve.app import create_app

RUBRIC = "1. Be factually correct.\n2. Be concise."
MARKER = "Paris"
KEY = "sk-judge-test"
CITIES = ["Lyon", "Nice", "Lille", "Rome", "Berlin", "Madrid", "Oslo", "Bern", "Vienna", "Dublin", "Prague", "Athens"]


class PrefersMarked(torch.nn.Module):
    """The model, pushed by `boost` towards replying with the letter of the response that contains
    `marker` (none when both or neither do); with `garbage` in the prompt it replies "x"."""

    def __init__(self, inner, tokenizer, marker=MARKER, boost=20.0, garbage="???"):
        super().__init__()
        self.inner, self.cfg, self.tokenizer = inner, inner.cfg, tokenizer
        self.marker, self.boost, self.garbage = marker, boost, garbage
        self.ids = {c: tokenizer.encode(c, parse_special=False)[0] for c in "ABx"}

    def forward(self, tokens, kv_cache=None, **kwargs):
        logits = self.inner(tokens, kv_cache=kv_cache, **kwargs)
        for row in range(tokens.shape[0]):
            text = self.tokenizer.decode(tokens[row].tolist())
            if self.garbage in text:
                logits[row, :, self.ids["x"]] += 1000.0
                logits[row, :, [self.ids["A"], self.ids["B"]]] -= 1000.0
                continue
            if "[Response B]" not in text:
                continue
            first = text.split("[Response A]")[-1].split("[Response B]")[0]
            second = text.split("[Response B]")[-1]
            if (self.marker in first) != (self.marker in second):
                # Both letters come forward, as in a judge trained to answer with one; the right one more.
                logits[row, :, [self.ids["A"], self.ids["B"]]] += self.boost
                logits[row, :, self.ids["A" if self.marker in first else "B"]] += self.boost
        return logits


def candidates(n=8, start=0):
    """(prompt messages, a, b): the marked (right) answer is `a` in even pairs and `b` in odd ones."""
    out = []
    for k in range(start, start + n):
        right, wrong = f"The capital of France is {MARKER}.", f"The capital of France is {CITIES[k % len(CITIES)]}."
        prompt = [{"role": "user", "content": f"Question {k}: what is the capital of France?"}]
        out.append((prompt, right, wrong) if k % 2 == 0 else (prompt, wrong, right))
    return out


def write_candidates(path, items):
    lines = [json.dumps({"prompt": p[0]["content"], "completion_a": a, "completion_b": b}) for p, a, b in items]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def judge_model(tok, model_cfg):
    torch.manual_seed(0)
    return randomise(build_model(model_cfg(max_seq_len=512))).eval()


def test_content_judge_keeps_every_pair_with_the_marked_answer_chosen(tok, judge_model):
    records, report = judge_both_orders(KilnJudge(PrefersMarked(judge_model, tok), tok), RUBRIC, candidates())
    assert report["pairs"] == report["kept"] == 8
    assert report["agreement_rate"] == 1.0 and report["disagreed"] == report["ties"] == report["invalid"] == 0
    # Consistent over both orders, it named position A exactly half the time.
    assert report["picked_first_rate"] == 0.5
    assert all(MARKER in r["chosen"] and MARKER not in r["rejected"] for r in records)
    assert all(r["judge_margin"] > 10 for r in records)  # about the boost of 20, the model's own lean cancelled


def test_position_biased_judge_is_exposed_by_the_swapped_order(tok, judge_model):
    always_a = ForcesToken(judge_model, tok.encode("A", parse_special=False)[0], at=0)
    records, report = judge_both_orders(KilnJudge(always_a, tok), RUBRIC, candidates())
    assert records == []
    assert report["kept"] == 0 and report["disagreed"] == 8
    assert report["agreement_rate"] == 0.0 and report["picked_first_rate"] == 1.0


def test_verdict_is_the_log_prob_of_a_against_b_after_the_judging_prompt(tok, judge_model):
    """The batched, right-padded score equals log_softmax of one unpadded forward at the prompt's end."""
    judge = KilnJudge(judge_model, tok, batch_size=3)
    conversations = [judging_conversation(RUBRIC, p, a, b) for p, a, b in candidates(5)]
    conversations[1][1]["content"] += " A much longer question, so the batch is padded." * 3
    verdicts = judge.judge(conversations)
    a, b = tok.encode("A", parse_special=False)[0], tok.encode("B", parse_special=False)[0]
    for conversation, verdict in zip(conversations, verdicts):
        ids = torch.tensor([render_prompt(tok, conversation)])
        assert ids[0, -1] == tok.token_id("<|assistant|>")  # the verdict is the reply's first token
        logp = torch.log_softmax(judge_model(ids)[0, -1].float(), dim=-1)
        assert verdict.margin == pytest.approx((logp[a] - logp[b]).item(), abs=1e-4)
        assert verdict.choice == ("A" if verdict.margin > 0 else "B")


def test_ties_and_too_long_prompts_are_counted_not_kept(tok, judge_model, model_cfg):
    _, report = judge_both_orders(KilnJudge(judge_model, tok, tie_margin=1e9), RUBRIC, candidates(4))
    assert report["ties"] == 4 and report["kept"] == 0 and report["agreement_rate"] is None
    short = randomise(build_model(model_cfg(max_seq_len=32))).eval()
    _, report = judge_both_orders(KilnJudge(short, tok), RUBRIC, candidates(3))
    assert report["invalid"] == 3 and report["invalid_verdicts"] == {"too_long": 6}


@pytest.mark.parametrize(
    "forward, swapped, expected",
    [
        ("A", "B", ("kept", "a")),
        ("B", "A", ("kept", "b")),
        ("A", "A", ("disagreed", None)),
        ("B", "B", ("disagreed", None)),
        ("A", "tie", ("tie", None)),
        ("tie", "invalid", ("invalid", None)),
    ],
)
def test_both_orders_rule(forward, swapped, expected):
    assert combine(Verdict(forward), Verdict(swapped)) == expected


def test_kept_pairs_are_read_back_by_the_rm_and_dpo_reader(tok, judge_model, tmp_path):
    items = candidates(6)
    items[2] = ([{"role": "system", "content": "Be brief."}, *items[2][0]], items[2][1], items[2][2])
    records, _ = judge_both_orders(KilnJudge(PrefersMarked(judge_model, tok), tok), RUBRIC, items)
    path = tmp_path / "judged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs, stats = read_preferences([path])
    assert stats["rejected"] == 0
    right = [(p, a, b) if MARKER in a else (p, b, a) for p, a, b in items]
    assert pairs == right  # the system message of pair 2 included


# ---- the OpenAI backend, against `kiln serve` ------------------------------------------------------


@pytest.fixture(scope="module")
def served_judge(tok):
    """`kiln serve` of a PrefersMarked judge; yields its /v1 URL."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=512)
    model = PrefersMarked(randomise(build_model(cfg)).eval(), tok)
    # No prefix cache: PrefersMarked reads the marker off the tokens of each forward, and a cached
    # prefix is not forwarded again.
    app = create_app(model, tok, model_name="judge", api_keys=[KEY], prefix_cache_mb=0)
    with serving(app) as (base, _):
        yield base + "/v1"


def test_openai_backend_judges_through_kiln_serve_with_logprobs(served_judge):
    client = openai.OpenAI(base_url=served_judge, api_key=KEY, max_retries=0)
    records, report = judge_both_orders(OpenAIJudge(client, "judge"), RUBRIC, candidates(4))
    assert report["kept"] == 4 and report["agreement_rate"] == 1.0
    assert all(MARKER in r["chosen"] for r in records)
    assert all("judge_margin" in r for r in records)  # the letters' log-probs came back


def test_openai_replies_that_are_not_a_letter_are_counted_invalid(served_judge):
    client = openai.OpenAI(base_url=served_judge, api_key=KEY, max_retries=0)
    items = candidates(3)
    items[1] = (items[1][0], items[1][1] + " ???", items[1][2])
    records, report = judge_both_orders(OpenAIJudge(client, "judge"), RUBRIC, items)
    assert report["invalid"] == 1 and report["invalid_verdicts"] == {"unparseable": 2}
    assert report["kept"] == 2 and len(records) == 2


def test_kiln_judge_verb_with_the_openai_backend_writes_rm_pairs(served_judge, tmp_path, monkeypatch, capsys):
    write_candidates(tmp_path / "cands.jsonl", candidates(6))
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    (tmp_path / "judge.toml").write_text(
        "[judge]\n"
        f'rubric_file = "{tmp_path / "rubric.txt"}"\n'
        'backend = "openai"\n'
        f'base_url = "{served_judge}"\n'
        'model = "judge"\n'
        'api_key_env = "JUDGE_TEST_KEY"\n'
        f'candidates = ["{tmp_path / "cands.jsonl"}"]\n'
    )
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    out = tmp_path / "pairs.jsonl"
    assert main(["judge", str(tmp_path / "judge.toml"), f'judge.out="{out}"']) == 0
    assert (
        "6 pairs: kept 6, disagreed 0, ties 0, invalid 0; agreement between the orders 1.00" in capsys.readouterr().out
    )
    pairs, _ = read_preferences([out])
    assert len(pairs) == 6 and all(MARKER in chosen for _, chosen, _ in pairs)
    assert json.loads((tmp_path / "pairs.stats.json").read_text())["agreement_rate"] == 1.0
    # A refused key is one line naming the key to fix, not a traceback.
    monkeypatch.setenv("JUDGE_TEST_KEY", "wrong")
    assert main(["judge", str(tmp_path / "judge.toml"), f'judge.out="{out}"']) == 2
    assert "judge.api_key_env: the server refused the key in $JUDGE_TEST_KEY (401)" in capsys.readouterr().err


def test_text_only_server_and_unparseable_text():
    """A server without log-probs: it refuses them (400), the judge asks again without and reads the text."""
    app, replies = FastAPI(), iter(["B", " a", "maybe", "A"])

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        from fastapi.responses import JSONResponse

        if body.get("logprobs"):
            return JSONResponse({"error": {"message": "logprobs are not supported"}}, 400)
        assert body["max_tokens"] == 1 and body["temperature"] == 0
        message = {"role": "assistant", "content": next(replies)}
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        }

    @app.get("/health")
    async def health():
        return {}

    with serving(app) as (base, _):
        judge = OpenAIJudge(openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0), "m")
        verdicts = judge.judge([[{"role": "user", "content": "?"}]] * 4)
    assert [v.choice for v in verdicts] == ["B", "A", "invalid", "A"]
    assert verdicts[2].reason == "unparseable" and judge.logprobs is False


def test_letters_in_the_top_logprobs_decide_over_the_text():
    reply = openai.types.chat.ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": "The"},
                    "logprobs": {
                        "content": [
                            {
                                "token": "The",
                                "logprob": -0.1,
                                "bytes": None,
                                "top_logprobs": [
                                    {"token": "The", "logprob": -0.1, "bytes": None},
                                    {"token": " b", "logprob": -2.0, "bytes": None},
                                    {"token": "A", "logprob": -3.5, "bytes": None},
                                ],
                            }
                        ]
                    },
                }
            ],
        }
    )
    verdict = parse_reply(reply, tie_margin=0.0)
    assert verdict.choice == "B" and verdict.margin == pytest.approx(-1.5)
    assert parse_reply(reply, tie_margin=2.0).choice == "tie"
    # Only "A" among the top alternatives: it is likelier than "B", which did not make the list.
    reply.choices[0].logprobs.content[0].top_logprobs.pop(1)
    assert parse_reply(reply, tie_margin=0.0) == Verdict("A")
    reply.choices[0].logprobs.content[0].top_logprobs.pop(1)
    assert parse_reply(reply, tie_margin=0.0) == Verdict("invalid", reason="unparseable")  # the text is "The"


# ---- the verb, the config, candidates -----------------------------------------------------------


def always_a_checkpoint(tok, model_cfg, folder):
    """A saved checkpoint whose weights make it reply "A" to anything: every embedding is the same
    unit vector, the blocks add nothing (zero projections), and only the head's row of "A" reads it."""
    model = build_model(model_cfg(max_seq_len=512, tie_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        model.tok_embeddings.weight[:, 0] = 1.0
        model.output.weight[tok.encode("A", parse_special=False)[0], 0] = 10.0
    save_weights(folder, model.cfg, model.state_dict())
    (folder / "tokenizer.json").write_bytes(tok.path.read_bytes())
    return folder


def test_kiln_judge_verb_with_a_position_biased_checkpoint_keeps_nothing(tok, model_cfg, tmp_path, capsys):
    ckpt = always_a_checkpoint(tok, model_cfg, tmp_path / "always_a")
    write_candidates(tmp_path / "cands.jsonl", candidates(4))
    (tmp_path / "judge.toml").write_text(
        f'[judge]\nrubric = "{RUBRIC.splitlines()[0]}"\ncheckpoint = "{ckpt}"\ndevice = "cpu"\n'
        f'candidates = ["{tmp_path / "cands.jsonl"}"]\nout = "{tmp_path / "judged.jsonl"}"\n'
    )
    assert main(["judge", str(tmp_path / "judge.toml")]) == 2
    err = capsys.readouterr().err
    assert (
        "the judge kept no pair of 4 (kept 0, disagreed 4, ties 0, invalid 0; agreement between the orders 0.00)" in err
    )
    report = json.loads((tmp_path / "judged.stats.json").read_text())
    assert report["picked_first_rate"] == 1.0 and report["source"]["candidates"]["kept"] == 4


@pytest.mark.parametrize(
    "table, key",
    [
        ({"rubric": "x", "checkpoint": "c", "candidates": ["f"], "colour": 1}, "judge.colour"),
        ({"checkpoint": "c", "candidates": ["f"]}, "judge.rubric"),
        ({"rubric": "x", "rubric_file": "r.txt", "checkpoint": "c", "candidates": ["f"]}, "judge.rubric"),
        ({"rubric": "x", "checkpoint": "c", "model": "gpt", "candidates": ["f"]}, "judge.model"),
        (
            {"rubric": "x", "backend": "openai", "model": "m", "checkpoint": "c", "candidates": ["f"]},
            "judge.checkpoint",
        ),
        ({"rubric": "x", "backend": "openai", "model": "m", "device": "cpu", "candidates": ["f"]}, "judge.device"),
        ({"rubric": "x", "backend": "openai", "candidates": ["f"]}, "judge.model"),
        ({"rubric": "x", "backend": "claude", "candidates": ["f"]}, "judge.backend"),
        ({"rubric": "x", "checkpoint": "c"}, "judge.candidates"),
        ({"rubric": "x", "checkpoint": "c", "candidates": ["f"], "policy": "p"}, "judge.candidates"),
        ({"rubric": "x", "checkpoint": "c", "candidates": ["f"], "temperature": 0.5}, "judge.temperature"),
        ({"rubric": "x", "checkpoint": "c", "policy": "p"}, "judge.prompts"),
        ({"rubric": "x", "checkpoint": "c", "policy": "p", "prompts": ["q"], "temperature": 0.0}, "judge.temperature"),
        ({"rubric": "x", "checkpoint": "c", "candidates": ["f"], "tie_margin": -1.0}, "judge.tie_margin"),
        ({"rubric": "x", "checkpoint": "c", "candidates": ["f"], "batch_size": "8"}, "judge.batch_size"),
    ],
)
def test_every_key_is_checked_and_named(tmp_path, table, key):
    lines = [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    (tmp_path / "j.toml").write_text("[judge]\n" + "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_judge_config(tmp_path / "j.toml")
    assert err.value.key == key and err.value.source == str(tmp_path / "j.toml")


def test_a_judge_file_holds_only_the_judge_table(tmp_path):
    (tmp_path / "j.toml").write_text('[judge]\nrubric = "x"\ncheckpoint = "c"\ncandidates = ["f"]\n[rm]\nmargin = 1\n')
    with pytest.raises(ConfigError, match="rm: unknown section"):
        load_judge_config(tmp_path / "j.toml")
    (tmp_path / "j.toml").write_text('[judge]\nrubric = "x"\ncheckpoint = "c"\ncandidates = ["f"]\n')
    assert load_judge_config(tmp_path / "j.toml", ["judge.tie_margin=0.5"]).tie_margin == 0.5
    with pytest.raises(ConfigError, match="judge.tie_margin: must be >= 0"):
        load_judge_config(tmp_path / "j.toml", ["judge.tie_margin=-0.5"])


def test_missing_judge_checkpoint_names_the_key(tmp_path):
    write_candidates(tmp_path / "c.jsonl", candidates(2))
    cfg = JudgeConfig(
        rubric="x",
        checkpoint=str(tmp_path / "nowhere"),
        candidates=[str(tmp_path / "c.jsonl")],
        out=str(tmp_path / "o.jsonl"),
    )
    with pytest.raises(ConfigError, match="judge.checkpoint: .*no such checkpoint"):
        judge_candidates(cfg)


def test_candidate_reader_counts_bad_lines(tmp_path):
    path = write_candidates(tmp_path / "c.jsonl", candidates(3))
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "p", "completion_a": "same", "completion_b": "same"}) + "\n")
        f.write(json.dumps({"prompt": "p", "completion_a": "only one"}) + "\n")
    items, stats = read_candidates([path], rejected_path=tmp_path / "rej.jsonl")
    assert len(items) == 3 and stats["reasons"] == {"identical_pair": 1, "missing_completion_b": 1}


def test_policy_samples_two_different_completions_per_prompt(tok, model_cfg, tmp_path):
    torch.manual_seed(1)
    policy = randomise(build_model(model_cfg(max_seq_len=128)), std=0.3)
    save_weights(tmp_path / "policy", policy.cfg, policy.state_dict())
    (tmp_path / "policy" / "tokenizer.json").write_bytes(tok.path.read_bytes())
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"sort {k} 3 1"}) + "\n" for k in range(4)))
    cfg = JudgeConfig(
        rubric="x",
        checkpoint="c",
        policy=str(tmp_path / "policy"),
        prompts=[str(tmp_path / "p.jsonl")],
        max_new_tokens=8,
        device="cpu",
    )
    items, stats = sample_candidates(cfg, tmp_path / "rej.jsonl")
    assert len(items) + stats["identical_samples"] == 4 and len(items) >= 3
    assert all(a != b for _, a, b in items)
    assert items[0][0] == [{"role": "user", "content": "sort 0 3 1"}]


# ---- end to end: judged pairs train a reward model -------------------------------------------------


@pytest.mark.slow
def test_judged_pairs_train_a_reward_model_that_ranks_held_out_pairs(tok, model_cfg, judge_model, tmp_path):
    import dataclasses

    from kiln.post.config import RMConfig, StageTrainConfig, TaskConfig
    from kiln.post.driver import run_stage
    from kiln.recipe import Recipe

    records, report = judge_both_orders(KilnJudge(PrefersMarked(judge_model, tok), tok), RUBRIC, candidates(64))
    assert report["kept"] == 64
    (tmp_path / "judged.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    torch.manual_seed(0)
    cfg = model_cfg(max_seq_len=128)
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=10)
    recipe.tasks = TaskConfig(families=["sort"], train_per_family=20, heldout_per_family=8)
    recipe.rm = RMConfig(
        files=[str(tmp_path / "judged.jsonl")],
        heldout_fraction=0.25,
        train=StageTrainConfig(
            lr=1e-3, max_steps=20, warmup_steps=0, seq_len=128, micro_batch_size=8, eval_every=20, ckpt_every=20
        ),
    )
    stats = run_stage("rm", recipe, tmp_path / "rm", tmp_path / "init", tok, resume="none")
    assert stats["data"]["pairs"] == 48 and stats["data"]["heldout_pairs"] == 16
    assert stats["after"]["heldout"]["accuracy"] == 1.0 > stats["before"]["heldout"]["accuracy"]
