"""What a finished training stage cost: device-hours, energy and money, from its summary.json.

The measured part bills the stage's wall time (devices are held through evaluation, checkpoints
and compilation too) on every rank. The projection prices a token budget at the stage's measured
training throughput on the same number of devices, the way `kiln plan --tokens` prices one at a
predicted throughput (kiln.parallel.plan_time.budget): the same formula, with a PUE on top.

GPU power and price come from the planner's table (kiln.parallel.hardware). CPUs are not in that
table: they are billed per core-hour with the CPU_* defaults below, and every CPU figure says so.
Docs: docs/cost.md.
"""

from __future__ import annotations

import html
import math

from kiln.errors import ConfigError, DataError
from kiln.parallel.hardware import GPUS, find_gpu

# Power usage effectiveness: facility energy over IT energy. Google reports ~1.10 for its fleet,
# the Uptime Institute's 2023 survey ~1.58 across all sites; 1.2 is a recent, well-run facility.
DEFAULT_PUE = 1.2
# Package TDP over cores of current server parts: AMD EPYC 9654 360 W / 96 = 3.75 W, Intel Xeon
# Platinum 8480+ 350 W / 56 = 6.25 W.
CPU_WATTS_PER_CORE = 5.0
# AWS c7i on-demand (us-east-1, 2025 list): $0.08925/h for 2 vCPUs, which are one physical core.
CPU_PRICE_PER_CORE_HOUR = 0.09
CHINCHILLA_TOKENS_PER_PARAM = 20  # compute-optimal tokens per parameter (Hoffmann et al. 2022)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is not None and (not _num(value) or value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(key, f"must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


def gpu_key(name: str) -> str:
    """The hardware table's key for `name` (a key, an alias or a spelling such as H100_SXM)."""
    try:
        spec = find_gpu(name)
    except ConfigError as e:
        raise ConfigError("hardware", f"{e.message}, or cpu") from None
    return next(k for k, v in GPUS.items() if v is spec)


def _detect_gpu(summary: dict) -> tuple[str | None, str]:
    """(table key, how it was found) of a GPU run's accelerator, or (None, why not)."""
    name = summary.get("device_name")
    if isinstance(name, str):
        found = [k for k in GPUS if k.upper() in name.upper().replace(" ", "")]
        if len(found) == 1:
            return found[0], f"device_name {name!r}"
    peak = summary.get("peak_flops")
    if _num(peak) and peak > 0:
        # The trainer's datasheet peaks (kiln.train.metrics) round differently from the table's.
        found = [k for k, g in GPUS.items() if abs(g.bf16_flops - peak) <= 0.01 * g.bf16_flops]
        if len(found) == 1:
            return found[0], f"peak_flops {peak:.4g}"
        if found:
            return None, f"peak_flops {peak:.4g} fits {' and '.join(found)}; pass the hardware to choose"
    return None, "the summary does not name the GPU; pass the hardware (e.g. --hardware h100)"


def _world_size(summary: dict, override: int | None) -> tuple[int, str]:
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ConfigError("world_size", f"must be a positive integer, got {override!r}")
        return override, "given"
    if isinstance(summary.get("world_size"), int) and summary["world_size"] >= 1:
        return summary["world_size"], "summary.json"
    # The summary's MFU is flops_per_token * tokens_per_s / (peak_flops * world), tokens_per_s
    # counting every rank's tokens, so the identity gives the rank count back.
    f, t, p, m = (summary.get(k) for k in ("flops_per_token", "tokens_per_s", "peak_flops", "mfu"))
    if all(_num(v) and v > 0 for v in (f, t, p, m)):
        return max(1, round(f * t / (p * m))), "MFU identity"
    return 1, "assumed"


def _rates(
    kind: str, spec_power: float | None, cores: int | None, price: float | None, power_w: float | None
) -> tuple[float | None, float | None, float]:
    """(watts per device, USD per device-hour, billing units per device: 1 GPU, or the cores of a
    CPU process; 0 when unknown). None where the figure is unknown."""
    if kind == "gpu":
        return (power_w if power_w is not None else spec_power), price, 1.0
    if cores is None:
        return power_w, None, 0.0
    watts = power_w if power_w is not None else cores * CPU_WATTS_PER_CORE
    per_core = price if price is not None else CPU_PRICE_PER_CORE_HOUR
    return watts, per_core * cores, float(cores)


