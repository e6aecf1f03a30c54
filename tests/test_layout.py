"""The repository's layout: the shared modules are the repo's own files (PyPI has unrelated packages named
`common` and `kernels`), the files the README promises exist, and CI runs the README's commands."""
import os
import subprocess
import sys
from pathlib import Path

import common
import kernels

ROOT = Path(__file__).resolve().parents[1]


def test_shared_modules_are_the_repos_own():
    assert Path(common.__file__).resolve() == ROOT / "common.py"
    assert Path(kernels.__file__).resolve() == ROOT / "kernels.py"


def test_repo_wins_over_installed_packages_of_the_same_names(tmp_path):
    """Put impostor `common` and `kernels` packages first on PYTHONPATH and run pytest from outside the repo
    (so the current directory does not help): pyproject's `pythonpath` must still make it import ours."""
    site = tmp_path / "site"
    for name in ("common", "kernels"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("IMPOSTOR = True\n")
    (tmp_path / "probe").mkdir()
    probe = tmp_path / "probe" / "test_probe.py"
    probe.write_text(
        "import common, kernels\n"
        "def test_probe():\n"
        f"    assert common.__file__ == {str(ROOT / 'common.py')!r}, common.__file__\n"
        f"    assert kernels.__file__ == {str(ROOT / 'kernels.py')!r}, kernels.__file__\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                        "-c", str(ROOT / "pyproject.toml"), str(probe)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_layout_and_ci_run_the_readme_commands():
    for f in ("README.md", "requirements.txt", "common.py", "kernels.py", "tests/conftest.py", ".ci/run"):
        assert (ROOT / f).is_file(), f
    assert os.access(ROOT / ".ci/run", os.X_OK)
    ci, readme = (ROOT / ".ci/run").read_text(), (ROOT / "README.md").read_text()
    for cmd in ("pip install -r requirements.txt", "python -m pytest"):
        assert cmd in ci and cmd in readme, cmd
    reqs = (ROOT / "requirements.txt").read_text()
    assert "torch==2.13.0" in reqs  # the CPU build on local disk; an unpinned torch pulls a CUDA build


def test_interpreter_version_rule():
    """Triton before 3.7 cannot run its interpreter with NumPy 2.4 or newer (conftest.interpreter_problem)."""
    from conftest import interpreter_problem

    assert "pip install 'numpy<2.4'" in interpreter_problem("3.6.0", "2.4.6")
    assert interpreter_problem("3.4.0", "2.5.0rc1")
    assert interpreter_problem("3.6.0", "2.3.5") is None
    assert interpreter_problem("3.7.1", "2.4.6") is None
    assert interpreter_problem("3.10.0", "2.4.6") is None
    assert interpreter_problem() is None  # the installed pair runs the suite


def test_old_triton_with_new_numpy_stops_the_suite_in_one_line(tmp_path):
    """A triton that reports 3.6.0 beside NumPy 2.4: pytest stops before collecting, with a usage error (exit 4)
    that names the fix, instead of failing every kernel test with the interpreter's TypeError."""
    fake = tmp_path / "site" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import numpy\nnumpy.__version__ = '2.4.6'\n__version__ = '3.6.0'\n")
    env = dict(os.environ, PYTHONPATH=str(fake.parent))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "triton 3.6.0's interpreter fails with numpy 2.4.6" in r.stderr and "Traceback" not in r.stderr, r.stderr
