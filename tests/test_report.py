"""`kiln report`: the HTML page of a run folder, its plots, its robustness to missing and bad input."""

import argparse
import json
import math
import shutil
import sysconfig
from html.parser import HTMLParser
from pathlib import Path

import pytest
from kiln_testing.train import tiny_train_config

from kiln.data.config import CurateConfig
from kiln.data.curate import curate
from kiln.data.funnel import funnel_text
from kiln.errors import ConfigError, DataError
from kiln.recipe import load_recipe, recipe_to_dict
from kiln.report import ReportOptions, build_report, read_metrics, write_report
from kiln.report import add_parser as add_report_parser
from kiln.report import run as run_report
from kiln.report_plots import Plot, Series, line_plot, log_ticks, nice_ticks, thin
from kiln.train.config import TrainConfig
from kiln.train.schedule import lr_at

HOSTILE = '<script>alert("x")</script> & </pre><b>'
VOID = {"meta", "br", "hr", "img", "input", "link"}


class Page(HTMLParser):
    """Collects what the tests look at, and checks that every element is closed in order."""

    def __init__(self, text: str):
        super().__init__()
        self.stack, self.svgs, self.section, self.sections, self.tags, self.data = [], [], None, [], [], []
        self.feed(text)
        self.close()
        assert self.stack == [], f"unclosed elements: {self.stack}"

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "section":
            self.section = a["id"]
            self.sections.append(a["id"])
        elif tag == "svg":
            self.svgs.append(
                {
                    "plot": a.get("data-plot"),
                    "section": self.section,
                    "lines": [],
                    "rects": 0,
                    "events": 0,
                    "event_types": [],
                    "text": [],
                    "viewbox": [float(v) for v in a.get("viewbox", "0 0 1e9 1e9").split()],
                }
            )
        elif tag == "polyline":
            points = [tuple(map(float, p.split(","))) for p in a["points"].split()]
            self.svgs[-1]["lines"].append((a["data-series"], points))
        elif tag == "rect":
            self.svgs[-1]["rects"] += 1
        elif tag == "line" and a.get("class") == "event":
            self.svgs[-1]["events"] += 1
            self.svgs[-1]["event_types"].append(a.get("data-event"))

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        self.data.append(data)
        if self.stack and "svg" in self.stack and self.svgs:
            self.svgs[-1]["text"].append(data)

    def plot(self, key):
        found = [s for s in self.svgs if s["plot"] == key]
        assert len(found) == 1, f"plot {key}: {len(found)} found"
        return found[0]

    def series(self, key, name):
        return [pts for series, pts in self.plot(key)["lines"] if series == name]