def _price(device_hours: float, units: float, watts, per_device_hour, pue: float) -> dict:
    return {
        "device_hours": device_hours,
        "units": device_hours * units if units else None,
        "energy_kwh": device_hours * watts * pue / 1000 if watts is not None else None,
        "cost_usd": device_hours * per_device_hour if per_device_hour is not None else None,
    }


def check_options(
    hardware: str | None = None,
    price_per_hour: float | None = None,
    pue: float = DEFAULT_PUE,
    power_w: float | None = None,
    cores: int | None = None,
    token_budgets: dict[str, float] | None = None,
) -> None:
    """Raise ConfigError naming the first impossible cost option (what run_cost takes beside the summary)."""
    if hardware is not None and hardware.strip().lower() != "cpu":
        gpu_key(hardware)
    _positive("price_per_hour", price_per_hour, allow_zero=True)
    _positive("power_w", power_w)
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ConfigError("cores", f"must be a positive integer, got {cores!r}")
    if not (_num(pue) and pue >= 1):
        raise ConfigError("pue", f"must be a number >= 1 (facility energy over IT energy), got {pue!r}")
    for label, budget in (token_budgets or {}).items():
        if not (_num(budget) and budget > 0):
            raise ConfigError("tokens", f"the token budget {label!r} must be a positive number, got {budget!r}")


def run_cost(
    summary: dict,
    hardware: str | None = None,
    price_per_hour: float | None = None,
    *,
    pue: float = DEFAULT_PUE,
    power_w: float | None = None,
    cores: int | None = None,
    world_size: int | None = None,
    token_budgets: dict[str, float] | None = None,
) -> dict:
    """Cost of the stage whose summary.json is `summary`.

    hardware: a key of kiln.parallel.hardware.GPUS (or alias), or "cpu"; default: detected from
    the summary (device, device_name, peak_flops). price_per_hour: USD per GPU-hour (per core-hour
    on CPU); default the table's (CPU_PRICE_PER_CORE_HOUR). power_w: watts per device instead of
    the GPU's TDP (per process on CPU, instead of cores x CPU_WATTS_PER_CORE). cores: CPU threads
    per process (default: the summary's "threads"). token_budgets: {label: tokens} to project;
    default 20 tokens per parameter.
    """
    if not isinstance(summary, dict):
        raise DataError(f"summary must be a JSON object, got {type(summary).__name__}")
    wall_s, tokens_per_s = summary.get("wall_s"), summary.get("tokens_per_s")
    if not (_num(wall_s) and wall_s >= 0):
        raise DataError("summary has no wall_s (seconds the stage ran)")
    check_options(None, price_per_hour, pue, power_w, cores, token_budgets)
    device = str(summary.get("device") or "cpu")
    ran_on_gpu = not device.startswith("cpu")
    notes: list[str] = []

    key, found_by = _hardware(summary, hardware, device, ran_on_gpu, notes)
    kind = "gpu" if ran_on_gpu else "cpu"

    world, world_from = _world_size(summary, world_size)
    if world_from == "assumed":
        notes.append("world size not in the summary: 1 device assumed")
    if kind == "cpu" and cores is None:
        threads = summary.get("threads")
        cores = threads if isinstance(threads, int) and threads > 0 else None
        if cores is None and price_per_hour is None and power_w is None:
            notes.append("CPU threads not in the summary: core-hours, energy and money left out (pass the cores)")
    spec = GPUS[key] if key else None
    if kind == "gpu" and spec is not None and price_per_hour is None:
        price_per_hour = spec.price
    watts, per_device_hour, units = _rates(kind, spec.power if spec else None, cores, price_per_hour, power_w)
    unit = "GPU-hour" if kind == "gpu" else "core-hour"
    if kind == "gpu" and watts is None:
        notes.append("GPU power unknown: energy left out (pass the hardware or the power)")
    if kind == "gpu" and per_device_hour is None:
        notes.append("GPU price unknown: money left out (pass the hardware or the price)")
    if kind == "cpu" and cores is None and price_per_hour is not None:
        notes.append("price given per core-hour but the core count is unknown: money left out")
    if summary.get("resumed_from"):
        notes.append("resumed stage: wall time is the last invocation's only")

    device_hours = wall_s * world / 3600
    measured = _price(device_hours, units, watts, per_device_hour, pue)
    tokens = summary.get("tokens_seen")
    per_million = (
        measured["cost_usd"] / tokens * 1e6
        if measured["cost_usd"] is not None and _num(tokens) and tokens > 0
        else None
    )
    result = {
        "kind": kind,
        "device": device,
        "hardware": spec.name if spec else ("cpu" if kind == "cpu" else None),
        "hardware_from": found_by or None,
        "world_size": world,
        "world_size_from": world_from,
        "wall_s": wall_s,
        "train_s": summary.get("train_s") if _num(summary.get("train_s")) else None,
        "tokens_seen": tokens if _num(tokens) else None,
        "tokens_per_s": tokens_per_s if _num(tokens_per_s) else None,
        "device_hours": device_hours,
        "gpu_hours": device_hours if kind == "gpu" else 0.0,
        "core_hours": measured["units"] if kind == "cpu" else None,
        "cores": cores if kind == "cpu" else None,
        "power_w": watts,
        "pue": pue,
        "energy_kwh": measured["energy_kwh"],
        "price_per_hour": per_device_hour / units if per_device_hour is not None and units else None,
        "price_unit": unit,
        "cost_usd": measured["cost_usd"],
        "usd_per_million_tokens": per_million,
        "notes": notes,
        "projections": [],
    }
    if token_budgets is None:
        params = summary.get("params")
        token_budgets = (
            {f"{CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter": CHINCHILLA_TOKENS_PER_PARAM * params}
            if _num(params) and params > 0
            else {}
        )
    if _num(tokens_per_s) and tokens_per_s > 0:
        rates = (units, watts, per_device_hour, pue)
        result["projections"] = [
            _projection(label, budget, tokens_per_s, world, kind, rates) for label, budget in token_budgets.items()
        ]
    elif token_budgets:
        notes.append("no measured tokens_per_s: no projection")
    return result


