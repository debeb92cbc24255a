"""`kiln sweep`: Optuna hyperparameter search over a recipe's keys, each trial a real training run.

The sweep folder holds everything: ``study.db`` (Optuna's SQLite storage, so a killed sweep picks up
where it stopped), ``base/`` (the data stages, built once), one ``trial-NNNN/`` run folder per trial
whose data stages are links into ``base/``, ``results.csv``/``results.json`` and ``best.toml``.
Trial 0 is always the recipe's own values, so "beats the default" is measured in the same sweep,
on the same data, with the same training seed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import sys
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.config import RECIPE_HELP, parse_value
from kiln.errors import ConfigError
from kiln.model.config import PRESETS
from kiln.pipeline import fingerprint, run_recipe, stage_dir
from kiln.recipe import STAGES, Recipe, load_recipe

STUDY_NAME = "kiln-sweep"
# Sections a pretraining run depends on; sweeping anything else could not change the objective.
SWEEPABLE = ("corpus", "data", "tokenizer", "pack", "model", "train", "parallel")
METRIC_ALIASES = {"val_loss": "best_val_loss", "val_bpb": "best_val_bpb"}
KINDS = {
    "float": ("float", False),
    "uniform": ("float", False),
    "logfloat": ("float", True),
    "loguniform": ("float", True),
    "int": ("int", False),
    "logint": ("int", True),
    "choice": ("categorical", False),
    "categorical": ("categorical", False),
}


@dataclass(frozen=True)
class Param:
    """One searched key: ``float``/``int`` between ``low`` and ``high`` (optionally log or stepped),
    or ``categorical`` over ``choices``."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.key, list(self.choices))

    def samples(self) -> list:
        """Values checked against the recipe before any trial runs."""
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]

    def describe(self) -> dict:
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()
            if v is not None and v != ()
        }


def parse_param(key: str, spec: Any, source: str = "<command line>") -> Param:
    """``train.lr`` + ``"loguniform:1e-4:1e-2"`` (or a table ``{type, low, high, log, step, choices}``,
    or a list of choices) -> Param. Errors name the key and where it came from."""
    key = key.strip()
    if key.count(".") < 1 or not all(key.split(".")):
        raise ConfigError(key or "<param>", "a searched key must look like section.key", source)
    if key.split(".")[0] not in SWEEPABLE:
        raise ConfigError(
            key,
            f"cannot be swept: a trial runs the stages up to pretrain, which depend only on [{'], ['.join(SWEEPABLE)}]",
            source,
        )
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    if isinstance(spec, str):
        spec = _spec_from_text(key, spec, source)
    if not isinstance(spec, dict):
        raise ConfigError(key, f"expected a spec string, a table or a list of choices, got {spec!r}", source)
    table = dict(spec)
    type_name = table.pop("type", None)
    if type_name not in KINDS:
        raise ConfigError(key, f"unknown distribution {type_name!r}; known: {', '.join(KINDS)}", source)
    kind, log = KINDS[type_name]
    log = table.pop("log", log)
    allowed = {"choices"} if kind == "categorical" else {"low", "high", "step"}
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(
            key,
            f"unknown spec field(s) {', '.join(sorted(unknown))} for {type_name}; "
            f"known: {', '.join(sorted(allowed | {'type', 'log'}))}",
            source,
        )
    if not isinstance(log, bool):
        raise ConfigError(key, f"log must be true or false, got {log!r}", source)
    if kind == "categorical":
        choices = table.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(key, "a categorical needs a non-empty list of choices", source)
        if any(not isinstance(c, (str, int, float, bool)) for c in choices):
            raise ConfigError(key, f"choices must be strings, numbers or booleans, got {choices!r}", source)
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise ConfigError(key, f"choices repeat a value: {choices!r}", source)
        return Param(key, kind, choices=tuple(choices))
    if "low" not in table or "high" not in table:
        raise ConfigError(key, f"{type_name} needs low and high", source)
    low, high, step = table["low"], table["high"], table.get("step")
    number = int if kind == "int" else (int, float)
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is None and name == "step":
            continue
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            what = "an integer" if kind == "int" else "a finite number"
            raise ConfigError(key, f"{name} must be {what}, got {value!r}", source)
    if not low < high:
        raise ConfigError(key, f"low must be below high, got low={low} high={high}", source)
    if log and low <= 0:
        raise ConfigError(key, f"a log scale needs low > 0, got {low}", source)
    if step is not None and (log or step <= 0 or step > high - low):
        raise ConfigError(
            key, f"step must be positive, at most high-low, and not combined with log; got {step}", source
        )
    if kind == "float":
        low, high = float(low), float(high)
        step = float(step) if step is not None else None
    return Param(key, kind, low=low, high=high, log=log, step=step)


