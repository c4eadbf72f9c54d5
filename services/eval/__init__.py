"""spade eval: held-out suites scored by their own scorers (see docs/eval.md)."""
