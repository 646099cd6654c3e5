"""Assembly (layer 5, docs/ARCHITECTURE.md): everything that composes the parts into a run.

The rank set-up (`rank.py`: transport, topology, placement check, device and core pinning,
preemption signals), building the role a rank plays from the config (`build.py`), and building
a generation engine for a searcher or for `hpc-tba eval` (`engines.py`), and running every rank
of a run as a thread of one process for debugging (`inprocess.py`). Assembly imports the
roles, engines, comm and launcher plumbing; none of those imports the assembly.
"""