def _hardware(summary: dict, hardware: str | None, device: str, ran_on_gpu: bool, notes: list[str]):
    """(key of GPUS or None, how it was found: "given", a detection source, or "")."""
    wanted = (hardware or "").strip().lower() or None
    if wanted == "cpu":
        if ran_on_gpu:
            raise ConfigError("hardware", f"the stage trained on {device}, not on cpu")
        return None, ""
    if wanted is not None:
        key = gpu_key(wanted)
        if not ran_on_gpu:
            raise ConfigError(
                "hardware",
                f"the stage trained on {device}: {GPUS[key].name} figures would "
                f"price time it did not spend on a GPU; leave the hardware out or pass cpu",
            )
        return key, "given"
    if not ran_on_gpu:
        return None, ""
    key, found_by = _detect_gpu(summary)
    if key is None:
        notes.append(f"GPU not identified ({found_by})")
        return None, ""
    return key, found_by


def _projection(label: str, budget: float, tokens_per_s: float, world: int, kind: str, rates: tuple) -> dict:
    """Time, device-hours, energy and money of training `budget` tokens at the measured rate."""
    seconds = budget / tokens_per_s
    row = _price(seconds * world / 3600, *rates)
    return {
        "label": label,
        "tokens": budget,
        "days": seconds / 86400,
        "device_hours": row["device_hours"],
        "gpu_hours": row["device_hours"] if kind == "gpu" else 0.0,
        "core_hours": row["units"] if kind == "cpu" else None,
        "energy_kwh": row["energy_kwh"],
        "cost_usd": row["cost_usd"],
    }


# ---------------------------------------------------------------- presentation (kiln report)


def _money(v) -> str:
    if not _num(v):
        return "–"
    return f"${v:,.2f}" if v >= 1 else f"${v:.4g}"


def _hours(v) -> str:
    return f"{v:,.1f}" if _num(v) and v >= 100 else (f"{v:.4g}" if _num(v) else "–")


def _kwh(v) -> str:
    return f"{v:.4g} kWh" if _num(v) else "–"


