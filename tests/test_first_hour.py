"""A newcomer's first hour (issue 18): packaged recipes by name, kiln recipes / init, --version,
defaults and examples in every --help, "did you mean", derived warmup, train.device."""

from pathlib import Path

import pytest
import torch
from kiln_testing.train import make_tiny_pack, tiny_train_config

from kiln.cli import EXAMPLES, VERBS, build_parser, main
from kiln.config import read_toml
from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.recipe import load_recipe
from kiln.recipe_files import PACKAGED, packaged_recipes, resolve_recipe, summary
from kiln.train.config import TrainConfig
from kiln.train.schedule import lr_at
from kiln.train.trainer import Trainer
from kiln.train.trainer_setup import training_device

ROOT = Path(__file__).resolve().parents[1]


def test_recipes_folder_is_the_packaged_one_and_ships_in_the_wheel():
    # One copy: recipes/ in the repository is a link to the package's folder.
    assert (ROOT / "recipes").resolve() == PACKAGED.resolve() == (ROOT / "kiln" / "recipes").resolve()
    assert {"tiny", "data-demo", "post-demo"} <= set(packaged_recipes())
    pyproject = read_toml(ROOT / "pyproject.toml")
    assert pyproject["tool"]["setuptools"]["package-data"]["kiln"] == ["recipes/*.toml"]


def test_a_bare_name_resolves_to_the_packaged_recipe_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = PACKAGED / "tiny.toml"
    assert resolve_recipe("tiny") == resolve_recipe("tiny.toml") == resolve_recipe("recipes/tiny.toml") == tiny
    assert load_recipe("tiny", ["train.max_steps=30"]) == load_recipe(tiny, ["train.max_steps=30"])
    # A file of that name wins over the packaged recipe.
    (tmp_path / "tiny.toml").write_text('[run]\nname = "mine"\n')
    assert load_recipe("tiny.toml").run.name == "mine"
    assert resolve_recipe("tiny") == tiny  # "tiny" itself is no file here


def test_an_unknown_recipe_name_suggests_the_closest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "tinny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "kiln: error: tinny: recipe: no such file, and no packaged recipe 'tinny' (did you mean 'tiny'?) "
        "(kiln recipes lists them)"
    )


