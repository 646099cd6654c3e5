"""A rank's terminal shows our lines; everything else it (or C code, or a child) writes is in its log."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from hpc_tba.launcher import console

NOISY_RANK = textwrap.dedent("""
    import os, subprocess, sys, warnings
    from hpc_tba.launcher.console import say, setup_rank_output
    run_dir, verbose = sys.argv[1], sys.argv[2] == "1"
    path = setup_rank_output(run_dir, 3, verbose=verbose)
    print("third-party stdout line")
    print("hpc-tba: our line on stderr", file=sys.stderr)
    warnings.warn("a dependency's FutureWarning")
    os.write(1, b"C library on fd 1\\n")
    os.write(2, b"C library on fd 2\\n")
    subprocess.run([sys.executable, "-c", "print('child process line')"], check=True)
    say("hpc-tba: said on the terminal", stream="out")
    import logging
    logging.basicConfig()
    logging.getLogger("vllm").warning("a logger created after the redirect")
    sys.stdout.flush(); sys.stderr.flush()
    print(path, file=open(os.path.join(run_dir, "path.txt"), "w"))
""")

THIRD_PARTY = ["third-party stdout line", "a dependency's FutureWarning", "C library on fd 1",
               "C library on fd 2", "child process line", "a logger created after the redirect"]
OURS = ["hpc-tba: our line on stderr", "hpc-tba: said on the terminal"]


def _rank(tmp_path, verbose: bool):
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", NOISY_RANK, str(tmp_path), "1" if verbose else "0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "rank3.log").read_text()
    assert (tmp_path / "path.txt").read_text().strip() == str(tmp_path / "logs" / "rank3.log")
    return proc.stdout + proc.stderr, log


def test_quiet_rank_terminal_has_only_our_lines_and_the_log_has_everything(tmp_path):
    terminal, log = _rank(tmp_path, verbose=False)
    assert sorted(line for line in terminal.splitlines() if line) == sorted(OURS)
    for text in THIRD_PARTY + OURS[:1]:
        assert text in log, text
    assert log.startswith("=== rank 3 pid ")


def test_verbose_rank_shows_everything_live_and_still_logs_it(tmp_path):
    terminal, log = _rank(tmp_path, verbose=True)
    for text in THIRD_PARTY + OURS:
        assert text in terminal, text
    for text in THIRD_PARTY + OURS[:1]:
        assert text in log, text


def test_captured_block_restores_the_terminal(tmp_path, capfd):
    with console.captured(str(tmp_path / "logs" / "launcher.log")):
        os.write(2, b"noise from a build\n")
        print("hpc-tba: a line of ours", file=sys.stderr)
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err
    assert "noise from a build" not in err and "hpc-tba: a line of ours" in err and "after the block" in err
    assert "noise from a build" in (tmp_path / "logs" / "launcher.log").read_text()


def test_first_failure_is_claimed_once_and_reported_first(tmp_path):
    assert console.record_failure(str(tmp_path), 2, "OSError: engine could not load")
    assert not console.record_failure(str(tmp_path), 0, "ValueError: config.json is broken")
    records = console.failures(str(tmp_path))
    assert [r["rank"] for r in records] == [2, 0]
    line = console.failure_line(records)
    assert line.startswith("hpc-tba: rank 2 failed: OSError: engine could not load")
    assert str(tmp_path / "logs" / "rank2.log") in line and "ranks 0 failed too" in line
    assert json.loads((tmp_path / "logs" / "failed_rank0.json").read_text())["rank"] == 0


def test_failure_line_keeps_a_multiline_message_whole_on_one_line(tmp_path):
    console.record_failure(str(tmp_path), 1, "RuntimeError: first part\n  second part of the message")
    line = console.failure_line(console.failures(str(tmp_path)))
    assert "\n" not in line and "first part second part of the message" in line


@pytest.mark.parametrize("env, rank", [({"PMI_RANK": "4"}, 4), ({"SLURM_PROCID": "7"}, 7), ({}, 0)])
def test_rank_from_environ(env, rank):
    assert console.rank_from_environ(env) == rank


def test_bytes_written_to_the_buffer_reach_the_log(tmp_path):
    code = ("import sys; from hpc_tba.launcher.console import setup_rank_output; setup_rank_output(sys.argv[1], 0);"
            "sys.stdout.buffer.write(b'raw bytes\\n'); sys.stdout.buffer.flush()")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    assert "raw bytes" in (tmp_path / "logs" / "rank0.log").read_text()
