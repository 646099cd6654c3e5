"""Bad input gets one clear line naming the problem, before any process is started."""
import subprocess

import pytest
from conftest import HPC_TBA


def _run(*args, tmp_path):
    proc = subprocess.run([HPC_TBA, "train", *args, f"run_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return proc.returncode, lines


@pytest.mark.parametrize("args, needle", [
    (["learner.nonsense=1"], "unknown config key 'learner.nonsense'"),
    (["+learner.nonsense=1"], "unknown config key 'learner.nonsense'"),
    (["learner.lr=fast"], "learner.lr"),
    (["algo=nope"], "algo/nope"),
    (["cluster.num_searchers=0"], "no searcher"),
    (["cluster.num_learners=0"], "cluster.num_learners"),
    (["cluster.mpiexec=no-such-mpiexec"], "MPI launcher 'no-such-mpiexec' not found"),
    (["model.path=/nonexistent/model"], "/nonexistent/model"),
])
def test_bad_input_is_one_clear_line(args, needle, tmp_path):
    code, lines = _run(*args, tmp_path=tmp_path)
    assert code != 0
    assert len(lines) == 1, lines
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
