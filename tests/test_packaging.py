"""The built wheel is what `pip install .` gives a user: every subpackage in it, importable and
runnable from outside the source checkout (an editable install would hide a missing package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# each builds or installs the package (a build in an isolated environment: setuptools, cffi)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source tree as a clean clone has it: no build/ folder left by an earlier
    build (it would supply packages the configuration omits), no compiled C core."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = source
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    if r.returncode and "install build dependencies" in r.stderr and any(
        w in r.stderr for w in ("NewConnectionError", "Could not find a version", "No matching distribution")
    ):
        # the isolated build environment comes from the package index: none reachable here
        pytest.skip(f"no package index to build the wheel's build environment from: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("aiote-*.whl")
    return whl


def test_wheel_holds_every_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "aiote").rglob("__init__.py")
        if "__pycache__" not in p.parts
    )
    assert "aiote/kv" in packages
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"subpackages left out of the wheel: {missing}"
    assert "aiote/py.typed" in names
    assert any(n.startswith("aiote/_native/_core") and n.endswith(".so") for n in names), (
        "the compiled C core is not in the wheel"
    )
    # the C core's and the C bench's sources, for aiote bench's C baseline: every file of the core
    core = sorted(p.name for p in (ROOT / "cdeps" / "core").glob("*.[ch]"))
    assert "internal.h" in core and "engine.c" in core
    bench = sorted(p.name for p in (ROOT / "cdeps" / "bench").glob("*.[ch]"))
    assert "aiote_cbench.c" in bench and "cbench.h" in bench
    for src in ("aiote_core.h", *(f"core/{n}" for n in core), *(f"bench/{n}" for n in bench)):
        assert f"aiote/_native/csrc/{src}" in names


def _installed(wheel: Path, tmp_path: Path) -> dict[str, str]:
    """The wheel unpacked in ``tmp_path/site``: the environment that imports aiote from there."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S (see the callers): without the site module, so the editable install's import hook (a
    # .pth file) cannot serve aiote's subpackages from the checkout; the dependencies come from
    # site-packages, after the wheel's files
    deps = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    path = os.pathsep.join([str(site), *deps])
    return dict(os.environ, PYTHONPATH=path, XDG_CACHE_HOME=str(tmp_path / "cache"))


def test_wheel_imports_and_runs_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    env = _installed(wheel, tmp_path)
    site = tmp_path / "site"
    code = (
        "import aiote, aiote.kv, aiote.cli, aiote.testing;"
        f"assert aiote.__file__.startswith({str(site)!r}), aiote.__file__;"
        "print(sorted(aiote.__all__)[:3])"
    )
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-S", "-m", "aiote", "info", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"providers"' in r.stdout


def test_installed_bench_builds_its_c_baseline_from_the_shipped_sources(wheel: Path, tmp_path: Path) -> None:
    env = _installed(wheel, tmp_path)
    r = subprocess.run(
        [sys.executable, "-S", "-m", "aiote", "bench", "write", "--sizes", "64KiB", "--total", "8MiB",
         "--repeats", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["c_baseline"] is True, r.stderr[-2000:]
    (row,) = result["rows"]
    assert row["c_gbps"] > 0 and row["py_gbps"] > 0
    built = list((tmp_path / "cache" / "aiote").glob("aiote_cbench-*"))
    assert len(built) == 1 and os.access(built[0], os.X_OK)  # compiled once, into the user's cache


def test_installed_bench_run_inside_a_checkout_spawns_the_installed_aiote(
    wheel: Path, source: Path, tmp_path: Path
) -> None:
    """A new user's first run: ``pip install .`` (not editable) in a checkout, then ``aiote bench
    write`` from inside it. The bench's other side is a child process; started as ``python -m
    aiote`` from the checkout it imported the unbuilt sources there ("aiote's C core is not
    built") instead of the installed package."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # aiote's dependencies from this test's environment, after the venv's own site-packages
    # (a path line in a .pth file: the editable install's hooks there are not run)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    deps = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (Path(site) / "aiote-test-deps.pth").write_text("\n".join(deps) + "\n")
    assert not (source / "aiote" / "_native" / "_core.abi3.so").exists()  # the checkout is unbuilt
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["CC"] = "false"  # no C baseline (its compile is another test's): the run is about the child
    r = subprocess.run(
        [str(venv / "bin" / "aiote"), "bench", "write", "--sizes", "64KiB", "--total", "4MiB",
         "--repeats", "1"],
        cwd=source, env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["mode"] == "write" and row["py_gbps"] > 0


def test_children_import_the_aiote_this_process_imported(tmp_path: Path) -> None:
    import aiote
    from aiote._spawn import child_env, python_module

    home = str(Path(aiote.__file__).resolve().parent.parent)
    env = child_env({"PYTHONPATH": os.pathsep.join(["/elsewhere", home]), "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [home, "/elsewhere"] and env["X"] == "1"
    # run from a directory that holds another aiote (broken), the child imports this one
    (tmp_path / "aiote").mkdir()
    (tmp_path / "aiote" / "__init__.py").write_text("raise ImportError('the wrong aiote')\n")
    r = subprocess.run(python_module("aiote", "--help"), cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "bench" in r.stdout, r.stderr[-2000:]


def test_import_aiote_costs_only_the_core_and_the_flows_come_on_first_use() -> None:
    """``import aiote`` loads the core, not the flows; ``aiote.kv`` / ``aiote.moe`` /
    ``aiote.weights`` import their subpackage on first access (and ``import aiote.kv`` as
    ever), so a process that only moves bytes does not pay for them at start."""
    code = (
        "import sys, aiote\n"
        "flows = ('aiote.kv', 'aiote.moe', 'aiote.weights', 'aiote.membership')\n"
        "assert not [m for m in flows if m in sys.modules], sorted(m for m in sys.modules if m in flows)\n"
        "assert aiote.kv.PrefillServer and aiote.weights.WeightSender and aiote.moe.AllToAll\n"
        "assert all(m in sys.modules for m in flows[:3])\n"
        "from aiote import kv, moe, weights\n"
        "assert kv is aiote.kv and weights is sys.modules['aiote.weights']\n"
        "try:\n"
        "    aiote.nonesuch\n"
        "except AttributeError as exc:\n"
        "    assert 'nonesuch' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
