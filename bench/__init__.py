"""Benchmarks of the stages against their references (README: Benchmarks), run as scripts (bench_*.py);
`timing` and `upstream/` (upstream speculators' trainer, the reference of 04's) serve them."""