def real_docs(n: int) -> list[str]:
    """Chunks of the Python standard library's own files: real text nobody here wrote."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n]:
        docs.append(path.read_text(encoding="utf-8", errors="replace")[:3000])
    return docs


@pytest.fixture(scope="module")
def curated(tmp_path_factory) -> Path:
    """A data stage folder written by the real curation pipeline on a few real documents."""
    root = tmp_path_factory.mktemp("curate")
    (root / "in").mkdir()
    docs = real_docs(8)
    with open(root / "in" / "docs.jsonl", "w") as f:
        for i, text in enumerate(docs + [docs[0], "too short"]):  # one exact duplicate, one too short
            f.write(json.dumps({"id": str(i), "text": text, "source": "stdlib"}) + "\n")
    cfg = CurateConfig(
        inputs=[str(root / "in")], steps=["normalize", "gopher_quality", "exact_dedup"], tasks=1, workers=1
    )
    cfg.validate()
    curate(cfg, root / "data", log=lambda *a: None)
    return root / "data"


def train_records(n: int = 50, log_every: int = 10) -> list[dict]:
    cfg = TrainConfig(max_steps=n * log_every, warmup_steps=30)
    out = []
    for i in range(1, n + 1):
        step = i * log_every
        out.append(
            {
                "kind": "train",
                "step": step,
                "loss": 9.0 * math.exp(-step / 200) + 3 + 0.1 * (i % 3),
                "lr": lr_at(step - 1, cfg),
                "grad_norm": 2.0 / math.sqrt(i) + 0.05 * (i % 4),
                "tokens_per_s": 3000.0 + 50 * (i % 7),
                "mfu": 0.2 + 0.01 * (i % 5),
                "peak_mem_mb": 800.0 + min(i, 10),
                "tokens_seen": step * 4096,
            }
        )
    return out


def val_records(steps=(100, 200, 300, 400, 500)) -> list[dict]:
    return [
        {
            "kind": "val",
            "step": s,
            "val_loss": 4 + 2 * math.exp(-s / 200),
            "val_bpb": 2 + math.exp(-s / 200),
            "tokens_seen": s * 4096,
        }
        for s in steps
    ]


def write_lines(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make_run(root: Path, curated: Path | None = None, full: bool = True) -> Path:
    """A run folder in the layout `kiln run` writes; `full=False` leaves only recipe and metrics."""
    recipe = recipe_to_dict(load_recipe("recipes/tiny.toml"))
    recipe["run"]["name"] = "fake<run>"
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe.json").write_text(json.dumps(recipe, indent=2))
    write_lines(root / "pretrain" / "metrics.jsonl", train_records() + val_records())
    if not full:
        return root
    (root / "pretrain" / "summary.json").write_text(
        json.dumps(
            {
                "steps": 500,
                "tokens_seen": 2048000,
                "final_val_loss": 4.16,
                "best_val_loss": 4.16,
                "best_step": 500,
                "tokens_per_s": 3100.0,
                "mfu": 0.24,
                "peak_mem_mb": 810.0,
                "device": "cpu",
                "params": 7_000_000,
                "wall_s": 900.0,
                "threads": 2,
            }
        )
    )
    for stage in ("corpus", "tokenizer", "pack", "pretrain", "sample"):
        (root / stage).mkdir(exist_ok=True)
        (root / stage / "DONE").write_text(json.dumps({"fingerprint": "x", "seconds": 1.5, "stats": {}}))
    ckpts = root / "pretrain" / "checkpoints"
    for step, val in ((400, 4.27), (500, 4.16)):
        write_lines(
            ckpts / f"step-{step:08d}" / "manifest.json",
            [
                {
                    "format": 1,
                    "step": step,
                    "tokens_seen": step * 4096,
                    "val_loss": val,
                    "model_config": {},
                    "files": {"model.safetensors": {"bytes": 2**20, "sha256": "0"}},
                }
            ],
        )
    (ckpts / ".tmp-step-00000600").mkdir()  # a save in progress: not a checkpoint yet
    (ckpts / "latest").write_text("step-00000500\n")
    (ckpts / "best").write_text("step-00000500\n")
    (root / "tokenizer" / "stats.json").write_text(
        json.dumps(
            {
                "vocab_size": 8192,
                "bytes_per_token": 3.12,
                "heldout_by_source": {"stdlib": {"documents": 3, "bytes": 900, "tokens": 300, "bytes_per_token": 3.0}},
            }
        )
    )
    (root / "pack" / "stats.json").write_text(
        json.dumps(
            {
                "dtype": "uint16",
                "vocab_size": 8192,
                "train": {"documents": 10, "tokens": 5000, "bytes": 15000},
                "val": {"documents": 2, "tokens": 500, "bytes": 1500},
                "sources": {"<i>src</i>": {"train": {"tokens": 5000}, "val": {"tokens": 500}}},
                "weights": {"<i>src</i>": 1.0},
            }
        )
    )
    (root / "sample" / "samples.txt").write_text(f"--- sample 0 (step 500) ---\ndef {HOSTILE}\n")
    if curated is not None:
        (root / "data").mkdir()
        (root / "data" / "stats.json").write_text((curated / "stats.json").read_text())
    return root


def test_full_run_has_every_plot_with_one_point_per_record(tmp_path, curated):
    run = make_run(tmp_path / "run", curated)
    out, report = write_report(run)
    assert out == run / "report.html" and report.warnings == []
    page = Page(out.read_text())

    lengths = {
        "train loss": 50,
        "val loss": 5,
        "val bpb": 5,
        "lr": 50,
        "grad norm": 50,
        "tokens/s": 50,
        "MFU": 50,
        "peak memory": 50,
    }
    plots = {
        "pretrain-loss": ["train loss", "val loss"],
        "pretrain-loss-tokens": ["train loss", "val loss"],
        "pretrain-val-bpb": ["val bpb"],
        "pretrain-lr": ["lr"],
        "pretrain-grad-norm": ["grad norm"],
        "pretrain-throughput": ["tokens/s"],
        "pretrain-mfu": ["MFU"],
        "pretrain-memory": ["peak memory"],
    }
    for key, names in plots.items():
        svg = page.plot(key)
        assert [name for name, _ in svg["lines"]] == names
        _, _, width, height = svg["viewbox"]
        for name in names:
            [points] = page.series(key, name)
            assert len(points) == lengths[name], (key, name)
            xs = [x for x, _ in points]
            assert xs == sorted(xs) and all(0 <= x <= width for x in xs)
            assert all(0 <= y <= height for _, y in points)
        assert "(log scale)" not in "".join(svg["text"])

    # The drawing follows the data: the highest learning rate is the topmost point, and so on.
    lrs = [r["lr"] for r in train_records()]
    [points] = page.series("pretrain-lr", "lr")
    assert min(range(50), key=lambda i: points[i][1]) == lrs.index(max(lrs))
    assert max(range(50), key=lambda i: points[i][1]) == lrs.index(min(lrs))
    # Loss vs tokens is loss vs step stretched: same heights.
    assert [y for _, y in page.series("pretrain-loss", "train loss")[0]] == [
        y for _, y in page.series("pretrain-loss-tokens", "train loss")[0]
    ]

    # The data funnel comes from kiln.data.funnel: two bars (docs, bytes) per curation step.
    stats = json.loads((run / "data" / "stats.json").read_text())
    [funnel] = [s for s in page.svgs if s["section"] == "data"]
    assert funnel["rects"] == 2 * len(stats["steps"]) == 8
    assert {"read", "normalize", "gopher_quality", "exact_dedup"} <= set(funnel["text"])

    assert page.sections == [
        "overview",
        "pretrain-training",
        "pretrain-checkpoints",
        "pretrain-cost",
        "data",
        "tokenizer",
        "pack",
        "samples",
        "config",
    ]
    text = "".join(page.data)
    assert "step-00000500" in text and "latest, best" in text and ".tmp-step" not in text

    # Hostile text is shown as text, never as markup; the page needs nothing from outside.
    html = out.read_text()
    assert "script" not in page.tags and "i" not in page.tags and "b" not in page.tags
    assert HOSTILE in text and "<i>src</i>" in text and "fake<run>" in text
    assert "src=" not in html and "<link" not in html and "url(" not in html and "@import" not in html
    assert {h for h in html.split('"') if h.startswith("http")} == {"http://www.w3.org/2000/svg"}


def test_missing_parts_are_left_out(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    report = build_report(run)
    assert [spec.key for spec, _ in report.parts] == ["overview", "pretrain-training", "config"]
    assert report.warnings == []
    page = Page(report.html())
    assert len(page.svgs) == 8 and all(s["section"] == "pretrain-training" for s in page.svgs)

    shutil.rmtree(run / "pretrain")  # a run that has not trained yet
    report = build_report(run)
    assert [spec.key for spec, _ in report.parts] == ["overview", "config"]
    assert "<svg" not in report.html()
    assert "pretrain not run" in report.text()


def test_not_a_run_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'}: no such run folder"):
        build_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'}: not a Kiln run folder"):
        build_report(tmp_path / "empty")
    run = make_run(tmp_path / "run", full=False)
    with pytest.raises(DataError, match=f"is a stage folder of the run {run}; pass {run}"):
        build_report(run / "pretrain")
    with pytest.raises(DataError, match="not a folder"):
        build_report(run / "recipe.json")


def test_malformed_metrics_lines_are_skipped_counted_and_shown(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    records = train_records()
    lines = [json.dumps(r) for r in records]
    lines.insert(6, "this is not json")  # line 7
    lines.insert(11, json.dumps({"kind": "train", "loss": 1.0}))  # line 12: no step
    lines.insert(19, json.dumps({**records[0], "loss": "nan?"}))  # line 20: loss not a number
    lines.append('{"kind": "train", "step": 510, "lo')  # line 54: cut short by a crash
    path = write_lines(run / "pretrain" / "metrics.jsonl", lines)

    m = read_metrics(path)
    assert [n for n, _ in m.skipped] == [7, 12, 20, 54] and len(m.train) == 50
    assert "not a number" in dict(m.skipped)[20] and "step" in dict(m.skipped)[12]

    out, report = write_report(run)
    [warning] = report.warnings
    assert warning.startswith(f"{path}: skipped 4 malformed line(s)")
    assert all(f"line {n}:" in warning for n in (7, 12, 20))  # the first few by number, the rest counted
    page = Page(out.read_text())
    assert warning in "".join(page.data)
    assert len(page.series("pretrain-loss", "train loss")[0]) == 50

    with pytest.raises(DataError, match=f"{path}:7: not JSON"):
        build_report(run, ReportOptions(strict=True))


def test_malformed_stats_files_lose_only_their_section(tmp_path, curated):
    run = make_run(tmp_path / "run", curated)
    (run / "tokenizer" / "stats.json").write_text("{not json")
    (run / "data" / "stats.json").write_text(json.dumps({"steps": [{"name": "read"}]}))
    report = build_report(run)
    keys = [spec.key for spec, _ in report.parts]
    assert "tokenizer" not in keys and "data" not in keys and "pretrain-training" in keys
    [bad_shape, bad_json] = report.warnings  # in page order: data curation comes before the tokenizer
    assert bad_json.startswith(f"{run / 'tokenizer' / 'stats.json'}: not valid JSON")
    assert bad_shape.startswith(
        f"section 'Data curation' left out: {run / 'data' / 'stats.json'} has unexpected content (KeyError"
    )
    Page(report.html())
    with pytest.raises(DataError, match="data/stats.json: unexpected content"):
        build_report(run, ReportOptions(strict=True))


def test_events_are_marked_and_non_finite_losses_break_the_line(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    records = train_records()
    records[20]["loss"] = float("nan")  # json.dumps writes NaN, as the trainer's logger would
    events = [
        {"kind": "event", "step": 210, "type": "nan_loss", "action": "skip_batch"},
        {"kind": "event", "step": 350, "type": "spike", "loss": 9.5, "threshold": 6.1},
    ]
    write_lines(run / "pretrain" / "metrics.jsonl", records + val_records() + events)
    report = build_report(run, ReportOptions(loss_scale="log"))
    page = Page(report.html())
    loss = page.plot("pretrain-loss")
    assert loss["events"] == 2 and page.plot("pretrain-grad-norm")["events"] == 2
    assert [len(p) for p in page.series("pretrain-loss", "train loss")] == [20, 29]
    assert "train loss (1 not drawable)" in loss["text"] and "(log scale)" in "".join(loss["text"])
    assert "pretrain-events" in page.sections
    assert "2 events: nan_loss 1, spike 1" in report.text()


def test_eval_results_across_checkpoints(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    for step, acc in ((100, 0.25), (300, 0.4), (200, 0.3)):
        write_lines(run / "eval" / f"step-{step}.json", [{"step": step, "tasks": {"arc": {"acc": acc}}}])
    page = Page(build_report(run).html())
    [points] = page.series("eval-scores", "tasks.arc.acc")
    assert len(points) == 3 and points[0][1] > points[1][1] > points[2][1]  # sorted by step, rising


def test_text_summary_and_command_line(tmp_path, curated, capsys):
    run = make_run(tmp_path / "run", curated)
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="verb"))
    assert run_report(parser.parse_args(["report", str(run), "--text"])) == 0
    printed = capsys.readouterr().out
    assert funnel_text(json.loads((run / "data" / "stats.json").read_text())) in printed
    first = train_records()[0]
    assert f"train loss {first['loss']:.4f} at step 10 -> " in printed
    assert "step-00000500 val 4.16 (latest, best)" in printed
    assert not (run / "report.html").exists()  # --text only prints

    out = tmp_path / "site"
    out.mkdir()
    assert run_report(parser.parse_args(["report", str(run), "--out", str(out)])) == 0
    assert (out / "report.html").is_file() and f"wrote {out / 'report.html'}" in capsys.readouterr().out


def test_a_section_registered_elsewhere_is_shown_in_its_place(tmp_path, monkeypatch):
    import kiln.report as report_module

    monkeypatch.setattr(report_module, "SECTIONS", dict(report_module.SECTIONS))
    monkeypatch.setattr(report_module, "SECTION_MODULES", ["kiln_report_extra"])
    (tmp_path / "kiln_report_extra.py").write_text(
        "from kiln.report import Part, section\n"
        "@section('extra', 'Extra', 15, ('extra.json',))\n"
        "def _extra(run, opts):\n"
        "    data = run.json('extra.json')\n"
        "    return None if data is None else Part('<p>' + str(data['n']) + '</p>', 'n=' + str(data['n']))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = make_run(tmp_path / "run", full=False)
    assert "extra" not in [spec.key for spec, _ in build_report(run).parts]
    (run / "extra.json").write_text('{"n": 7}')
    report = build_report(run)
    assert [spec.key for spec, _ in report.parts] == ["overview", "extra", "pretrain-training", "config"]
    assert "== Extra ==\nn=7" in report.text()


def test_line_plot_scales():
    def heights(ys, log):
        svg = line_plot(Plot("p", "t", "x", "y", [Series("s", [1.0, 2.0, 3.0], ys)], log_y=log))
        page = Page(svg)
        return [y for _, y in page.series("p", "s")[0]]

    a, b, c = heights([0.0, 5.0, 10.0], log=False)
    assert a > b > c and a - b == pytest.approx(b - c, abs=0.11)
    a, b, c = heights([1.0, 10.0, 100.0], log=True)
    assert a > b > c and a - b == pytest.approx(b - c, abs=0.11)
    # Non-positive values cannot sit on a log axis: they are left out and counted.
    svg = line_plot(Plot("p", "t", "x", "y", [Series("s", [1.0, 2.0, 3.0], [0.0, 1.0, 2.0])], log_y=True))
    assert "s (1 not drawable)" in svg
    assert "no finite values" in line_plot(Plot("p", "t", "x", "y", [Series("s", [1.0], [float("inf")])]))


def test_ticks_and_thinning():
    assert nice_ticks(0, 600) == [0, 200, 400, 600]
    assert nice_ticks(3.4, 8.2) == [3, 4, 5, 6, 7, 8, 9]
    assert nice_ticks(3.2, 8.9) == [2, 4, 6, 8, 10]
    assert nice_ticks(0, 0.003) == [0, 0.001, 0.002, 0.003]
    assert nice_ticks(0, 0.0022) == [0, 0.0005, 0.001, 0.0015, 0.002, 0.0025]
    assert log_ticks(0.5, 200) == [1, 10, 100]
    assert log_ticks(3, 9) == [3, 4, 5, 6, 7, 8, 9]

    n = 100_000
    ys = [1.0 + 0.001 * (i % 10) for i in range(n)]
    ys[77_777], ys[5] = 50.0, float("nan")
    xs, kept = thin(list(range(n)), ys, 2000)
    assert len(xs) <= 2002 and xs == sorted(xs)
    assert 77_777 in xs and 50.0 in kept and 5 in xs and min(k for k in kept if k == k) == 1.0


def test_long_runs_are_thinned_in_the_report(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    write_lines(run / "pretrain" / "metrics.jsonl", train_records(3000, log_every=1))
    page = Page(build_report(run, ReportOptions(max_points=500)).html())
    [points] = page.series("pretrain-loss", "train loss")
    assert len(points) <= 500
    assert "train loss (" in "".join(page.plot("pretrain-loss")["text"])
    assert "of 3000 points drawn" in "".join(page.plot("pretrain-loss")["text"])


def test_report_of_a_real_training_run(tmp_path, tiny_pack_factory):
    """Metrics, summary and checkpoints written by the real Trainer, read back by the report."""
    from kiln.model import ModelConfig
    from kiln.train.trainer import Trainer

    run = make_run(tmp_path / "run", full=False)
    shutil.rmtree(run / "pretrain")
    pack = tiny_pack_factory(tmp_path / "pack")
    cfg = tiny_train_config(max_steps=12, ckpt_every=6)
    Trainer(ModelConfig(dim=32, n_layers=1, n_heads=4, max_seq_len=32), cfg, pack, run / "pretrain").fit()

    records = [json.loads(line) for line in (run / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    n_train = sum(r["kind"] == "train" for r in records)
    n_val = sum(r["kind"] == "val" for r in records)
    assert (n_train, n_val) == (12, 3)
    report = build_report(run)
    assert report.warnings == []
    page = Page(report.html())
    for key, name, n in (
        ("pretrain-loss", "train loss", n_train),
        ("pretrain-loss", "val loss", n_val),
        ("pretrain-lr", "lr", n_train),
        ("pretrain-grad-norm", "grad norm", n_train),
        ("pretrain-throughput", "tokens/s", n_train),
        ("pretrain-mfu", "MFU", n_train),
        ("pretrain-memory", "peak memory", n_train),
        ("pretrain-val-bpb", "val bpb", n_val),
    ):
        [points] = page.series(key, name)
        assert len(points) == n, (key, name)
    # Keys of the metrics contract that this Trainer logs each get their plot, one point per record.
    first = next(r for r in records if r["kind"] == "train")
    for key in [k for k in first if k.startswith(("grad_norm/", "sys/"))] + ["hfu"] * ("hfu" in first):
        plot = {"grad_norm": "pretrain-grad-norm-groups", "hfu": "pretrain-mfu"}.get(key.split("/")[0])
        name = key.split("/", 1)[-1] if "/" in key else "HFU"
        found = [
            pts
            for s in page.svgs
            if s["plot"] == plot or (plot is None and s["plot"].startswith("pretrain-sys"))
            for series, pts in s["lines"]
            if series == name
        ]
        numbers = sum(isinstance(r.get(key), (int, float)) for r in records if r["kind"] == "train")
        assert [len(pts) for pts in found] == ([numbers] if numbers else []), key
    summary = json.loads((run / "pretrain" / "summary.json").read_text())
    text = report.text()
    assert f"final_val_loss {summary['final_val_loss']:.4g}, " in text  # a loss: 4 significant digits
    assert "measured: 1 CPU process(es)" in text and f"{summary['wall_s']:,.0f} s wall" in text
    from kiln.checkpoint import complete_checkpoints, read_manifest

    folders = complete_checkpoints(run / "pretrain" / "checkpoints")
    listed = "; ".join(f"{p.name} val {read_manifest(p)['val_loss']:.4g}" for p in folders)
    assert len(folders) == 2 and f"{listed} (latest, best)" in text


def ops_records() -> list[dict]:
    """Training records with every key of the metrics contract, and one event of each type."""
    records = train_records()
    for i, r in enumerate(records):
        r["hfu"] = r["mfu"] * 1.33  # activation recomputation: hardware does more FLOPs than the model needs
        # Logged in an order of its own; the plot lists the groups in the trainer's order.
        for j, group in enumerate(("head", "other", "embed", "norm", "mlp", "attn")):
            r[f"grad_norm/{group}"] = 0.1 * (j + 1) / math.sqrt(i + 1)
        r.update(
            {
                "sys/cpu_percent": 90.0 + i % 5,
                "sys/ram_mb": 4000.0 + i,
                "sys/rss_mb": 900.0 + i,
                "sys/gpu_util": None,
                "batch_tokens": 1024 if r["step"] <= 100 else 4096,
            }
        )
    steps = {
        "batch_ramp": 100,
        "nan": 120,
        "spike": 250,
        "skip": 251,
        "rollback": 300,
        "lr_lowered": 301,
        "watchdog": 400,
    }
    events = [{"kind": "event", "step": step, "type": kind, "detail": f"<{kind}>"} for kind, step in steps.items()]
    return records + val_records() + events


def test_operations_metrics_get_their_plots_and_events_their_marks(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    write_lines(run / "pretrain" / "metrics.jsonl", ops_records())
    report = build_report(run)
    assert report.warnings == []
    page = Page(report.html())

    [mfu], [hfu] = page.series("pretrain-mfu", "MFU"), page.series("pretrain-mfu", "HFU")
    assert len(mfu) == len(hfu) == 50 and all(h[1] < m[1] for m, h in zip(mfu, hfu))  # HFU drawn higher
    groups = page.plot("pretrain-grad-norm-groups")
    assert [name for name, _ in groups["lines"]] == ["embed", "attn", "mlp", "norm", "head", "other"]
    assert all(len(points) == 50 for _, points in groups["lines"]) and "(log scale)" in "".join(groups["text"])
    assert [name for name, _ in page.plot("pretrain-sys-util")["lines"]] == ["cpu_percent"]  # gpu_util: null
    assert [name for name, _ in page.plot("pretrain-sys-memory")["lines"]] == ["ram_mb", "rss_mb"]
    assert "pretrain-sys-other" not in [s["plot"] for s in page.svgs]
    [batch] = page.series("pretrain-batch", "batch tokens")
    assert len(batch) == 50 and batch[9][1] > batch[10][1]  # the ramp: higher value, smaller y

    # Every event is a line on the loss plot with its type, written at the top and in the legend.
    loss = page.plot("pretrain-loss")
    kinds = ["batch_ramp", "nan", "spike", "skip", "rollback", "lr_lowered", "watchdog"]
    assert loss["event_types"] == kinds
    legend = "".join(loss["text"])
    assert all(f"{k} ×1" in legend for k in kinds)
    # Tags sit on two rows: "skip" one step after "spike" goes below it.
    assert sorted(t for t in loss["text"] if t in kinds) == sorted(kinds)
    assert "step 250: spike detail=<spike>" in loss["text"]
    assert page.plot("pretrain-lr")["event_types"] == ["rollback", "lr_lowered"]
    assert page.plot("pretrain-batch")["event_types"] == ["batch_ramp"]
    html = report.html()
    assert 'data-event="nan" x1=' in html and 'stroke="#d62728"' in html.split('data-event="nan"')[1][:200]


def test_older_runs_and_bad_values_of_the_new_keys(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    records = [r for r in ops_records() if r["kind"] != "event"]
    for r in records:
        r["batch_tokens"] = 4096  # no ramp: nothing to plot
    records[3]["sys/ram_mb"] = "a lot"
    records[4]["grad_norm/attn"] = [1.0]
    path = write_lines(run / "pretrain" / "metrics.jsonl", records)
    report = build_report(run)
    [warning] = report.warnings
    assert warning.startswith(f"{path}: skipped 2 malformed line(s) (line 4: 'sys/ram_mb' is not a number")
    page = Page(report.html())
    keys = [s["plot"] for s in page.svgs]
    assert "pretrain-batch" not in keys and "pretrain-grad-norm-groups" in keys
    assert len(page.series("pretrain-loss", "train loss")[0]) == 48

    write_lines(run / "pretrain" / "metrics.jsonl", train_records() + val_records())  # before these keys
    keys = [s["plot"] for s in Page(build_report(run).html()).svgs]
    assert keys == [
        "pretrain-loss",
        "pretrain-loss-tokens",
        "pretrain-val-bpb",
        "pretrain-lr",
        "pretrain-grad-norm",
        "pretrain-throughput",
        "pretrain-mfu",
        "pretrain-memory",
    ]


def test_cost_section_per_training_stage(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    report = build_report(run)
    text = report.text()
    # make_run's summary: 900 s on one process of 2 threads, 3100 tokens/s, 7M parameters.
    # 900 s x 2 cores = 0.5 core-hours; 0.25 h x 2 x 5 W x PUE 1.2 = 3 Wh; 0.5 x $0.09 = $0.045.
    assert "measured: 1 CPU process(es) x 2 cores, 900 s wall, 0.5 CPU core-hours, 0.003 kWh at PUE 1.2, $0.045" in text
    assert "note: world size not in the summary: 1 device assumed" in text
    # 20 tokens/parameter = 1.4e8 tokens at 3100 tokens/s: 45,161 s = 0.523 days, 25.09 core-hours, $2.26.
    assert "projection 20 tokens per parameter: 1.4e+08 tokens, 0.523 days, 25.09 CPU core-hours" in text
    assert "$2.26" in text
    # The recipe's schedule (600 x 4096 tokens) differs from what was trained (2,048,000): priced too.
    assert "projection recipe: 600 steps x 4,096 tokens: 2.46e+06 tokens" in text
    page = Page(report.html())
    assert "pretrain-cost" in page.sections and "$0.045" in "".join(page.data)

    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="verb"))
    assert (
        run_report(
            parser.parse_args(
                ["report", str(run), "--text", "--price", "0.05", "--tokens", "1e9", "--pue", "1.5", "--cores", "4"]
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    # 900 s x 4 cores = 1 core-hour: $0.05, and 0.25 h x 20 W x 1.5 = 7.5 Wh.
    assert "x 4 cores, 900 s wall, 1 CPU core-hours, 0.0075 kWh at PUE 1.5, $0.05" in printed
    assert "projection requested (--tokens): 1e+09 tokens" in printed

    # One --hardware for a run whose stage trained elsewhere: a warning, and the stage keeps its own.
    report = build_report(run, ReportOptions(hardware="h100"))
    assert report.warnings == [
        "pretrain cost: --hardware h100 ignored (the stage trained on cpu: H100 SXM 80GB "
        "figures would price time it did not spend on a GPU; leave the hardware out or "
        "pass cpu)"
    ]
    with pytest.raises(ConfigError, match="hardware: unknown accelerator"):
        build_report(run, ReportOptions(hardware="h1000"))
    for bad, key in (
        (dict(pue=0.5), "pue"),
        (dict(cores=0), "cores"),
        (dict(token_budget=-1.0), "tokens"),
        (dict(price_per_hour=-2.0), "price_per_hour"),
        (dict(power_w=0.0), "power_w"),
    ):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            build_report(run, ReportOptions(**bad))

    summary = json.loads((run / "pretrain" / "summary.json").read_text())
    summary.update(device="cuda:0", world_size=8, wall_s=3600.0)
    (run / "pretrain" / "summary.json").write_text(json.dumps(summary))
    text = build_report(run, ReportOptions(hardware="h100")).text()
    assert "measured: 8 x H100 SXM 80GB, 3,600 s wall, 8 GPU-hours, 6.72 kWh at PUE 1.2, $20.00" in text
    del summary["wall_s"]  # summaries from before the wall time was written: no section
    (run / "pretrain" / "summary.json").write_text(json.dumps(summary))
    assert "pretrain-cost" not in [spec.key for spec, _ in build_report(run).parts]


def test_crowded_event_tags_keep_their_lines():
    """Ten spikes on ten consecutive steps: ten lines with hover text, but tags only where they fit."""
    events = [(float(x), f"step {x}: spike", "spike") for x in range(250, 260)] + [(480.0, "step 480: nan", "nan")]
    plot = Plot("p", "t", "step", "loss", [Series("loss", [10.0, 500.0], [4.0, 3.0])], vlines=events)
    page = Page(line_plot(plot))
    svg = page.plot("p")
    assert svg["event_types"] == ["spike"] * 10 + ["nan"]
    assert [t for t in svg["text"] if t in ("spike", "nan")] == ["spike", "spike", "nan"]  # one per row, and nan
    assert "spike ×10" in svg["text"] and "nan ×1" in svg["text"]
    assert sum(t.startswith("step 25") for t in svg["text"]) == 10


def test_post_training_stages_get_plots_and_cost_without_token_projections(tmp_path):
    run = make_run(tmp_path / "run", full=False)
    recipe = json.loads((run / "recipe.json").read_text())
    recipe["train"]["grad_clip"] = 0.5
    recipe["sft"] = {"train": {"max_steps": 500, "lr": 1e-4}}
    (run / "recipe.json").write_text(json.dumps(recipe))
    write_lines(run / "sft" / "metrics.jsonl", train_records() + val_records())
    (run / "sft" / "summary.json").write_text(
        json.dumps(
            {
                "steps": 500,
                "tokens_seen": 500 * 1024,
                "tokens_per_s": 2000.0,
                "wall_s": 1800.0,
                "device": "cpu",
                "world_size": 2,
                "threads": 3,
                "params": 7_000_000,
            }
        )
    )
    report = build_report(run)
    keys = [spec.key for spec, _ in report.parts]
    assert keys == ["overview", "pretrain-training", "sft-training", "sft-cost", "config"]
    page = Page(report.html())
    assert "grad_clip" in page.plot("sft-grad-norm")["text"]  # [train].grad_clip, which SFT inherits
    text = report.text()
    # 1800 s x 2 processes x 3 threads = 3 core-hours = $0.27; a DPO "token" may be a pair: no projection.
    assert "== SFT: cost ==\nmeasured: 2 CPU process(es) x 3 cores, 1,800 s wall, 3 CPU core-hours" in text
    assert "$0.27" in text and "projection" not in text.split("== SFT: cost ==")[1]


def test_replay_split_is_drawn_beside_the_new_one(tmp_path):
    """train.replay logs the earlier pack's split as val_loss/replay: its own dashed curve, and the
    text says where it started and ended, so forgetting is visible."""
    run = make_run(tmp_path / "run", full=False)
    vals = val_records()
    for i, r in enumerate(vals):
        r["val_loss/replay"], r["val_bpb/replay"] = 3.0 + 0.1 * i, 1.5 + 0.05 * i
    vals[2]["val_loss/replay"] = "high"  # malformed: the line is skipped, not drawn as text
    write_lines(run / "pretrain" / "metrics.jsonl", train_records() + vals)
    report = build_report(run)
    page = Page(report.html())
    replay = page.series("pretrain-loss", "val loss, replay pack")
    assert [len(p) for p in replay] == [4]
    assert [y for _, y in replay[0]] != [y for _, y in page.series("pretrain-loss", "val loss")[0]]
    assert len(page.series("pretrain-loss-tokens", "val loss, replay pack")[0]) == 4
    assert len(page.series("pretrain-val-bpb", "val bpb, replay pack")[0]) == 4
    assert "replay pack's split: 3.0000 at the first evaluation -> 3.4000" in report.text()
    assert "'val_loss/replay' is not a number" in " ".join(report.warnings)
