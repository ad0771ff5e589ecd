"""Upstream speculators 0.9.0's own trainer, the reference of bench/bench_04_recipe.py's upstream-*
rows and of bench/bench_04_train.py: adapters, not benchmarks.

- `adapter`: 02's hidden states and 03's vocabulary in upstream's layout, its trainer run in
  `.venv-speculators/`, and its checkpoint exported as a 04 draft (imported by the benchmarks).
- `train.py`: the script that environment runs (never imported by the project).

No module here is named after a package that environment imports (`speculators`, `torch`, ...):
`train.py` runs as a script, with this folder first on its `sys.path`.
"""
