"""Warm starts: ``Worker.start(preload=...)`` and ``Pool.start(...)`` spawn, verify and import in
the background; a call made meanwhile waits for the start and runs on the warmed worker; a failed
start is the error a call would get, raised where the caller waits. Real workers throughout.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from concurrent.futures import wait
from pathlib import Path

import pytest

import comfy_env
from comfy_env import ArgumentError, CallTimeout, EnvBuildError, EnvError, WorkerCrashed

TESTS_DIR = Path(__file__).resolve().parent

pytestmark = pytest.mark.timeout(120)


def _module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(body))


@pytest.fixture
def mods(tmp_path: Path) -> Path:
    """A directory of modules the workers can import (on their ``sys_path``)."""
    directory = tmp_path / "mods"
    directory.mkdir()
    return directory


def _pool(mods: Path, **settings: object) -> comfy_env.Pool:
    return comfy_env.Pool(comfy_env.PoolConfig(sys_path=(str(mods),), **settings))


def test_a_call_made_during_a_start_waits_for_it_and_runs_on_the_warmed_worker(
    mods: Path, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    _module(
        mods,
        "slow_to_import",
        f"""
        import os, time
        MARKS = {str(marks)!r}
        with open(MARKS, "a") as fh:
            fh.write("import-began %d %r\\n" % (os.getpid(), time.time()))
        time.sleep(1.0)
        with open(MARKS, "a") as fh:
            fh.write("import-ended %d %r\\n" % (os.getpid(), time.time()))

        def where():
            with open(MARKS, "a") as fh:
                fh.write("called %d %r\\n" % (os.getpid(), time.time()))
            return os.getpid()
        """,
    )
    with _pool(mods) as pool:
        worker = pool.get_worker()
        started = worker.start(preload=("slow_to_import",))
        assert not started.done()  # returned at once, before the import (1 s) could end
        pid = worker.call("slow_to_import:where")  # made meanwhile: waits for the start
        assert started.result(timeout=60) is worker
        assert pid == worker.pid
        stats = worker.stats()
        assert stats.spawns == 1 and worker.generation == 1
    lines = [line.split() for line in marks.read_text().splitlines()]
    assert [kind for kind, _, _ in lines] == ["import-began", "import-ended", "called"]
    assert {int(p) for _, p, _ in lines} == {pid}  # one worker, the module imported once
    assert float(lines[2][2]) >= float(lines[1][2])  # the call ran after the import ended


def test_preloaded_modules_stay_imported_for_the_next_call(mods: Path, tmp_path: Path) -> None:
    count = tmp_path / "imports"
    _module(
        mods,
        "counted",
        f"""
        with open({str(count)!r}, "a") as fh:
            fh.write("x")

        def loaded():
            import sys
            return "counted" in sys.modules
        """,
    )
    with _pool(mods) as pool:
        worker = pool.get_worker()
        worker.start(preload=["json", "counted"]).result(timeout=60)
        assert worker.call("counted:loaded") is True
        assert worker.call("sys:modules.__contains__", "json") is True
    assert count.read_text() == "x"


def test_a_module_that_does_not_import_is_the_error_a_call_would_get(mods: Path) -> None:
    _module(mods, "broken_import", "raise ValueError('this module refuses to load')\n")
    with _pool(mods) as pool:
        worker = pool.get_worker()
        with pytest.raises(ModuleNotFoundError, match="comfy_env_no_such_module_q7"):
            worker.start(preload="comfy_env_no_such_module_q7").result(timeout=60)
        with pytest.raises(ValueError, match="refuses to load"):
            worker.start(preload="broken_import").result(timeout=60)
        # an import error is the env's code failing, not the worker: the same worker serves on
        assert worker.call("math:sqrt", 9.0) == 3.0
        assert worker.generation == 1


def test_a_start_whose_import_crashes_is_worker_crashed_and_the_next_call_gets_a_fresh_worker(
    mods: Path,
) -> None:
    _module(mods, "aborts_on_import", "import os\nos.abort()\n")
    with _pool(mods) as pool:
        worker = pool.get_worker()
        with pytest.raises(WorkerCrashed) as crashed:
            worker.start(preload="aborts_on_import").result(timeout=60)
        assert crashed.value.signal == "SIGABRT"
        assert "aborts_on_import.py" in crashed.value.stderr_tail
        assert worker.call("math:sqrt", 4.0) == 2.0
        assert worker.generation == 2


def test_a_start_past_its_deadline_is_call_timeout(mods: Path) -> None:
    _module(mods, "never_done", "import time\ntime.sleep(60)\n")
    with _pool(mods, kill_grace=0.5) as pool:
        worker = pool.get_worker()
        with pytest.raises(CallTimeout) as late:
            worker.start(preload="never_done", timeout=0.5).result(timeout=60)
        assert late.value.timeout == 0.5
        assert worker.call("math:sqrt", 16.0) == 4.0


def test_bad_preload_or_timeout_is_refused_before_anything_starts(mods: Path) -> None:
    with _pool(mods) as pool:
        worker = pool.get_worker()
        for preload in ([1], "not a module", ("ok", "bad-name"), 42):
            with pytest.raises(ArgumentError, match="preload"):
                worker.start(preload=preload)  # type: ignore[arg-type]
        for timeout in (-1, 0, float("inf"), "5"):
            with pytest.raises(ArgumentError, match="timeout"):
                worker.start(preload="json", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(EnvError):
            pool.start(str(mods / "no-such-env"), preload="json")
        assert worker.generation == 0  # nothing was spawned


def test_a_pool_starts_several_envs_side_by_side(
    mods: Path, tmp_path: Path, foreign_venv: Path
) -> None:
    # Each import waits for the other one to have begun: started one after the other, the first
    # would wait until its deadline and fail; side by side, both finish.
    here, there = tmp_path / "began-here", tmp_path / "began-there"
    for name, mine, other in (("meet_here", here, there), ("meet_there", there, here)):
        _module(
            mods,
            name,
            f"""
            import os, time
            open({str(mine)!r}, "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists({str(other)!r}):
                if time.monotonic() > deadline:
                    raise RuntimeError("the other env's start never began")
                time.sleep(0.01)
            """,
        )
    with _pool(mods) as pool:
        first = pool.start(None, preload="meet_here")
        second = pool.start(str(foreign_venv), preload="meet_there")
        both = first + second
        wait(both, timeout=90)
        workers = [start.result(timeout=0) for start in both]
        assert [w.env for w in workers] == [
            pool.get_worker().env,
            pool.get_worker(str(foreign_venv)).env,
        ]
        assert all(w.generation == 1 for w in workers)
        assert pool.start(preload=())[0].result(timeout=60).generation == 1  # already warm


def test_the_default_pool_starts_too(default_pool_cleanup: None) -> None:
    (started,) = comfy_env.start(preload="decimal")
    worker = started.result(timeout=60)
    assert worker.call("sys:modules.__contains__", "decimal") is True


def test_a_start_when_the_pool_closes_fails_with_pool_closed(mods: Path) -> None:
    _module(mods, "slow_import", "import time\ntime.sleep(30)\n")
    pool = _pool(mods, close_timeout=3.0, kill_grace=0.5)
    started = pool.get_worker().start(preload="slow_import")
    time.sleep(0.2)
    pool.close()
    with pytest.raises(comfy_env.PoolClosedError):
        started.result(timeout=60)
    with pytest.raises(comfy_env.PoolClosedError):
        pool.start(preload="json")


def _index_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _index_reachable(), reason="the package index is unreachable")
def test_a_recipe_is_built_on_the_start_s_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMFY_ENV_HOME", str(tmp_path / "home"))
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    with comfy_env.Pool() as pool:
        bad = comfy_env.Recipe(requirements=["comfy-env-test-no-such-project-zz9"], python=python)
        (failed,) = pool.start(bad, preload="json")  # returns before the build
        with pytest.raises(EnvBuildError, match="comfy-env-test-no-such-project-zz9"):
            failed.result(timeout=110)
        good = comfy_env.Recipe(requirements=["six==1.16.0"], python=python)
        (started,) = pool.start(good, preload="six")
        worker = started.result(timeout=110)
        assert worker.call("six:__version__.__str__") == "1.16.0"
        assert os.path.isdir(worker.env)


def test_the_preload_reply_warms_the_array_codec_only_where_both_ends_have_numpy(
    pool: comfy_env.Pool,
) -> None:
    np = pytest.importorskip("numpy")
    worker = pool.get_worker()
    warmed = worker.call("comfy_env_worker.tasks:preload", ["numpy"], True)
    assert isinstance(warmed, np.ndarray) and warmed.shape == (1,)
    # a host without numpy gets the names back (an array would import numpy in the host)
    assert worker.call("comfy_env_worker.tasks:preload", ["json"], False) == ["json"]