def _spec_from_text(key: str, text: str, source: str) -> dict:
    name, _, rest = text.strip().partition(":")
    if name not in KINDS:
        raise ConfigError(key, f"unknown distribution {name!r} in {text!r}; known: {', '.join(KINDS)}", source)
    if KINDS[name][0] == "categorical":
        if not rest:
            raise ConfigError(key, f"{name} needs comma-separated choices, e.g. {name}:a,b", source)
        return {"type": name, "choices": [parse_value(part.strip()) for part in rest.split(",")]}
    parts = rest.split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(key, f"expected {name}:LOW:HIGH[:STEP], got {text!r}", source)
    values = [parse_value(p.strip()) for p in parts]
    return {"type": name, **dict(zip(("low", "high", "step"), values))}


def parse_space(params: list[str] = (), space_file: str | Path | None = None) -> list[Param]:
    """The search space from ``--space FILE`` (TOML: recipe-shaped tables whose leaves are specs) and
    ``--param key=spec`` arguments; a key may appear only once."""
    found: dict[str, Param] = {}

    def add(param: Param, source: str) -> None:
        if param.key in found:
            raise ConfigError(param.key, "searched twice; give each key one spec", source)
        found[param.key] = param

    if space_file is not None:
        source = str(space_file)
        try:
            raw = tomllib.loads(Path(space_file).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("--space", "file not found", source) from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError("--space", f"invalid TOML: {err}", source) from None
        for key, spec in _leaves(raw, ""):
            add(parse_param(key, spec, source), source)
    for item in params:
        key, sep, spec = item.partition("=")
        if not sep:
            raise ConfigError(
                key or item,
                "a --param must look like section.key=SPEC, e.g. train.lr=loguniform:1e-4:1e-2",
                "<command line>",
            )
        add(parse_param(key, spec, "<command line>"), "<command line>")
    if not found:
        raise ConfigError("--param", "the search space is empty; give --space FILE or --param key=SPEC")
    return list(found.values())


def _leaves(table: dict, prefix: str):
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and "type" not in value:
            yield from _leaves(value, key + ".")
        else:
            yield key, value


def toml_value(value: Any) -> str:
    """A Python value as a TOML literal (used for overrides and for best.toml)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def recipe_to_toml(recipe: Recipe, header: str = "", keep: tuple[str, ...] = ()) -> str:
    """A recipe file that loads back to ``recipe`` on its own. It holds the values that differ from what
    the loader would start from (Kiln's defaults, or the model preset's), plus the dotted keys in
    ``keep``, so it stays valid when keys it does not set are added or renamed."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        base = getattr(Recipe(), f.name)
        if f.name == "model" and value.preset in PRESETS:
            base = dataclasses.replace(PRESETS[value.preset], preset=value.preset)
        items = list(_changed(value, base, "", tuple(k[len(f.name) + 1 :] for k in keep if k.startswith(f.name + "."))))
        if items or f.name == "run":
            lines += ["", f"[{f.name}]", *(f"{key} = {toml_value(v)}" for key, v in items)]
    return "\n".join(lines).lstrip("\n") + "\n"


def _changed(value, base, prefix: str, keep: tuple[str, ...]):
    # Nested config tables are written as dotted keys (guard.action = ...) and, like the loader,
    # compared against the enclosing default's values.
    for f in dataclasses.fields(value):
        mine, theirs, key = getattr(value, f.name), getattr(base, f.name), prefix + _toml_key(f.name)
        if dataclasses.is_dataclass(mine):
            yield from _changed(mine, theirs, key + ".", keep)
        elif mine is not None and (
            mine != theirs or prefix + f.name in keep or (prefix == "" and f.name == "preset" and mine)
        ):
            yield key, mine


def _get_dotted(recipe: Recipe, key: str) -> Any:
    node: Any = recipe
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _overrides(params: dict[str, Any]) -> list[str]:
    return [f"{k}={toml_value(v)}" for k, v in params.items()]


def check_space(recipe_path: str | Path | None, overrides: list[str], space: list[Param]) -> Recipe:
    """Load the recipe once per end of every range (and every choice) so an unknown key or a value the
    component refuses is reported before any training; returns the recipe with the base overrides."""
    recipe = load_recipe(recipe_path, overrides)
    for param in space:
        for value in param.samples():
            try:
                load_recipe(recipe_path, [*overrides, *_overrides({param.key: value})])
            except ConfigError as err:
                where = (
                    f"the searched value {value!r} is refused: {err.message}"
                    if err.key == param.key
                    else f"the searched value {value!r} breaks {err.key}: {err.message}"
                )
                raise ConfigError(param.key, where, "search space") from None
        default = _get_dotted(recipe, param.key)
        if param.kind == "categorical" and default not in param.choices:
            raise ConfigError(
                param.key,
                f"the recipe's value {default!r} is not among the choices "
                f"{list(param.choices)!r}; add it so trial 0 can measure the default",
                "search space",
            )
    return recipe


@dataclass
class SweepResult:
    out_dir: Path
    metric: str
    direction: str
    rows: list[dict]  # one per trial: trial, state, value, duration_s, default, params, ...
    best: dict | None  # the best complete trial's row
    default: dict | None  # trial 0's row (the recipe's own values)
    best_recipe: Path | None  # best.toml
    settings: dict = field(default_factory=dict)

    @property
    def improvement(self) -> float | None:
        """How much the best trial beats the default by, in the metric's better direction."""
        if not self.best or not self.default or self.default["value"] is None:
            return None
        diff = self.default["value"] - self.best["value"]
        return diff if self.direction == "minimize" else -diff


def run_sweep(
    recipe_path: str | Path | None,
    space: list[Param] | dict[str, Any],
    trials: int,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    sampler: str = "tpe",
    seed: int = 0,
    metric: str = "best_val_loss",
    direction: str = "minimize",
    out_dir: str | Path | None = None,
    log=print,
) -> SweepResult:
    """Run (or resume) a sweep of ``trials`` trials in total, trial 0 being the recipe's own values."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("sweep", "needs the optuna package: pip install 'kiln[sweep]'") from None
    overrides = list(overrides)
    if isinstance(space, dict):
        space = [parse_param(k, v, "search space") for k, v in space.items()]
    if trials < 1:
        raise ConfigError("--trials", f"must be at least 1, got {trials}")
    if sampler not in ("tpe", "random"):
        raise ConfigError("--sampler", f"must be tpe or random, got {sampler!r}")
    if direction not in ("minimize", "maximize"):
        raise ConfigError("--direction", f"must be minimize or maximize, got {direction!r}")
    metric = METRIC_ALIASES.get(metric, metric)
    recipe = check_space(recipe_path, overrides, space)
    out = Path(out_dir) if out_dir is not None else recipe.run_dir.with_name(recipe.run.name + "-sweep")
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "recipe": str(Path(recipe_path).resolve()) if recipe_path is not None else None,
        "overrides": overrides,
        "space": [p.describe() for p in space],
        "metric": metric,
        "direction": direction,
    }
    settings = json.loads(json.dumps(settings))  # compared with the saved copy when resuming
    _check_same_sweep(out, settings)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{(out / 'study.db').resolve()}")
    study = optuna.create_study(study_name=STUDY_NAME, storage=storage, direction=direction, load_if_exists=True)
    # A resumed sweep must not replay the draws it already made: offset the seed by the trials so far.
    seed_now = seed + len(study.trials)
    if sampler == "tpe":
        # TPE samples at random until it has this many trials; the default of 10 would make a short
        # sweep pure random search.
        study.sampler = optuna.samplers.TPESampler(seed=seed_now, n_startup_trials=max(2, min(10, trials // 3)))
    else:
        study.sampler = optuna.samplers.RandomSampler(seed=seed_now)
    _requeue_interrupted(study, storage, log)
    if not any(t.user_attrs.get("default") for t in study.trials):
        default = {p.key: _get_dotted(recipe, p.key) for p in space}
        for p in space:
            if p.kind != "categorical" and not p.low <= default[p.key] <= p.high:
                log(f"[sweep] trial 0 keeps the recipe's {p.key}={default[p.key]}, outside the searched range")
        study.enqueue_trial(default, user_attrs={"default": True})

    base = _build_base(recipe_path, overrides, out)
    while (done := _finished(study)) < trials:
        trial = study.ask()
        run_name = trial.user_attrs.get("run_name", f"trial-{trial.number:04d}")
        trial.set_user_attr("run_name", run_name)
        started = time.time()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Fixed parameter")  # said above, once
                params = {p.key: p.suggest(trial) for p in space}
            log(
                f"[sweep] trial {trial.number} ({done + 1}/{trials})"
                f"{' default' if trial.user_attrs.get('default') else ''}: "
                + " ".join(f"{k}={_fmt(v)}" for k, v in params.items())
            )
            value = _run_trial(recipe_path, overrides, params, out, run_name, base, metric, trial)
        except KeyboardInterrupt:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log(f"[sweep] interrupted in trial {trial.number}; rerun the same command to resume")
            raise
        except Exception as err:  # noqa: BLE001 - a failed trial (diverged, refused combination) is a result
            if trial.user_attrs.get("default"):
                # The recipe's own values do not train: every other trial would only repeat the failure,
                # and without it there is no default to compare against. Left unmarked, a rerun retries it.
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            trial.set_user_attr("error", f"{type(err).__name__}: {err}")
            trial.set_user_attr("duration_s", round(time.time() - started, 1))
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log(f"[sweep] trial {trial.number} failed: {type(err).__name__}: {err}")
        else:
            trial.set_user_attr("duration_s", round(time.time() - started, 1))
            study.tell(trial, value)
            log(f"[sweep] trial {trial.number}: {metric}={value:.4f} in {time.time() - started:.0f} s")
        _write_results(study, out, metric, direction, settings, recipe_path, overrides)
    result = _write_results(study, out, metric, direction, settings, recipe_path, overrides)
    log(format_table(result))
    return result


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _check_same_sweep(out: Path, settings: dict) -> None:
    path = out / "sweep.json"
    if path.exists():
        before = json.loads(path.read_text())
        changed = [k for k in settings if before.get(k) != settings[k]]
        if changed:
            raise ConfigError(
                "--out",
                f"{out} holds a sweep with a different {', '.join(changed)}; "
                "resume it with the same arguments or choose another --out",
            )
    else:
        path.write_text(json.dumps(settings, indent=1) + "\n")


def _finished(study) -> int:
    """Trials that count towards the total: complete ones and those that failed on their own (a
    diverged run); trials cut short by an interruption are run again instead."""
    from optuna.trial import TrialState

    return sum(
        1
        for t in study.trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and "error" in t.user_attrs)
    )


def _requeue_interrupted(study, storage, log) -> None:
    """A trial left RUNNING (the process was killed) or failed by an interruption is queued again with
    the same parameters and run folder, so its training resumes from its newest checkpoint."""
    from optuna.trial import TrialState

    retried = {t.user_attrs.get("retry_of") for t in study.trials}
    for t in study.trials:
        if t.state == TrialState.RUNNING:
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        elif not (t.state == TrialState.FAIL and "error" not in t.user_attrs):
            continue
        if t.number in retried or not t.params:
            continue
        attrs = {"retry_of": t.number, "run_name": t.user_attrs.get("run_name", f"trial-{t.number:04d}")}
        if t.user_attrs.get("default"):
            attrs["default"] = True
        study.enqueue_trial(t.params, user_attrs=attrs)
        log(f"[sweep] trial {t.number} was interrupted; queued again in {attrs['run_name']}")


def _data_stages(recipe: Recipe) -> list[str]:
    return [s for s in STAGES if s in recipe.run.stages and STAGES.index(s) < STAGES.index("pretrain")]


def _trial_recipe(recipe_path, overrides: list[str], params: dict, out: Path, name: str) -> Recipe:
    return load_recipe(
        recipe_path,
        [*overrides, *_overrides(params), f"run.out_dir={toml_value(str(out))}", f"run.name={toml_value(name)}"],
    )


def _build_base(recipe_path, overrides: list[str], out: Path) -> Recipe:
    """The recipe's data stages, built once under <out>/base for every trial to share."""
    base = _trial_recipe(recipe_path, overrides, {}, out, "base")
    if _data_stages(base):
        run_recipe(base, _data_stages(base))
    return base


def _run_trial(
    recipe_path, overrides, params: dict, out: Path, run_name: str, base: Recipe, metric: str, trial
) -> float:
    recipe = _trial_recipe(recipe_path, overrides, params, out, run_name)
    own = []
    for stage in _data_stages(recipe):
        link = stage_dir(recipe, stage)
        if fingerprint(recipe, stage) == fingerprint(base, stage):
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(Path("..") / "base" / stage, target_is_directory=True)
        else:
            # The trial changes this stage's inputs (e.g. tokenizer.vocab_size): it builds its own.
            if link.is_symlink():
                link.unlink()
            own.append(stage)
    if recipe.train.compile:
        import torch

        # Trials share one process: without a reset, each new model's compilation counts towards
        # dynamo's recompile limit and later trials would silently fall back to eager mode.
        torch._dynamo.reset()
    run_recipe(recipe, [*own, "pretrain"])
    pretrain = stage_dir(recipe, "pretrain")
    # Validation losses reach Optuna after the run, for its history and plots (not for pruning).
    for record in _val_records(pretrain / "metrics.jsonl"):
        trial.report(record["val_loss"], record["step"])
    summary = json.loads((pretrain / "summary.json").read_text())
    if metric not in summary:
        numeric = sorted(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise ConfigError("--metric", f"{metric!r} is not in the pretrain summary; known: {', '.join(numeric)}")
    value = summary[metric]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{metric} is {value!r} in {pretrain / 'summary.json'}")
    return float(value)


def _val_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "val" and isinstance(record.get("val_loss"), (int, float)):
            records[int(record["step"])] = record  # a resumed run may repeat a step: keep the last
    return [records[s] for s in sorted(records)]


def _write_results(
    study, out: Path, metric: str, direction: str, settings: dict, recipe_path, overrides: list[str]
) -> SweepResult:
    from optuna.trial import TrialState

    rows = []
    for t in study.trials:
        if t.state == TrialState.WAITING:
            continue
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "duration_s": t.user_attrs.get("duration_s"),
                "default": bool(t.user_attrs.get("default")),
                "params": dict(t.params),
                "run_dir": str(out / t.user_attrs.get("run_name", "")),
                "error": t.user_attrs.get("error"),
            }
        )
    complete = [r for r in rows if r["state"] == "complete"]
    pick = min if direction == "minimize" else max
    best = pick(complete, key=lambda r: r["value"]) if complete else None
    default = next((r for r in complete if r["default"]), None)
    best_path = None
    if best is not None:
        best_path = out / "best.toml"
        recipe = load_recipe(recipe_path, [*overrides, *_overrides(best["params"])])
        name = recipe.run.name + "-best"
        recipe = dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, name=name))
        lines = [f"The best trial ({best['trial']}) of the sweep in {out}: {metric} = {best['value']:.6g}"]
        if default is not None:
            lines.append(f"the recipe's own values (trial {default['trial']}): {metric} = {default['value']:.6g}")
        lines += [f"  {k} = {toml_value(v)}" for k, v in best["params"].items()]
        lines.append(f"Base recipe: {recipe_path or '<defaults>'} {' '.join(overrides)}".rstrip())
        best_path.write_text(recipe_to_toml(recipe, "\n".join(lines), keep=tuple(best["params"])))
    result = SweepResult(out, metric, direction, rows, best, default, best_path, settings)
    payload = {**settings, "best": best, "default": default, "improvement": result.improvement, "trials": rows}
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", metric, "duration_s", "default", *keys, "run_dir", "error"])
        for r in rows:
            writer.writerow(
                [
                    r["trial"],
                    r["state"],
                    r["value"],
                    r["duration_s"],
                    r["default"],
                    *(r["params"].get(k) for k in keys),
                    r["run_dir"],
                    r["error"] or "",
                ]
            )
    return result