def cost_html_text(c: dict, stage: str) -> tuple[str, str]:
    """The report's view of `run_cost`'s result: (HTML tables, plain-text lines)."""
    esc = html.escape
    gpu = c["kind"] == "gpu"
    what = (
        f"{c['world_size']} x {c['hardware'] or 'unidentified GPU'}"
        if gpu
        else f"{c['world_size']} CPU process(es)" + (f" x {c['cores']} cores" if c["cores"] else "")
    )
    unit_name = "GPU-hours" if gpu else "CPU core-hours"
    unit_hours = c["gpu_hours"] if gpu else c["core_hours"]
    price = f"{_money(c['price_per_hour'])} per {c['price_unit']}" if _num(c["price_per_hour"]) else "–"
    power = f"{c['power_w']:,.0f} W per {'GPU' if gpu else 'process'}" if _num(c["power_w"]) else "–"
    rows = [
        ("devices", f"{what} (world size: {c['world_size_from']})"),
        (
            "wall time",
            f"{c['wall_s']:,.0f} s" + (f" ({c['train_s']:,.0f} s in training steps)" if _num(c["train_s"]) else ""),
        ),
        ("device-hours" if gpu else "device-hours (CPU process-hours)", _hours(c["device_hours"])),
        *([] if gpu else [(unit_name, _hours(unit_hours))]),
        ("power", power),
        ("PUE", f"{c['pue']:g}"),
        ("energy", _kwh(c["energy_kwh"])),
        ("price", price),
        ("cost", _money(c["cost_usd"])),
        ("cost per million tokens", _money(c["usd_per_million_tokens"])),
    ]
    body = "".join(f"<tr><td>{esc(k)}</td><td class=n>{esc(v)}</td></tr>" for k, v in rows)
    parts = [f"<table><tr><th>{esc(stage)}</th><th>measured</th></tr>{body}</table>"]
    if c["notes"]:
        parts.append('<ul class="note">' + "".join(f"<li>{esc(n)}</li>" for n in c["notes"]) + "</ul>")
    known = [f"{_hours(unit_hours)} {unit_name}" if _num(unit_hours) else f"{_hours(c['device_hours'])} device-hours"]
    known += [f"{_kwh(c['energy_kwh'])} at PUE {c['pue']:g}"] if _num(c["energy_kwh"]) else []
    known += [_money(c["cost_usd"])] if _num(c["cost_usd"]) else []
    text = [f"measured: {what}, {c['wall_s']:,.0f} s wall, " + ", ".join(known)] + [f"note: {n}" for n in c["notes"]]
    if c["projections"]:
        prows = [
            [
                p["label"],
                f"{p['tokens']:.3g}",
                f"{p['days']:.3g}",
                _hours(
                    p["gpu_hours"] if gpu else p["core_hours"] if p["core_hours"] is not None else p["device_hours"]
                ),
                f"{p['energy_kwh']:.4g}" if _num(p["energy_kwh"]) else "–",
                _money(p["cost_usd"]),
            ]
            for p in c["projections"]
        ]
        hours_name = unit_name if gpu or c["core_hours"] is not None else "device-hours"
        head = "".join(f"<th>{h}</th>" for h in ("token budget", "tokens", "days", hours_name, "kWh", "cost"))
        pbody = "".join(
            "<tr>" + "".join(f"<td{' class=n' if i else ''}>{esc(v)}</td>" for i, v in enumerate(r)) + "</tr>"
            for r in prows
        )
        parts.append(
            f"<h3>Projection at the measured {c['tokens_per_s']:,.0f} tokens/s on the same devices</h3>"
            f"<table><tr>{head}</tr>{pbody}</table>"
        )
        text += [
            f"projection {r[0]}: {r[1]} tokens, {r[2]} days, {r[3]} {hours_name}"
            + (f", {r[4]} kWh" if r[4] != "–" else "")
            + (f", {r[5]}" if r[5] != "–" else "")
            for r in prows
        ]
    parts.append(
        '<p class="note">device-hours = wall time x devices; energy = device-hours x power x PUE; '
        "cost = device-hours x price (core-hours x price on CPU). Projections take training steps only "
        "(no evaluation, checkpoint or compile time). Formulas and defaults: docs/cost.md.</p>"
    )
    return "".join(parts), "\n".join(text)
