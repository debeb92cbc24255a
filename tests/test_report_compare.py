"""`kiln report` over several runs (one page, every run on the same axes), the summary tiles'
formats, markers on every point of a short run, and the configuration limited to what ran."""

import json
import re

from test_report import Page, make_run, write_lines

from kiln.cli import main
from kiln.report import build_report
from kiln.report_plots import fmt_value


def _short_run(root, name: str, losses: list[float], val: float):
    """A 30-step run logged every 10 steps (3 training records) with one validation."""
    run = make_run(root, full=False)
    recipe = json.loads((run / "recipe.json").read_text())
    recipe["run"]["name"] = name
    (run / "recipe.json").write_text(json.dumps(recipe))
    records = [
        {"kind": "train", "step": 10 * (i + 1), "loss": loss, "tokens_seen": 40960 * (i + 1)}
        for i, loss in enumerate(losses)
    ]
    write_lines(run / "pretrain" / "metrics.jsonl", records + [{"kind": "val", "step": 30, "val_loss": val}])
    (run / "pretrain" / "summary.json").write_text(json.dumps({"steps": 30, "final_val_loss": val, "mfu": 0.0059}))
    return run


def test_several_runs_overlay_on_one_page(tmp_path, capsys):
    runs = [
        _short_run(tmp_path / "sweep" / f"trial-{i}", f"trial-{i}", [5.0 - i, 4.5 - i, 4.0 - i], 4.1 - i)
        for i in range(3)
    ]
    assert main(["report", *map(str, runs)]) == 0
    assert "3 runs overlaid" in capsys.readouterr().out
    page = Page((tmp_path / "sweep" / "compare.html").read_text())
    train = page.plot("compare-pretrain-train-loss")
    assert [name for name, _ in train["lines"]] == ["trial-0", "trial-1", "trial-2"]
    assert all(len(points) == 3 for _, points in train["lines"])  # every logged point of every run
    assert {"trial-0", "trial-1", "trial-2"} <= set(train["text"])  # the legend names each run
    assert [name for name, _ in page.plot("compare-pretrain-val-loss")["lines"]] == ["trial-0", "trial-1", "trial-2"]
    text = "".join(page.data)
    assert "trial-2" in text and "2.1" in text  # the last trial's final val loss in the table

    assert main(["report", "--text", *map(str, runs)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1:4] == ["trial-0 | 30 | 4.1 | 0.59%", "trial-1 | 30 | 3.1 | 0.59%", "trial-2 | 30 | 2.1 | 0.59%"]


def test_every_point_of_a_short_run_is_drawn_and_marked(tmp_path):
    run = _short_run(tmp_path / "run", "short", [5.0, 4.5, 4.0], 4.1)
    html = build_report(run).html()
    page = Page(html)
    [points] = page.series("pretrain-loss", "train loss")
    assert len(points) == 3
    svg = html[html.index('data-plot="pretrain-loss"') :]
    svg = svg[: svg.index("</svg>")]
    assert len(re.findall(r"<circle ", svg)) == 3 + 1  # a marker on each train point and on the eval


def test_tiles_format_each_kind_of_number_one_way():
    assert fmt_value(0.0059477, "mfu") == "0.59%"
    assert fmt_value(3.961234, "final_val_loss") == "3.961"
    assert fmt_value(1.83456, "final_val_bpb") == "1.835"
    assert fmt_value(1.33831e12, "flops_per_token") == "1.338T"
    assert fmt_value(2048000, "tokens_seen") == "2,048,000"
    assert fmt_value(3100.0, "tokens_per_s") == "3,100"
    assert fmt_value(42.25, "sys/cpu_percent") == "42.2%"


def test_configuration_lists_only_the_tables_the_run_used(tmp_path):
    run = _short_run(tmp_path / "run", "short", [5.0], 4.1)
    for stage in ("tokenizer", "pack", "pretrain"):  # curated its own inputs: no corpus stage
        (run / stage).mkdir(exist_ok=True)
        (run / stage / "DONE").write_text(json.dumps({"seconds": 1.0}))
    recipe = json.loads((run / "recipe.json").read_text())
    recipe["run"]["stages"] = ["tokenizer", "pack", "pretrain"]
    (run / "recipe.json").write_text(json.dumps(recipe))
    report = build_report(run)
    config = next(part.html for spec, part in report.parts if spec.key == "config")
    shown = re.findall(r"<h3>\[(\w+)\]</h3>", config)
    assert {"run", "tokenizer", "pack", "model", "train"} <= set(shown)
    assert "corpus" not in shown and "sample" not in shown and "sft" not in shown
    assert "not used by this run: " in config and "corpus" in config.split("not used by this run: ")[1]