def format_table(result: SweepResult) -> str:
    keys = list(dict.fromkeys(k for r in result.rows for k in r["params"]))
    head = ["trial", "state", result.metric, "seconds", *keys, ""]
    body = []
    for r in result.rows:
        note = " ".join(n for n, on in (("default", r["default"]), ("best", r is result.best)) if on)
        body.append(
            [
                str(r["trial"]),
                r["state"],
                "" if r["value"] is None else f"{r['value']:.4f}",
                "" if r["duration_s"] is None else f"{r['duration_s']:.0f}",
                *(_fmt(r["params"][k]) if k in r["params"] else "" for k in keys),
                note,
            ]
        )
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
    if result.best is not None:
        lines.append(
            f"best: trial {result.best['trial']}, {result.metric} = {result.best['value']:.4f}"
            + (
                f" (default {result.default['value']:.4f}, better by {result.improvement:.4f})"
                if result.improvement is not None
                else ""
            )
        )
        lines.append(f"best recipe: {result.best_recipe}")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="hyperparameter search with Optuna, each trial a real training run")
    p.add_argument("recipe", nargs="?", default="tiny", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every trial, e.g. train.max_steps=100")
    p.add_argument("--space", help='TOML file of searched keys, e.g. [train] lr = "loguniform:1e-4:1e-2"')
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=SPEC",
        help="a searched key: float|loguniform|int|logint:LOW:HIGH[:STEP] or choice:A,B,C (repeatable)",
    )
    p.add_argument("--trials", type=int, default=8, help="trials in total, trial 0 being the recipe's values")
    p.add_argument("--sampler", choices=("tpe", "random"), default="tpe")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (the training seed is the recipe's)")
    p.add_argument("--metric", default="best_val_loss", help="key of the pretrain summary.json to optimise")
    p.add_argument("--direction", choices=("minimize", "maximize"), default="minimize")
    p.add_argument("--out", help="sweep folder (default: <out_dir>/<name>-sweep); rerun to resume")
    return p


def run(args: argparse.Namespace) -> int:
    space = parse_space(args.param, args.space)
    result = run_sweep(
        args.recipe,
        space,
        args.trials,
        overrides=args.overrides,
        sampler=args.sampler,
        seed=args.seed,
        metric=args.metric,
        direction=args.direction,
        out_dir=args.out,
    )
    return 0 if result.best is not None else 1


def _cli(argv: list[str] | None = None) -> int:
    """``python -m kiln.sweep ...``: the verb without the rest of the kiln command."""
    parser = argparse.ArgumentParser(prog="python -m kiln.sweep")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["sweep", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ConfigError as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
