"""The layers of docs/architecture.md, enforced on every import in kiln/, at any depth.

Imports inside functions count as much as those at the top of a module: an import moved into a
function to dodge a cycle is still an edge of the graph. The same checks run on a small synthetic
tree holding the edges this layout replaced, so a rule that stopped seeing them would fail too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"

# Lower layers never import higher ones. Within a layer, packages may import each other as long as
# no cycle forms.
LAYERS = {
    "bottom": ["kiln", "kiln.errors", "kiln.config", "kiln.progress", "kiln.files", "kiln.storage", "kiln.checkpoint"],
    "model, data": ["kiln.model", "kiln.data"],
    "hf, peft, parallel": [
        "kiln.hf",
        "kiln.hf_moe",
        "kiln.hf_bert",
        "kiln.hf_t5",
        "kiln.hf_tensors",
        "kiln.peft",
        "kiln.parallel",
    ],
    "train": ["kiln.train"],
    "stages": ["kiln.infer", "kiln.eval", "kiln.post"],
    "serve": ["kiln.serve"],
    "top": [
        "kiln.recipe",
        "kiln.recipe_files",
        "kiln.pipeline",
        "kiln.pipeline_verbs",
        "kiln.run_store",
        "kiln.cli",
        "kiln.report",
        "kiln.report_plots",
        "kiln.sweep",
        "kiln.cost",
        "kiln.stage_summary",
        "kiln.report_compare",
    ],
}
# Edges that the layer order allows but the design does not.
FORBIDDEN = [
    ("kiln.data", "kiln.model", "data is documents and token ids; it knows no model"),
    ("kiln.model", "kiln.data", "the model is a plain nn.Module over token ids"),
    ("kiln.infer", "kiln.train", "inference loads checkpoints, never the training loop"),
    ("kiln.serve", "kiln.train", "the server runs the inference engine, never the training loop"),
    ("kiln.infer", "kiln.post", "the generator serves post-training, not the other way round"),
]
# Function-level imports of Kiln's own modules that may remain, each with its reason on the line.
MAX_LAZY_IMPORTS = 30


def scan(root: Path) -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool, str]]]]:
    """Modules under `root` (a `kiln` folder) and, per module, (imported module, line, inside a
    function, source line) for every import of a Kiln module."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    def imports_of(module: str):
        path = modules[module]
        source = path.read_text()
        lines = source.splitlines()
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    targets = [f"{base}.{a.name}" for a in child.names]
                for target in targets:
                    if target == "kiln" or target.startswith("kiln."):
                        yield resolve(target), child.lineno, in_function, lines[child.lineno - 1]
                yield from visit(child, nested)

        return list(visit(ast.parse(source), False))

    return modules, {m: imports_of(m) for m in modules}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS.values()):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"{module} is in no layer of tests/test_architecture.py: add it"
    return rank


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_edges(modules, edges) -> list[str]:
    names = list(LAYERS)
    return [
        f"{m}:{line} imports {t} ({names[layer_of(m)]} -> {names[layer_of(t)]})"
        for m in modules
        for t, line, _, _ in edges[m]
        if layer_of(t) > layer_of(m)
    ]


def forbidden_edges(modules, edges, source: str, target: str) -> list[str]:
    return [
        f"{m}:{line} imports {t}"
        for m in modules
        if within(m, source)
        for t, line, _, _ in edges[m]
        if within(t, target)
    ]


def cli_importers(modules, edges) -> list[str]:
    return [f"{m}:{line}" for m in modules for t, line, _, _ in edges[m] if t == "kiln.cli" and m != "kiln.cli"]


def find_cycle(modules, edges) -> list[str] | None:
    # A package's __init__ that re-exports its own submodules is not a cycle of design.
    graph = {m: sorted({t for t, *_ in edges[m] if t != m and not within(m, t)}) for m in modules}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def lazy_imports(modules, edges) -> list[tuple[str, int, str]]:
    return [(m, line, text) for m in modules for t, line, inside, text in edges[m] if inside and t != "kiln"]


