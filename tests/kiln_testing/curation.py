"""Curation inputs and output readers shared by the executor tests (local, Ray, Slurm)."""

import json
from pathlib import Path


def make_inputs(root: Path, files: int = 4, docs: int = 20) -> list[Path]:
    """Documents with what each real step acts on: stray whitespace and control characters
    (normalize), texts repeated across files (exact_dedup), emails and phone numbers (pii)."""
    root.mkdir()
    paths = []
    for f in range(files):
        lines = []
        for d in range(docs):
            text = (
                f"Report number {d % 9}.\x07  Call (415) 555-{2600 + d % 9} or mail desk{d % 9}@example.org.  \n\n\n\n"
            )
            if d % 3 == 0:
                text += f"Unique note {f}-{d}."
            lines.append(json.dumps({"id": f"{f}-{d:02d}", "text": text, "source": "web", "meta": {}}))
        lines.append('{"id": "broken"')  # malformed: quarantined by the reader in both executors
        path = root / f"in-{f}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def read_folder(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(line) for line in p.open()] for p in sorted(folder.glob("*.jsonl"))}


def without_seconds(stats: dict) -> dict:
    return {
        **{k: v for k, v in stats.items() if k != "seconds"},
        "steps": [{k: v for k, v in s.items() if k != "seconds"} for s in stats["steps"]],
    }
