"""Custom lm-evaluation-harness tasks over local JSONL, for the tests that score one model through
lm-eval and through Kiln (or `kiln serve`) and compare."""

from __future__ import annotations

import json
from pathlib import Path


def write_lm_eval_tasks(data: Path, prefix: str, pairs, texts) -> tuple[list[str], list[dict]]:
    """Three task YAMLs and their data in `data` (no network): {prefix}_mc, multiple choice with acc
    and acc_norm over "What is a plus b?" for each (a, b) in `pairs`; {prefix}_ppl, rolling
    perplexity over `texts`; {prefix}_gen, greedy generation of the right choice until a blank line
    or "Question:" (12 tokens at most), scored by exact_match. Returns the task names (for
    TaskManager(include_path=data)) and the multiple-choice rows."""
    rows = [
        {
            "question": f"What is {a} plus {b}?",
            "choices": [str(a + b), str(a * b), str(a - b), "none of these"],
            "answer": i % 4,
        }
        for i, (a, b) in enumerate(pairs)
    ]
    data.mkdir(parents=True, exist_ok=True)
    (data / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}/FILE\ntest_split: test\n"
    (data / f"{prefix}_mc.yaml").write_text(
        f"task: {prefix}_mc\n" + common.replace("FILE", "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (data / f"{prefix}_ppl.yaml").write_text(
        f"task: {prefix}_ppl\n" + common.replace("FILE", "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (data / f"{prefix}_gen.yaml").write_text(
        f"task: {prefix}_gen\n" + common.replace("FILE", "mc.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n", "Question:"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return [f"{prefix}_mc", f"{prefix}_ppl", f"{prefix}_gen"], rows