def test_kiln_recipes_lists_every_name_with_its_first_comment_line(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(packaged_recipes())
    tiny = next(line for line in lines if line.startswith("tiny "))
    assert tiny.split(None, 1)[1] == summary(PACKAGED / "tiny.toml")
    assert summary(PACKAGED / "tiny.toml").startswith("The CPU demo: real text")


def test_kiln_init_copies_a_recipe_out_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "tiny"]) == 0
    assert (tmp_path / "tiny.toml").read_bytes() == (PACKAGED / "tiny.toml").read_bytes()
    assert capsys.readouterr().out.strip() == "wrote tiny.toml; run it with: kiln run tiny.toml"
    (tmp_path / "edited.toml").write_text("# mine\n")
    assert main(["init", "data-demo", "edited.toml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kiln: error: edited.toml: DEST: already exists; kiln init never overwrites a file (name another DEST)"
    )
    assert (tmp_path / "edited.toml").read_text() == "# mine\n"
    (tmp_path / "sub").mkdir()
    assert main(["init", "data-demo", "sub"]) == 0
    assert (tmp_path / "sub" / "data-demo.toml").read_bytes() == (PACKAGED / "data-demo.toml").read_bytes()
    capsys.readouterr()
    assert main(["init", "tiy"]) == 2
    assert "no packaged recipe 'tiy' (did you mean 'tiny'?)" in capsys.readouterr().err


def test_version_and_unknown_verb(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == "kiln 0.1.0"
    assert main(["pretrian", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kiln: error: unknown verb 'pretrian' (did you mean 'pretrain'?) (kiln --help lists them)"
    )


def _help(*words: str) -> str:
    parser = build_parser([words[0]])
    for word in words:
        parser = parser._subparsers._group_actions[0].choices[word]
    return parser.format_help()


def test_every_verb_help_has_examples_and_shows_defaults():
    assert set(EXAMPLES) == set(VERBS)
    for verb in VERBS:
        text = _help(verb)
        assert "examples:\n  kiln " + verb in text.replace("kiln  ", "kiln "), verb
    assert "(default: 8000)" in _help("serve")  # --port
    assert "(default: tiny)" in _help("run")
    assert "(default: h100)" in _help("plan")
    # A default its help already explains is not repeated; a plain flag shows none.
    plan = " ".join(_help("plan").split())
    assert "else max_seq_len (default: 0)" not in plan and "to the tokenizer (default: 0)" in plan
    assert "(default: False)" not in _help("run")
    assert "reward model" in _help("rm") and "reward model" in VERBS["rm"].help


def test_export_and_import_positionals_have_help():
    export = _help("export", "hf")
    assert "Kiln checkpoint" in export and "folder to write the Hugging Face model" in export
    imported = _help("import", "hf")
    assert "local Hugging Face model folder" in imported and "folder to write the Kiln checkpoint" in imported


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.max_stesp=3", "tiny: train.max_stesp: unknown key (did you mean 'max_steps'?); known: seq_len,"),
        ('run.stages=["pretrian"]', "tiny: run.stages: unknown stage 'pretrian' (did you mean 'pretrain'?); known:"),
        ("trian.lr=1", "tiny: trian: unknown section (did you mean 'train'?); known:"),
        # the bad value is in data.steps: the error names that key, not data.params.normalise
        ('data.steps=["normalise"]', "tiny: data.steps: unknown step 'normalise' (did you mean 'normalize'?); known:"),
    ],
)
def test_did_you_mean_names_the_key_that_holds_the_bad_value(override, line):
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny", [override])
    assert str(err.value).startswith(line)


def test_stages_flag_suggests(capsys):
    assert main(["run", "tiny", "--stages", "corpus,tokeniser"]) == 2
    assert "unknown stage 'tokeniser' (did you mean 'tokenizer'?)" in capsys.readouterr().err


def test_warmup_unset_is_five_percent_of_max_steps():
    short = TrainConfig(max_steps=30)
    short.validate()  # the default warmup no longer exceeds a short run
    assert short.warmup() == 1 and lr_at(0, short) == short.lr
    demo = TrainConfig(max_steps=600, lr=3e-3, min_lr_ratio=0.1)
    assert demo.warmup() == 30
    assert lr_at(0, demo) == pytest.approx(3e-3 / 30) and lr_at(29, demo) == pytest.approx(3e-3)
    assert lr_at(30, demo) < 3e-3  # decay starts after the derived warmup
    assert "warming up for 30 steps (5% of max_steps=600, at most 2000)" in demo.warmup_note()
    assert TrainConfig(max_steps=10**6).warmup() == 2000
    explicit = TrainConfig(max_steps=600, warmup_steps=100)
    assert explicit.warmup() == 100 and explicit.warmup_note() is None
    assert lr_at(0, explicit) == pytest.approx(3e-5)
    with pytest.raises(ConfigError, match=r"warmup_steps: must be -1 \(derived\) or in \[0, max_steps=30\), got 30"):
        TrainConfig(max_steps=30, warmup_steps=30).validate()
    # The packaged demo keeps its 30-step warmup through the derived default.
    assert load_recipe("tiny").train.warmup() == 30


def test_train_device():
    assert training_device("cpu") == torch.device("cpu")
    assert training_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match=r'train.device: must be "auto", "cpu", "cuda" or "cuda:N", got \'gpu\''):
        load_recipe("tiny", ['train.device="gpu"'])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train.device: 'cuda:1' but torch sees no CUDA device"):
            training_device("cuda:1")


def test_the_trainer_takes_train_device_and_notes_a_derived_warmup(tmp_path, capsys):
    model = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=16)
    pack = make_tiny_pack(tmp_path / "pack")
    cfg = tiny_train_config(device="cpu", warmup_steps=-1, max_steps=40)
    trainer = Trainer(model, cfg, pack, tmp_path / "out")
    assert trainer.device == torch.device("cpu")
    assert "note: train.warmup_steps not set: warming up for 2 steps (5% of max_steps=40" in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.device: 'cuda' but torch sees no CUDA device"):
            Trainer(model, tiny_train_config(device="cuda"), pack, tmp_path / "out2")
