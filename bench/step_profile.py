"""Where a training step's time goes: torch.profiler over a few steps, each operator's own (self)
CPU time put into one of CATEGORIES. Used by `bench/train_step.py --profile`.

An operator's category is decided, first match wins:
1. inside the step's `bench.optimizer` scope (clipping + optimizer step): "optimizer";
2. by its own name or an enclosing operator's: attention (scaled_dot_product*), the loss head's
   cross-entropy (log_softmax, nll_loss, logsumexp, cross_entropy, the chunked head's function),
   norms (rms_norm, layer_norm);
3. a tensor of shape [..., vocab] among its inputs (the output head's matmul, the float32 upcast of
   the logits and every backward operator on them): "loss head"; embedding operators excepted;
4. the module it ran in (norm modules and the output head are wrapped in scopes by `scope_modules`,
   because transformers' RMSNorm is written as pow/mean/rsqrt, which no name rule catches);
   a backward operator takes the category of the forward operator that made it (sequence_nr);
5. matmuls (mm, addmm, bmm, linear, matmul): "block matmuls";
6. everything else: "elementwise/other" (activations, residual adds, RoPE, casts, embeddings...).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

CATEGORIES = ("optimizer", "loss head", "attention", "block matmuls", "norms", "elementwise/other")
OPTIMIZER_SCOPE = "bench.optimizer"
_SCOPES = {"bench.norm": "norms", "bench.head": "loss head"}
_NAME_RULES = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("loss head", ("log_softmax", "nll_loss", "logsumexp", "cross_entropy", "linearcrossentropy")),
    ("norms", ("rms_norm", "layer_norm", "rmsnorm", "layernorm")),
)
_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_addmm_activation")


def scope_modules(model: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """Wrap every norm module's forward, and the output head's, in a profiler scope (forward hooks)."""

    def wrap(module, name):
        state = {}

        def enter(_module, _args):
            state["rf"] = record_function(name)
            state["rf"].__enter__()

        def leave(_module, _args, _out):
            state.pop("rf").__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            wrap(module, "bench.norm")
    if head is not None:
        wrap(head, "bench.head")


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def _by_name(name: str) -> str | None:
    name = name.lower()
    for category, needles in _NAME_RULES:
        if any(n in name for n in needles):
            return category
    return None


def _touches_vocab(event, vocab: int) -> bool:
    if "embedding" in event.name:
        return False
    return any(len(shape) >= 2 and shape[-1] == vocab for shape in event.input_shapes if isinstance(shape, list))


def categorise(events, vocab: int) -> dict[str, float]:
    """{category: milliseconds of self CPU time} over the profiled events."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    forward_scope = {}  # sequence_nr of a forward operator -> the module scope it ran in
    for event in sorted(events, key=lambda e: e.time_range.start):
        chain = list(_ancestors(event))
        names = [e.name for e in chain]
        backward = next((e for e in chain if e.name.startswith("autograd::engine::evaluate_function")), None)
        scope = next((_SCOPES[n] for n in names if n in _SCOPES), None)
        if backward is None and scope is not None and event.sequence_nr >= 0:
            forward_scope.setdefault(event.sequence_nr, scope)
        if backward is not None and scope is None:
            scope = forward_scope.get(backward.sequence_nr)
        if OPTIMIZER_SCOPE in names:
            category = "optimizer"
        else:
            category = next((c for c in map(_by_name, names) if c is not None), None)
        if category is None and any(_touches_vocab(e, vocab) for e in chain[:2]):
            category = "loss head"
        category = category or scope
        if category is None:
            matmul = event.name in _MATMULS or any(n.startswith(("MmBackward", "AddmmBackward")) for n in names)
            category = "block matmuls" if matmul else "elementwise/other"
        totals[category] += event.self_cpu_time_total / 1e3
    return totals


def profile_steps(step, x, y, steps: int, vocab: int) -> dict[str, float]:
    """{category: ms per step} over `steps` profiled steps (after one unprofiled warmup step)."""
    step(x, y)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step(x, y)
    return {k: v / steps for k, v in categorise(prof.events(), vocab).items()}


def format_table(columns: dict[str, dict[str, float]]) -> list[str]:
    """Rows 'category | ms (share) per column', with a total row."""
    names = list(columns)
    lines = [f"  {'':20s}" + "".join(f"{n:>26s}" for n in names)]
    totals = {n: sum(columns[n].values()) for n in names}
    for category in CATEGORIES:
        cells = "".join(f"{columns[n][category]:>14.1f} ms ({columns[n][category] / totals[n]:5.1%})" for n in names)
        lines.append(f"  {category:20s}{cells}")
    lines.append(f"  {'total (op self time)':20s}" + "".join(f"{totals[n]:>14.1f} ms {'':8s}" for n in names))
    return lines


def kernel_table(step, x, y, steps: int, top: int = 12) -> list[tuple[str, float]]:
    """(operator or inductor kernel, ms of self time per step), the `top` largest, over `steps` steps
    of an already compiled and warmed-up step. The step must have been compiled with
    torch._inductor.config.cpp.enable_kernel_profile on, so each generated C++ kernel shows as an
    operator of its own (`graph_0_cpp_fused_...`) instead of disappearing into the graph's call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(x, y)
    per_step = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    return sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
