"""The recipes that ship inside the package (kiln/recipes/*.toml): found by name, listed, copied out.

`kiln run tiny` works from any folder: a recipe argument that is no file and is a bare name (with or
without .toml) is the packaged recipe of that name. `kiln recipes` lists them with the first line of
their opening comment; `kiln init NAME [DEST]` copies one out for editing and never overwrites a file.
Torch-free: these verbs only read TOML files.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from kiln.errors import ConfigError, did_you_mean

PACKAGED = Path(__file__).parent / "recipes"


def packaged_recipes() -> dict[str, Path]:
    """Name -> file of every recipe shipped in the package, sorted by name."""
    return {path.stem: path for path in sorted(PACKAGED.glob("*.toml"))}


def _bare_name(arg: str) -> str | None:
    """The recipe name `arg` spells when it is a bare name ("tiny" or "tiny.toml"), else None."""
    if "/" in arg or "\\" in arg or not arg:
        return None
    return arg[: -len(".toml")] if arg.endswith(".toml") else arg


def resolve_recipe(arg: str | Path) -> Path:
    """The file a recipe argument names: the path itself when it exists (a file always wins), else the
    packaged recipe of that bare name. A bare name that is neither is refused, naming the packaged ones."""
    path = Path(arg)
    if path.exists():
        return path
    name = _bare_name(str(arg))
    known = packaged_recipes()
    if name is None:
        # recipes/tiny.toml outside the repository: the packaged copy, so the documented paths work
        # from an installed wheel as well.
        if path.parent.name == "recipes" and path.suffix == ".toml" and path.stem in known:
            return known[path.stem]
        return path  # read_toml names the missing file
    if name in known:
        return known[name]
    raise ConfigError(
        "recipe",
        f"no such file, and no packaged recipe {name!r}{did_you_mean(name, known)} (kiln recipes lists them)",
        str(arg),
    )


def summary(path: Path) -> str:
    """The first line of a recipe's opening comment, its one-line description."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def init_recipe(name: str, dest: str | Path | None = None) -> Path:
    """Copy the packaged recipe `name` to `dest` (default ./NAME.toml, or DEST/NAME.toml for a folder);
    an existing file is never overwritten."""
    known = packaged_recipes()
    if name not in known:
        raise ConfigError("NAME", f"no packaged recipe {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}")
    target = Path(dest) if dest is not None else Path(f"{name}.toml")
    if target.is_dir():
        target = target / f"{name}.toml"
    if target.exists() or target.is_symlink():
        raise ConfigError("DEST", "already exists; kiln init never overwrites a file (name another DEST)", str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(known[name], target)
    return target


EPILOG_RECIPES = "example:\n  kiln recipes\n  kiln init tiny my-run.toml && kiln run my-run.toml"


def add_parser(subparsers) -> None:
    """Registers `recipes` and `init`."""
    subparsers.add_parser(
        "recipes", help="list the recipes shipped with Kiln (run one by name: kiln run tiny)", epilog=EPILOG_RECIPES
    )
    p = subparsers.add_parser(
        "init",
        help="copy a packaged recipe out for editing (never overwrites a file)",
        epilog="examples:\n  kiln init tiny                # writes ./tiny.toml\n  kiln init data-demo recipes/   # writes recipes/data-demo.toml",
    )
    p.add_argument("name", metavar="NAME", help="packaged recipe name (kiln recipes lists them)")
    p.add_argument("dest", metavar="DEST", nargs="?", help="file or folder to write (default: ./NAME.toml)")


def run(args: argparse.Namespace) -> int:
    if args.verb == "recipes":
        known = packaged_recipes()
        width = max(map(len, known), default=0)
        for name, path in known.items():
            print(f"{name:<{width}}  {summary(path)}")
        return 0
    target = init_recipe(args.name, args.dest)
    print(f"wrote {target}; run it with: kiln run {target}")
    return 0
