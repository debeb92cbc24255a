"""Where `kiln run` keeps its stage folders: `run.out_dir/<name>/<stage>` on local disk, or under an
fsspec URL (`run.out_dir = "s3://bucket/prefix"`).

With a remote out_dir every stage still runs into a local folder, its **staging copy** under the
cache (`storage.cache_path` of the remote run folder), and when it finishes the whole folder is
published to the store with its DONE marker uploaded last (storage.publish_folder): an upload cut
short leaves a folder without DONE, which the next run takes for unfinished. Checkpoints of the
training stages do not go through the staging copy: the trainer writes them straight to
`<remote stage>/checkpoints` (RemoteCheckpointManager, manifest last), so a killed run resumes from
the store. A later stage reads an earlier stage's files from the staging copy, downloaded again when
its DONE differs from the published one. A changed training stage is copied to
`<stage>.previous-N` on the store (markers last) before the original is removed (markers first), so
no earlier output is lost. docs/storage.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kiln import storage
from kiln.checkpoint.format import MANIFEST_FILE
from kiln.errors import ConfigError
from kiln.recipe import Recipe

MARKER = "DONE"
CHECKPOINTS = "checkpoints"  # a training stage's checkpoints, published by the checkpoint manager
# The stages that run with a remote out_dir; the post-training stages keep their folders on local disk.
REMOTE_STAGES = ("corpus", "data", "tokenizer", "pack", "pretrain", "sample")


def remote_run(recipe: Recipe) -> str | None:
    """The run folder's URL when run.out_dir is remote, else None."""
    out = recipe.run.out_dir
    return storage.join(out, recipe.run.name) if storage.is_remote(out) else None


def local_run_dir(recipe: Recipe) -> Path:
    """The folder the stages run in: the run folder itself, or the staging copy of a remote one."""
    url = remote_run(recipe)
    return storage.cache_path(url) if url else Path(recipe.run.out_dir) / recipe.run.name


def published(recipe: Recipe, stage: str):
    """Where the stage's finished folder lives: its URL on the store, or its local folder."""
    url = remote_run(recipe)
    return storage.join(url, stage) if url else local_run_dir(recipe) / stage


def check_stages(recipe: Recipe, stages) -> None:
    """Refuse, before anything runs, what a remote out_dir cannot hold."""
    url = remote_run(recipe)
    if url is None:
        return
    for stage in stages:
        if stage not in REMOTE_STAGES:
            raise ConfigError(
                "run.out_dir",
                f"{url}: the {stage} stage writes its folders to local disk only; "
                f"with an s3:// out_dir a run holds {', '.join(REMOTE_STAGES)}",
            )
    if "data" in stages and recipe.data.executor == "slurm":
        raise ConfigError(
            "run.out_dir",
            f'{url}: the data stage on data.executor = "slurm" keeps its task folders on the shared disk; '
            "use a local run.out_dir for it",
        )


def read_marker(recipe: Recipe, stage: str) -> str | None:
    """The text of the stage's published DONE marker, None when there is none."""
    path = storage.join(published(recipe, stage), MARKER)
    try:
        return storage.read_text(path)
    except (FileNotFoundError, IsADirectoryError):
        return None


def stage_exists(recipe: Recipe, stage: str) -> bool:
    local = local_run_dir(recipe) / stage
    return local.exists() or (remote_run(recipe) is not None and storage.exists(published(recipe, stage)))


def publish_stage(recipe: Recipe, stage: str) -> None:
    """Upload a finished stage's staging copy, DONE last (its checkpoints are on the store already)."""
    if remote_run(recipe) is None:
        return
    local = local_run_dir(recipe) / stage
    names = [
        rel
        for rel in (p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        if rel.split("/", 1)[0] != CHECKPOINTS
    ]
    storage.publish_folder(local, published(recipe, stage), MARKER, names)


def fetch_stage(recipe: Recipe, stage: str) -> Path:
    """The stage's local folder, downloaded from the store when its DONE is not the published one."""
    local = local_run_dir(recipe) / stage
    url = remote_run(recipe)
    if url is None:
        return local
    remote_marker = read_marker(recipe, stage)
    if remote_marker is None or ((local / MARKER).is_file() and (local / MARKER).read_text() == remote_marker):
        return local
    folder = published(recipe, stage)
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{stage}-", dir=local.parent))
    try:
        for file in storage.walk_files(folder):
            rel = file[len(folder) + 1 :]
            if rel.split("/", 1)[0] != CHECKPOINTS:
                storage.download(file, staging / rel)
        shutil.rmtree(local, ignore_errors=True)
        os.replace(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def unpublish(recipe: Recipe, stage: str) -> None:
    """Remove the stage's DONE (remote first), so it reads as unfinished; its files stay."""
    if remote_run(recipe) is not None:
        storage.remove(storage.join(published(recipe, stage), MARKER))
    (local_run_dir(recipe) / stage / MARKER).unlink(missing_ok=True)


def remove_stage(recipe: Recipe, stage: str) -> None:
    """Delete a stale or partial stage: on the store DONE first, so a delete cut short is unfinished."""
    if remote_run(recipe) is not None:
        unpublish(recipe, stage)
        storage.remove(published(recipe, stage), recursive=True)
    shutil.rmtree(local_run_dir(recipe) / stage, ignore_errors=True)


def move_to_previous(recipe: Recipe, stage: str):
    """Keep a stage's earlier output as `<stage>.previous-N` and empty `<stage>`; returns where it went."""
    folder = published(recipe, stage)
    n = 1
    while storage.exists(previous := storage.join(storage.parent_of(folder), f"{stage}.previous-{n}")):
        n += 1
    if remote_run(recipe) is None:
        Path(folder).rename(previous)
        return previous
    # No rename on an object store: copy (each folder's marker after its files, DONE last), then
    # delete the original (DONE and manifests first). A kill between the two leaves both copies.
    fs = storage.filesystem(folder)
    files = [file[len(folder) + 1 :] for file in storage.walk_files(folder)]
    for rel in sorted(files, key=lambda rel: (rel == MARKER, storage.name_of(rel) == MANIFEST_FILE)):
        fs.copy(storage.join(folder, rel), storage.join(previous, rel))
    unpublish(recipe, stage)
    for rel in files:
        if storage.name_of(rel) == MANIFEST_FILE:
            storage.remove(storage.join(folder, rel))
    storage.remove(folder, recursive=True)
    shutil.rmtree(local_run_dir(recipe) / stage, ignore_errors=True)
    return previous


def write_recipe(recipe: Recipe, text: str) -> None:
    """The run folder's recipe.json on the store (the local copy is written by the pipeline)."""
    url = remote_run(recipe)
    if url is not None:
        storage.write_bytes(storage.join(url, "recipe.json"), text.encode())
