"""Frontier installed like any tool: a built wheel in a fresh venv, run from an unrelated directory."""
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA, DATA_CACHE, ROOT, SHARED

# one worker builds this module's fixtures once (a venv with the wheel installed): pytest-xdist --dist loadgroup
pytestmark = pytest.mark.xdist_group("test_install")

# conftest.FAST's data settings and the suite's data cache: the wheel reads the data as the other tests do,
# rather than tokenizing the shards once more
SMALL = ["model=tiny", "precision=fp32", "data.vocab_size=1024", "data.tokenizer_train_chars=2000000", DATA_CACHE,
         "eval.checkpoint_tokens=2048", "eval.final_tokens=4096", "budget.max_steps=2"]


def outer_site_packages() -> list[str]:
    """The folders this interpreter imports installed packages from, in a venv or outside one."""
    found = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    return [path for path in dict.fromkeys(found) if os.path.isdir(path)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv that sees the packages of the environment running the tests (torch, Hydra, ...) but holds
    Frontier only as a wheel. A .pth file lists that environment's site-packages folders: they come
    after the venv's own, so the wheel's frontier wins over an installed or editable one, and their own
    .pth files (an editable install's import hook among them) are not run."""
    if not (SHARED / "data").is_dir():
        pytest.skip(f"shared data not found at {SHARED / 'data'}")
    outer = outer_site_packages()
    if not outer:
        pytest.skip(f"{sys.executable} has no site-packages folder for the wheel's venv to share")
    tmp = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
    python = str(tmp / "venv" / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    wheel = next((tmp / "dist").glob("frontier-*.whl"))
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True)
    # only now: pip, seeing a regular install of frontier through it, would keep that one
    (Path(own) / "outer-environment.pth").write_text("".join(f"{path}\n" for path in outer))
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FRONTIER_HOME", "FRONTIER_DATA")}
    env.update(FRONTIER_HOME=str(tmp / "home"), FRONTIER_DATA=str(DATA), PATH=f"{tmp / 'venv' / 'bin'}:{env['PATH']}")
    return tmp, elsewhere, env


def run(installed, *args, timeout=600):
    tmp, elsewhere, env = installed
    return subprocess.run(list(args), cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_wheel_runs_from_its_own_files(installed):
    tmp = installed[0]
    done = run(installed, "python", "-c", "import frontier; print(frontier.__file__)")
    assert done.returncode == 0 and str(tmp / "venv") in done.stdout, done.stdout + done.stderr

    done = run(installed, "frontier-train", "model=tiny", "--cfg", "job", "--resolve")
    assert done.returncode == 0, done.stderr
    data = DATA.resolve()  # FRONTIER_DATA is resolved, links included
    assert f"path: {data}/text/wiki_en" in done.stdout
    assert f"core_bundle: {data}/core" in done.stdout and "depth: 4" in done.stdout

    done = run(installed, "frontier-train", *SMALL)
    assert done.returncode == 0, done.stderr
    summaries = list((tmp / "home" / "outputs").glob("*/*/summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["status"] == "FINISHED"
    assert (tmp / "home" / "mlruns" / "mlflow.db").is_file()  # the store under FRONTIER_HOME, not the cwd
    assert not any(installed[1].iterdir())  # nothing written where the command ran


@pytest.mark.slow
def test_user_presets_from_a_directory_of_their_own(installed):
    tmp = installed[0]
    mine = tmp / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "sweep").mkdir()
    (mine / "model" / "mini.yaml").write_text("defaults:\n  - tiny\n  - _self_\nname: mini\nd_model: 64\nn_head: 2\n")
    (mine / "sweep" / "mine.yaml").write_text(
        "name: mine\nn_trials: 1\npruner: none\nparams:\n  optim.matrix_lr: tag(log, interval(0.01, 0.05))\n")
    done = run(installed, "frontier-train", f"hydra.searchpath=[file://{mine}]", "model=mini", "--cfg", "job")
    assert done.returncode == 0 and "d_model: 64" in done.stdout, done.stderr

    sweep_dir = tmp / "sweep"
    done = run(installed, "frontier-train", "--multirun", f"hydra.searchpath=[file://{mine}]", "sweep=mine",
               "model=mini", *SMALL[1:], "tracking.enabled=false", f"hydra.sweep.dir={sweep_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["params"] > 0
    assert (tmp / "home" / "mlruns" / "sweeps" / "mine.journal").is_file()


def test_the_checkout_runs_from_any_directory(tmp_path):
    """Outside the checkout the primary config's sweeper is found, under an editable install (whose
    import hook Hydra's plugin listing does not see) or a regular one. A regular install does not know
    the checkout, so the data is given, as a user outside it gives it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(FRONTIER_DATA=str(DATA), FRONTIER_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-m", "frontier.train", "model=tiny", "--cfg", "hydra"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "_target_: hydra_plugins.frontier_sweeper.frontier_sweeper.FrontierSweeper" in done.stdout


def test_ci_runs_readme_install_and_test_commands():
    """.ci/run takes both commands from README.md (the block after each `<!-- ci: ... -->` marker), so
    CI installs and tests exactly as README tells a new user to; the CPU torch wheel comes first."""
    done = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['install: pip install torch==2.13.0 && pip install ".[test]"',
                                        "test: python -m pytest -q"]


def test_ci_stops_when_readme_loses_a_command(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    readme = (ROOT / "README.md").read_text()
    (tmp_path / "README.md").write_text(readme.replace("<!-- ci: test -->", ""))
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run"), "--print"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.startswith("error: .ci/run cannot take the test command from README.md"), done.stderr


def test_the_installed_pytest_xdist_keeps_an_xdist_group_on_one_worker(tmp_path):
    """The suite's addopts (-n 3 --dist loadgroup) keep a module whose fixtures are costly on one worker,
    which builds them once; some pytest and pytest-xdist releases together ignore the mark, silently."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(
        "import os\nfrom pathlib import Path\n\nimport pytest\n\npytestmark = pytest.mark.xdist_group('costly')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_one(i):\n"
        "    (Path(os.environ['RAN']) / str(i)).write_text(os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "ran").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["RAN"] = str(tmp_path / "ran")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", "test_grouped.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = [path.read_text() for path in (tmp_path / "ran").iterdir()]
    assert len(workers) == 6 and len(set(workers)) == 1, workers
