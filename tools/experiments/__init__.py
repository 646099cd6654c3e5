"""Learning-fidelity experiments (issue #10): does each objective do on this system what its paper
says it does?

    python tools/experiments/run.py topr --seeds 3 --jobs 2     # one experiment
    python tools/experiments/run.py all                          # every experiment, then docs/RESULTS.md

- `runner.py`: the generic machinery. An `Experiment` is a list of `Arm`s (named lists of
  `hpc-tba train` overrides) run over seeds, each run in its own directory; per-run metrics are
  collected from the run's files, aggregated to mean ± std over seeds, and written to
  `docs/results/<experiment>.json`.
- `aggregate.py`: one run's metrics and curves from its files, and their mean ± std over seeds.
- `definitions.py`: the experiments themselves (add one there).
- `offline.py`: the data sets of the offline experiments (TOPR, A-LoL), drawn from the starting model.
- `report.py`: renders `docs/RESULTS.md` and its plots from every `docs/results/*.json`.
"""