MODULES, EDGES = scan(ROOT)


def test_no_import_reaches_up_a_layer():
    wrong = upward_edges(MODULES, EDGES)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("source, target, reason", FORBIDDEN)
def test_forbidden_edges(source, target, reason):
    wrong = forbidden_edges(MODULES, EDGES, source, target)
    assert not wrong, f"{reason}:\n" + "\n".join(wrong)


def test_nothing_imports_the_cli():
    wrong = cli_importers(MODULES, EDGES)
    assert not wrong, "the CLI is the top of the stack; these import it:\n" + "\n".join(wrong)


def test_no_import_cycles():
    cycle = find_cycle(MODULES, EDGES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lazy_imports_are_few_and_each_says_why():
    lazy = lazy_imports(MODULES, EDGES)
    unexplained = [f"{m}:{line}" for m, line, text in lazy if "#" not in text]
    assert not unexplained, "a Kiln import inside a function needs a one-line reason on the line:\n" + "\n".join(
        unexplained
    )
    assert len(lazy) < MAX_LAZY_IMPORTS, f"{len(lazy)} Kiln imports inside functions (at most {MAX_LAZY_IMPORTS - 1})"


# ---- the checks see the edges this layout removed -------------------------------------------------

# Module -> source, one edge each of the kinds the architecture issue found (names as they were).
OLD_EDGES = {
    "kiln/__init__.py": "",
    "kiln/cli.py": "from kiln.eval.cli import run\n\ndef find_tokenizer(path):\n    return path\n",
    "kiln/eval/__init__.py": "",
    "kiln/eval/cli.py": "def run(args):\n    from kiln.cli import find_tokenizer\n",
    "kiln/data/__init__.py": "",
    "kiln/data/pack.py": "from kiln.train.system import progress\n",
    "kiln/data/tokens.py": "def f():\n    from kiln.model.config import ModelConfig\n",
    "kiln/model/__init__.py": "",
    "kiln/model/config.py": "",
    "kiln/infer/__init__.py": "",
    "kiln/infer/sample.py": "def load_model(path):\n    from kiln.train.checkpoint import load_weights\n",
    "kiln/train/__init__.py": "",
    "kiln/train/system.py": "",
    "kiln/train/checkpoint.py": "def load_weights(path):\n    from kiln.parallel.checkpoint import load_sharded\n",
    "kiln/parallel/__init__.py": "",
    "kiln/parallel/checkpoint.py": "from kiln.train.checkpoint import CheckpointManager\n",
    "kiln/post/__init__.py": "",
    "kiln/post/ppo.py": "def run():\n    from kiln.pipeline import stage_dir\n",
    "kiln/pipeline.py": "",
}


def test_the_checks_report_the_edges_they_replaced(tmp_path):
    for name, text in OLD_EDGES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules, edges = scan(tmp_path / "kiln")
    upward = "\n".join(upward_edges(modules, edges))
    for edge in ("kiln.train.system", "kiln.train.checkpoint", "kiln.pipeline", "kiln.cli"):
        assert f"imports {edge} " in upward, edge
    assert forbidden_edges(modules, edges, "kiln.data", "kiln.model") == [
        "kiln.data.tokens:2 imports kiln.model.config"
    ]
    assert forbidden_edges(modules, edges, "kiln.infer", "kiln.train")
    assert cli_importers(modules, edges) == ["kiln.eval.cli:2"]
    cycle = find_cycle(modules, edges)
    assert cycle is not None and set(cycle) in (
        {"kiln.cli", "kiln.eval.cli"},
        {"kiln.train.checkpoint", "kiln.parallel.checkpoint"},
    )
    assert [(m, line) for m, line, text in lazy_imports(modules, edges) if "#" not in text] == [
        ("kiln.data.tokens", 2),
        ("kiln.eval.cli", 2),
        ("kiln.infer.sample", 2),
        ("kiln.post.ppo", 2),
        ("kiln.train.checkpoint", 2),
    ]
