"""Evaluation: lm-evaluation-harness style task types and metrics (`harness`), loaders for the public
benchmark files and Kiln's own task sets (`tasks`), the code-execution sandbox (`sandbox`) and the
`kiln eval` command (`cli`). See docs/eval.md."""
