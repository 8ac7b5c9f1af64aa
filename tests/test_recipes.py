"""Declared envs: a recipe is built once with uv, locked with hashes, published atomically,
shared safely between processes, and collected when unused.

Real builds from the package index (tiny pure-Python packages; uv's own cache, shared by every
test and run, makes repeats fast); skipped when the index cannot be reached. Each test has its
own env root (``COMFY_ENV_HOME`` under ``tmp_path``). A second index is served on 127.0.0.1 by
the tests themselves, with a wheel written by hand.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

import comfy_env
from comfy_env import _build, _envstore

pytestmark = pytest.mark.timeout(120)


def _index_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


needs_index = pytest.mark.skipif(not _index_reachable(), reason="the package index is unreachable")


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("COMFY_ENV_HOME", str(root))
    return root


def _version_in(env: Path, module: str) -> str:
    out = subprocess.run(
        [
            str(env / "bin" / "python"),
            "-c",
            f"import importlib.metadata as m; print(m.version({module!r}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


# ---- a second index on 127.0.0.1 -----------------------------------------------------------


def make_wheel(name: str, version: str, body: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel, written by hand: (file name, bytes)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": body.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: comfy-env-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return f"{dist}-{version}-py3-none-any.whl", buffer.getvalue()


class SecondIndex:
    """A PEP 503 simple index on 127.0.0.1, in a thread: ``add(page, wheel)`` publishes a
    wheel on ``<url><page>/``; ``slow`` makes wheel downloads wait until ``release()``."""

    def __init__(self) -> None:
        self.pages: dict[str, dict[str, bytes]] = {}
        self.slow: set[str] = set()
        self.missing: set[str] = set()  # listed on its page, but 404 when fetched
        self.requested = threading.Event()
        self._release = threading.Event()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                parts = [p for p in self.path.split("?")[0].split("/") if p]
                if len(parts) == 2 and parts[0] == "simple" and parts[1] in index.pages:
                    links = "".join(
                        f'<a href="{f}#sha256={hashlib.sha256(d).hexdigest()}">{f}</a>\n'
                        for f, d in index.pages[parts[1]].items()
                    )
                    self._send(f"<html><body>{links}</body></html>".encode(), "text/html", head)
                    return
                if len(parts) == 3 and parts[1] in index.pages:
                    data = index.pages[parts[1]].get(parts[2])
                    if data is not None and parts[2] not in index.missing:
                        if parts[2] in index.slow and not head:
                            index.requested.set()
                            index._release.wait(60)
                        self._send(data, "application/octet-stream", head)
                        return
                self.send_error(404)

            def _send(self, data: bytes, kind: str, head: bool = False) -> None:
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                except OSError:  # the client went away (killed)
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # server_close() joins the handler threads
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        self.thread = threading.Thread(target=self.server.serve_forever, name="second-index")
        self.thread.start()

    def add(self, page: str, wheel: tuple[str, bytes]) -> None:
        self.pages.setdefault(page, {})[wheel[0]] = wheel[1]

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def second_index() -> Iterator[SecondIndex]:
    index = SecondIndex()
    try:
        yield index
    finally:
        index.close()


def _unique(prefix: str) -> str:
    # A name no other run has put into uv's shared cache (a cached wheel is not downloaded).
    return f"{prefix}-{secrets.token_hex(4)}"


# ---- recipes ---------------------------------------------------------------------------------


def test_recipe_is_a_value_and_its_key_covers_pins_indexes_and_python() -> None:
    probe = {"implementation": "cpython", "version": "3.12.1", "platform": "linux", "machine": "x"}
    a = comfy_env.Recipe(["six==1.16.0", "idna"])
    assert a == comfy_env.Recipe(["idna", "six == 1.16.0"])  # order and spaces do not matter
    assert a.key(probe) == comfy_env.Recipe(["idna", "six == 1.16.0"]).key(probe)
    assert a.key(probe) != comfy_env.Recipe(["six==1.15.0", "idna"]).key(probe)
    assert a.key(probe) != comfy_env.Recipe(a.requirements, extra_index_urls=["http://x"]).key(
        probe
    )
    assert a.key(probe) != a.key({**probe, "version": "3.11.7"})
    assert a.key(probe) != a.key({**probe, "implementation": "pypy"})


def test_bad_recipes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(comfy_env.EnvBuildError, match="nothing to build"):
        comfy_env.Recipe([])
    with pytest.raises(comfy_env.EnvBuildError, match="python"):
        comfy_env.Recipe(["six"], python="three")
    with pytest.raises(comfy_env.EnvBuildError, match="list of strings"):
        comfy_env.Recipe("six")  # type: ignore[arg-type]
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\ndependencies = ["six"]\n'
        '[tool.comfy.isolation]\npackage_manager = "conda"\n'
    )
    with pytest.raises(comfy_env.EnvBuildError, match='package_manager = "conda"') as info:
        comfy_env.Recipe.from_pyproject(tmp_path)
    assert "env=" in str(info.value)  # says what to do instead
    assert isinstance(info.value, comfy_env.EnvError)


def test_a_manifest_key_comfy_env_does_not_use_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\ndependencies = ["six"]\n'
        '[tool.comfy.isolation]\npackage_manager = "uv"\nshare_torch = true\n'
    )
    recipe = comfy_env.Recipe.from_pyproject(tmp_path / "pyproject.toml")
    assert recipe.requirements == ("six",) and recipe.name == "p"
    (warning,) = [r for r in caplog.records if r.name == "comfy_env.build"]
    assert "share_torch" in warning.getMessage() and "package_manager" in warning.getMessage()


def test_a_missing_python_is_a_clear_error() -> None:
    with pytest.raises(comfy_env.EnvBuildError, match=r"no installed Python 3\.99") as info:
        comfy_env.build_env(comfy_env.Recipe(["six"], python="3.99"))
    assert info.value.stage == "find-python"


@needs_index
def test_two_envs_differing_by_one_pin_are_two_envs(home: Path) -> None:
    new = comfy_env.build_env(comfy_env.Recipe(["six==1.16.0"]))
    old = comfy_env.build_env(comfy_env.Recipe(["six==1.15.0"]))
    assert new != old and new.parent == old.parent == home / "envs"
    assert _version_in(new, "six") == "1.16.0"
    assert _version_in(old, "six") == "1.15.0"
    lock = (new / "env.lock").read_text()
    assert "six==1.16.0" in lock and "--hash=sha256:" in lock
    # Built once: the second ask is the published env, untouched.
    record = (new / "comfy-env-env.json").stat().st_mtime_ns
    assert comfy_env.build_env(comfy_env.Recipe(["six==1.16.0"])) == new
    assert (new / "comfy-env-env.json").stat().st_mtime_ns == record
    assert not [p for p in os.listdir(home / "envs") if ".tmp-" in p]


@needs_index
def test_a_recipe_is_accepted_wherever_an_env_is(config: comfy_env.PoolConfig) -> None:
    recipe = comfy_env.Recipe(["six==1.16.0"])
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker(recipe)
        assert worker.call("importlib.metadata:version", "six") == "1.16.0"
        assert worker.env == str(comfy_env.build_env(recipe))
        assert comfy_env.resolve_env(recipe).key == worker.env


@needs_index
def test_a_list_a_file_and_a_pyproject_make_one_env(tmp_path: Path) -> None:
    (tmp_path / "req").mkdir()
    (tmp_path / "req" / "env-requirements.txt").write_text(
        "# the pack's env\nidna==3.7\nsix==1.16.0\n"
    )
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "pyproject.toml").write_text(
        '[project]\nname = "pack"\nversion = "1"\ndependencies = ["six==1.16.0", "idna==3.7"]\n'
        '[tool.comfy.isolation]\npackage_manager = "uv"\n'
    )
    from_list = comfy_env.build_env(comfy_env.Recipe(["six==1.16.0", "idna==3.7"]))
    from_file = comfy_env.build_env(
        comfy_env.Recipe.from_file(tmp_path / "req" / "env-requirements.txt")
    )
    from_pyproject = comfy_env.build_env(comfy_env.Recipe.from_pyproject(tmp_path / "pack"))
    assert from_list == from_file == from_pyproject
    assert _version_in(from_list, "idna") == "3.7"


@needs_index
def test_a_shipped_lock_is_installed_as_is(tmp_path: Path, home: Path) -> None:
    """The pack asks for ``packaging`` (newest: 24+) and ships a lock of 23.2: the env has 23.2."""
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "pyproject.toml").write_text(
        '[project]\nname = "pack"\nversion = "1"\ndependencies = ["packaging"]\n'
    )
    source = tmp_path / "pin.in"
    source.write_text("packaging==23.2\n")
    subprocess.run(
        [
            _build.uv_bin(),
            "pip",
            "compile",
            "--quiet",
            "--generate-hashes",
            "--python-version",
            "3.11",
            str(source),
            "-o",
            str(pack / "env.lock"),
        ],
        check=True,
    )
    recipe = comfy_env.Recipe.from_pyproject(pack)
    assert recipe.lock == str(pack / "env.lock")
    env = comfy_env.build_env(recipe)
    assert _version_in(env, "packaging") == "23.2"
    assert (env / "env.lock").read_bytes() == (pack / "env.lock").read_bytes()
    # Without the lock the same pyproject resolves to the newest: another env.
    os.unlink(pack / "env.lock")
    newest = comfy_env.build_env(comfy_env.Recipe.from_pyproject(pack))
    assert newest != env and _version_in(newest, "packaging") != "23.2"


@needs_index
def test_a_missing_requirement_names_itself_and_is_not_retried_at_once(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "comfy-env-test-no-such-project-zz9"
    recipe = comfy_env.Recipe([f"{name}==1.0", "six"])
    with pytest.raises(comfy_env.EnvBuildError) as info:
        comfy_env.build_env(recipe)
    error = info.value
    assert error.stage == "resolve"
    assert error.requirements == (name,)
    assert name in error.uv_message and name in str(error)
    assert error.log_path and Path(error.log_path).is_file() and str(error.log_path) in str(error)
    assert error.retry_at is None
    assert not os.listdir(home / "envs")  # nothing published, no temporary directory left
    log_before = Path(error.log_path).stat().st_mtime_ns
    with pytest.raises(comfy_env.EnvBuildError, match="built again at the next use after") as again:
        comfy_env.build_env(recipe)
    assert again.value.retry_at is not None and again.value.retry_at > time.time()
    assert again.value.requirements == (name,)
    assert Path(error.log_path).stat().st_mtime_ns == log_before  # uv was not run again
    # After the wait (here: none), the next use builds again, and fails afresh.
    monkeypatch.setattr(_build, "RETRY_AFTER", 0.0)
    with pytest.raises(comfy_env.EnvBuildError) as third:
        comfy_env.build_env(recipe)
    assert third.value.retry_at is None and third.value.stage == "resolve"
    assert Path(error.log_path).stat().st_mtime_ns != log_before


@needs_index
def test_conflicting_versions_name_the_requirement() -> None:
    with pytest.raises(comfy_env.EnvBuildError) as info:
        comfy_env.build_env(comfy_env.Recipe(["six==1.16.0", "six==1.15.0", "idna"]))
    assert info.value.stage == "resolve"
    assert info.value.requirements == ("six",)
    assert "1.15.0" in info.value.uv_message


_HOST = """
import sys
import comfy_env
worker = comfy_env.get_worker(sys.argv[1])
print(worker.call("importlib.metadata:version", "six"), flush=True)
sys.stdin.readline()
comfy_env.shutdown()
"""


@needs_index
def test_gc_spares_an_env_in_use_and_collects_unused_ones(home: Path) -> None:
    used = comfy_env.Recipe(["six==1.16.0"])
    unused = comfy_env.Recipe(["idna==3.7"])
    used_env, unused_env = comfy_env.build_env(used), comfy_env.build_env(unused)
    (home / "not-ours").mkdir()
    (home / "envs" / "someone-elses").mkdir()  # not built by comfy-env: never removed
    # A live host (another process) uses the env: its status file says so.
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST, str(used_env)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "1.16.0"
        assert wait_until(
            lambda: any(e.in_use_by for e in _envstore.list_envs() if e.key == used_env.name), 10
        )
        report = _envstore.gc(older_than_days=0)
        assert report.removed == (unused_env.name,)
        assert report.kept_in_use == (used_env.name,)
        assert used_env.is_dir() and not unused_env.exists()
        with pytest.raises(comfy_env.EnvError, match="in use by live host"):
            _envstore.remove_env(used_env.name)
    finally:
        host.communicate("\n", timeout=30)
    assert host.returncode == 0
    assert (home / "envs" / "someone-elses").is_dir()
    assert wait_until(lambda: not any(e.in_use_by for e in _envstore.list_envs(sizes=False)), 10)
    report = _envstore.gc(older_than_days=0)
    assert report.removed == (used_env.name,) and not used_env.exists()
    assert (home / "envs" / "someone-elses").is_dir()


@needs_index
def test_envs_holding_the_same_package_share_its_files(home: Path) -> None:
    from comfy_env._build import _uv_cache_dir

    if not _build._same_volume(_uv_cache_dir(), home):
        pytest.skip("uv's cache is on another volume than the env root: files are copied")
    one = comfy_env.build_env(comfy_env.Recipe(["six==1.16.0"]))
    two = comfy_env.build_env(comfy_env.Recipe(["six==1.16.0", "idna==3.7"]))
    (a,) = one.glob("lib/python*/site-packages/six.py")
    (b,) = two.glob("lib/python*/site-packages/six.py")
    assert a.stat().st_ino == b.stat().st_ino and a.stat().st_nlink >= 2


# ---- a second index, concurrency, crashes ------------------------------------------------------


@needs_index
def test_threads_asking_at_once_build_once(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    recipe = comfy_env.Recipe(["iniconfig==2.0.0", "idna==3.7"])
    start = threading.Barrier(3)
    paths: list[Path] = []

    def ask() -> None:
        start.wait()
        paths.append(comfy_env.build_env(recipe))

    caplog.set_level("INFO", logger="comfy_env.build")
    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert len(paths) == 3 and len(set(paths)) == 1
    builds = [r for r in caplog.records if r.getMessage().startswith("comfy-env: building env")]
    assert len(builds) == 1


@needs_index
def test_a_package_from_a_second_index_is_routed_like_cuda_wheels(
    tmp_path: Path, second_index: SecondIndex
) -> None:
    name = _unique("cenv-cuda-probe")
    second_index.add(
        name.replace("-", "_") + "_cu128", make_wheel(name, "1.0", "VALUE = 'second index'\n")
    )
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "pack"
            version = "1"
            dependencies = ["{name}==1.0", "six==1.16.0"]

            [tool.comfy.isolation]
            package_manager = "uv"

            [tool.comfy.isolation.cuda_wheels]
            index_url = "{second_index.url}"
            packages = ["{name}"]
            package_map = {{ "{name}" = "{name.replace("-", "_")}_cu128" }}
            """
        )
    )
    env = comfy_env.build_env(comfy_env.Recipe.from_pyproject(pack))
    module = name.replace("-", "_")
    out = subprocess.run(
        [str(env / "bin" / "python"), "-c", f"import {module}; print({module}.VALUE)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "second index"
    lock = (env / "env.lock").read_text()
    wheel_hash = hashlib.sha256(
        next(iter(second_index.pages[module + "_cu128"].values()))
    ).hexdigest()
    assert f"{name}==1.0" in lock and wheel_hash in lock  # the lock names it and its hash
    # The lock, shipped with another pack, reinstalls the same wheel from the second index.
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text((pack / "pyproject.toml").read_text())
    (other / "env.lock").write_text(lock)
    again = comfy_env.build_env(comfy_env.Recipe.from_pyproject(other))
    assert again != env and _version_in(again, name) == "1.0"


_BUILDER = """
import json, logging, sys
import comfy_env
seen = []
class Catch(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("comfy_env.build").addHandler(Catch())
logging.getLogger("comfy_env.build").setLevel(logging.INFO)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # all start together
recipe = comfy_env.Recipe(json.loads(sys.argv[1]), lock=sys.argv[2] or None)
path = comfy_env.build_env(recipe)
print(json.dumps({"path": str(path),
                  "built": any(m.startswith("comfy-env: building env") for m in seen),
                  "waited": any("being built by another builder" in m for m in seen)}))
"""


def _builder(requirements: list[str], lock: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _BUILDER, json.dumps(requirements), lock],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@needs_index
@pytest.mark.timeout(180)
def test_four_processes_asking_at_once_build_once(home: Path) -> None:
    requirements = ["iniconfig==2.0.0", "six==1.16.0"]
    builders = [_builder(requirements) for _ in range(4)]
    try:
        for b in builders:
            assert b.stdout is not None and b.stdout.readline().strip() == "ready"
        for b in builders:
            assert b.stdin is not None
            b.stdin.write("go\n")
            b.stdin.flush()
        results = []
        for b in builders:
            out, err = b.communicate(timeout=150)
            assert b.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for b in builders:
            if b.poll() is None:
                b.kill()
                b.wait()
    assert len({r["path"] for r in results}) == 1
    assert sum(r["built"] for r in results) == 1, results
    assert [p for p in os.listdir(home / "envs") if ".tmp-" not in p] == [
        Path(results[0]["path"]).name
    ]


@needs_index
@pytest.mark.timeout(180)
def test_a_builder_killed_mid_install_poisons_nothing(
    tmp_path: Path, home: Path, second_index: SecondIndex
) -> None:
    """The builder installs a shipped lock whose wheel downloads slowly; it is SIGKILLed in
    ``uv pip sync``. The next use builds cleanly: its lock is free, the dead builder's
    temporary directory is removed, the env works."""
    name = _unique("cenv-slow")
    filename, data = make_wheel(name, "1.0", "VALUE = 1\n")
    page = name.replace("-", "_")
    second_index.add(page, (filename, data))
    second_index.slow.add(filename)
    lock = tmp_path / "env.lock"
    lock.write_text(
        f"--find-links {second_index.url}{page}/\n"
        f"{name}==1.0 \\\n    --hash=sha256:{hashlib.sha256(data).hexdigest()}\n"
    )
    builder = _builder([name], str(lock))
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "ready"
        assert builder.stdin is not None
        builder.stdin.write("go\n")
        builder.stdin.flush()
        assert second_index.requested.wait(60), "the builder never reached the download"
        assert [p for p in os.listdir(home / "envs") if ".tmp-" in p]  # mid-build
        (uv,) = [
            p for p in psutil.Process(builder.pid).children(recursive=True) if p.name() == "uv"
        ]
        os.kill(builder.pid, signal.SIGKILL)  # the builder only: its uv is orphaned
        builder.communicate(timeout=30)
        # The orphan carries its dead builder's host mark: the sweep kills it.
        assert uv.is_running()
        comfy_env.sweep()
        assert wait_until(lambda: not uv.is_running() or uv.status() == psutil.STATUS_ZOMBIE, 10)
    finally:
        if builder.poll() is None:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait()
    second_index.release()
    env = comfy_env.build_env(comfy_env.Recipe([name], lock=lock))
    assert _version_in(env, name) == "1.0"
    assert os.listdir(home / "envs") == [env.name]  # the dead builder's directory is gone


# ---- the command line --------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, object]:
    from comfy_env._cli import main

    code = main(list(words))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in words else out


@needs_index
def test_cli_env_build_list_gc_rm(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "pyproject.toml").write_text(
        '[project]\nname = "clipack"\nversion = "1"\ndependencies = ["six==1.16.0"]\n'
    )
    code, built = _cli(capsys, "env", "build", str(pack), "--json")
    assert code == 0 and isinstance(built, dict) and built["ok"]
    code, other = _cli(capsys, "env", "build", "idna==3.7", "--json")
    assert code == 0 and isinstance(other, dict)
    code, listed = _cli(capsys, "env", "list", "--json")
    assert code == 0 and isinstance(listed, dict)
    rows = {row["key"]: row for row in listed["envs"]}
    assert set(rows) == {built["key"], other["key"]}
    assert rows[built["key"]]["name"] == "clipack" and rows[built["key"]]["size_bytes"] > 0
    assert rows[built["key"]]["python"] and rows[built["key"]]["in_use_by"] == []
    code, text = _cli(capsys, "env", "list")
    assert code == 0 and built["key"] in str(text) and "clipack" in str(text)
    code, dry = _cli(capsys, "env", "gc", "--older-than", "0", "--dry-run", "--json")
    assert code == 0 and isinstance(dry, dict) and sorted(dry["removed"]) == sorted(rows)
    assert Path(built["path"]).is_dir()  # a dry run removes nothing
    code, removed = _cli(capsys, "env", "rm", other["key"], "--json")
    assert code == 0 and isinstance(removed, dict) and removed["ok"]
    assert not Path(other["path"]).exists()
    code, missing = _cli(capsys, "env", "rm", other["key"], "--json")
    assert code == 1 and isinstance(missing, dict) and not missing["ok"]
    code, gone = _cli(capsys, "env", "gc", "--older-than", "0", "--json")
    assert code == 0 and isinstance(gone, dict) and gone["removed"] == [built["key"]]
    assert os.listdir(home / "envs") == []


@needs_index
def test_cli_env_build_failure_says_the_stage(capsys: pytest.CaptureFixture[str]) -> None:
    code, failed = _cli(capsys, "env", "build", "comfy-env-test-no-such-project-zz9", "--json")
    assert code == 1 and isinstance(failed, dict) and not failed["ok"]
    error = failed["error"]
    assert error["type"] == "EnvBuildError" and error["stage"] == "resolve"
    assert error["requirements"] == ["comfy-env-test-no-such-project-zz9"]
    assert Path(error["log_path"]).is_file()


# ---- ComfyUI packs: isolate() with no env= ------------------------------------------------------

PACK_NODES = """
import importlib.metadata
import sys


class SixVersion:
    CATEGORY = "t"
    RETURN_TYPES = ("STRING", "STRING")
    FUNCTION = "go"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def go(self):
        return (importlib.metadata.version("six"), sys.prefix)


NODE_CLASS_MAPPINGS = {"SixVersion": SixVersion}
"""


def _pack(tmp_path: Path, pyproject: str | None) -> Path:
    root = tmp_path / "pack"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
    (root / "nodes.py").write_text(PACK_NODES)
    if pyproject is not None:
        (root / "pyproject.toml").write_text(pyproject)
    return root


@needs_index
def test_a_pack_without_env_runs_in_the_env_its_pyproject_declares(
    tmp_path: Path, home: Path, pool: comfy_env.Pool
) -> None:
    import asyncio

    from comfy_env.comfyui import isolate

    pack = _pack(
        tmp_path,
        '[project]\nname = "sixpack"\nversion = "1"\ndependencies = ["six==1.15.0"]\n\n'
        '[tool.comfy.isolation]\npackage_manager = "uv"\nextra_index_urls = []\n',
    )
    mappings, _ = isolate(
        str(pack / "__init__.py"), module="nodes", pool=pool, cache_dir=str(tmp_path / "cache")
    )
    version, prefix = asyncio.run(mappings["SixVersion"]().go())
    assert version == "1.15.0"
    assert Path(prefix).parent == home / "envs"
    assert list(pool.stats()) == [prefix]
    # A second server start finds it built (one env, no second build).
    assert os.listdir(home / "envs") == [Path(prefix).name]


@needs_index
def test_a_pack_whose_env_cannot_be_built_fails_its_import_with_the_build_s_story(
    tmp_path: Path, pool: comfy_env.Pool
) -> None:
    from comfy_env.comfyui import NodePackError, isolate

    name = "comfy-env-test-no-such-project-zz9"
    pack = _pack(tmp_path, f'[project]\nname = "p"\nversion = "1"\ndependencies = ["{name}"]\n')
    with pytest.raises(NodePackError) as info:
        isolate(str(pack), module="nodes", pool=pool, cache_dir=str(tmp_path / "cache"))
    message = str(info.value)
    assert "could not be built" in message and "resolve failed" in message and name in message
    assert "full log:" in message
    assert pool.stats() == {}


def test_a_pack_with_a_conda_manifest_or_no_pyproject_is_told_what_it_needs(
    tmp_path: Path,
) -> None:
    from comfy_env.comfyui import NodePackError, isolate

    pack = _pack(tmp_path, None)
    with pytest.raises(NodePackError, match="no env= and the pack has no"):
        isolate(str(pack), module="nodes", cache_dir=str(tmp_path / "cache"))
    (pack / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "1"\ndependencies = ["six"]\n'
        '[tool.comfy.isolation]\npackage_manager = "conda"\n'
    )
    with pytest.raises(NodePackError, match='package_manager = "conda"'):
        isolate(str(pack), module="nodes", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(comfy_env.ArgumentError, match=r"module=\.\.\.\) is required"):
        isolate(str(pack))


@needs_index
def test_a_pack_may_pass_a_recipe_as_its_env(tmp_path: Path, pool: comfy_env.Pool) -> None:
    import asyncio

    from comfy_env.comfyui import isolate

    pack = _pack(tmp_path, None)
    (pack / "env-requirements.txt").write_text("six==1.16.0\n")
    recipe = comfy_env.Recipe.from_file(pack / "env-requirements.txt")
    mappings, _ = isolate(
        str(pack), env=recipe, module="nodes", pool=pool, cache_dir=str(tmp_path / "cache")
    )
    assert asyncio.run(mappings["SixVersion"]().go())[0] == "1.16.0"


@needs_index
def test_a_published_env_s_scripts_run_where_it_was_renamed_to(tmp_path: Path) -> None:
    """Built at a temporary path and renamed into place: the console scripts (and the
    interpreter's ``sys.prefix``) know the final place."""
    env = comfy_env.build_env(comfy_env.Recipe(["pyflakes==3.2.0"]))
    assert ".tmp-" not in (env / "bin" / "pyflakes").read_text()
    (tmp_path / "x.py").write_text("import os\n")
    out = subprocess.run(
        [str(env / "bin" / "pyflakes"), str(tmp_path / "x.py")], capture_output=True, text=True
    )
    assert "'os' imported but unused" in out.stdout, out.stderr
    prefix = subprocess.run(
        [str(env / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert prefix == str(env)


@needs_index
def test_python_picks_an_installed_interpreter_of_that_version() -> None:
    from conftest import other_python

    if other_python(12) is None:
        pytest.skip("no Python 3.12 on this machine")
    env = comfy_env.build_env(comfy_env.Recipe(["six==1.16.0"], python="3.12"))
    out = subprocess.run(
        [str(env / "bin" / "python"), "-c", "import sys, six; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "(3, 12)"
    assert env != comfy_env.build_env(comfy_env.Recipe(["six==1.16.0"]))  # another Python


@needs_index
def test_a_wheel_that_cannot_be_downloaded_or_does_not_match_its_hash_says_so(
    tmp_path: Path, second_index: SecondIndex
) -> None:
    name = _unique("cenv-gone")
    filename, data = make_wheel(name, "1.0", "VALUE = 1\n")
    page = name.replace("-", "_")
    second_index.add(page, (filename, data))
    second_index.missing.add(filename)
    lock = tmp_path / "env.lock"
    lock.write_text(
        f"--find-links {second_index.url}{page}/\n"
        f"{name}==1.0 \\\n    --hash=sha256:{hashlib.sha256(data).hexdigest()}\n"
    )
    with pytest.raises(comfy_env.EnvBuildError) as gone:
        comfy_env.build_env(comfy_env.Recipe([name], lock=lock))
    assert gone.value.stage == "download" and gone.value.requirements == (name,)
    assert "404" in gone.value.uv_message or "Not Found" in gone.value.uv_message
    second_index.missing.clear()
    lock.write_text(lock.read_text().replace(hashlib.sha256(data).hexdigest(), "0" * 64))
    with pytest.raises(comfy_env.EnvBuildError) as tampered:
        comfy_env.build_env(comfy_env.Recipe([name], lock=lock))
    assert tampered.value.stage == "download" and tampered.value.requirements == (name,)
    assert "hash" in tampered.value.uv_message.lower()
