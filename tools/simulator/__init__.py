"""A discrete-event scheduling simulator: synchronous on-policy RL vs TBA's asynchronous loop.

Why: users ask how much faster asynchrony is on *their* cluster and where the time goes, before
they queue a 70B job. This package answers from per-role costs (stated, or measured by a CPU run)
with nothing but Python and numpy, so it imports without torch, MPI or a GPU.

Two schedules over the same hardware and costs:

- ``sync``: every step the generation engines produce one batch (B prompts x S samples) with the
  current weights, split evenly over the engines; then the learner trains on it; then the weights
  are synced. Generation and training never overlap; every trained sample has staleness 0.
- ``async`` (TBA): each searcher loops over rounds of ``prompts_per_round`` prompts; between rounds
  it applies the newest published weights if there are any (a stall of ``apply_s``). The learner
  takes a step whenever the buffer holds ``warm_start_samples`` (and, if ``replay_ratio`` > 0, it
  has not consumed more prompts than that ratio allows); every k steps it spends ``sync_s`` on the
  weight sync and publishes the new version at its end. Each batch slot takes, with probability m,
  a prompt refreshed since the latest sync (falling back to the sync window before), otherwise a
  uniform draw over every group generated so far. Staleness = learner version at the step - the
  policy version that generated the sample.

Roles are accounted in four states (generating, training, syncing, waiting) over the wall-clock
time to N updates (the end of step N and of the sync that follows it: the learner always syncs
after its last step, as `roles/learner.py` does), so the four fractions sum to 1 per role. The
modelling assumptions are in `config.ASSUMPTIONS` and printed beside every result by
`tools/simulate.py` (the command line; docs/SIMULATION.md explains the model and its results).

- `config.py`: `SimConfig` (costs and layout), the role states, the assumptions, JSON input.
- `schedules.py`: `simulate_sync`, `simulate_async`, `compare`, the searcher sweep, `SimResult`.
- `presets.py`: named layouts (`PRESETS`, `preset`).
- `calibration.py`: the sync / async ratio predicted from measured per-role costs.

It lives under tools/, outside the installed package: scripts there import it as `simulator`
(their directory is on sys.path), the tests through tests/conftest.py.
"""
