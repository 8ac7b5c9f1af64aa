"""``comfy-env status`` on an account shared by several people: by default it lists the hosts
of the reader's own login session (the kernel's audit session), ``--all`` every host of the
user. Real host processes, each put in a login session of its own the way ``pam_loginuid``
does at login (writing ``/proc/self/loginuid``; root only, skipped elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from comfy_env._cli import own_hosts
from comfy_env._status import HostStatus, login_session
from comfy_env._values import replace

# Sets this shell's login uid, which gives it (and what it execs) a new audit session.
NEW_LOGIN = f'echo {os.getuid()} > /proc/self/loginuid && exec "$0" "$@"'

HOST = """
import sys, time
import comfy_env
from comfy_env._status import read_status
pool = comfy_env.Pool()
pool.get_worker(None).call("comfy_env_worker.tasks:echo", 1)
deadline = time.monotonic() + 20  # until its status file is published
while time.monotonic() < deadline and not any(
    h.pid == __import__("os").getpid() for h in read_status(measure=False)
):
    time.sleep(0.02)
"""

HOST_WAITING = (
    HOST
    + """
print("ready", flush=True)
sys.stdin.read()  # until the test closes stdin
pool.close()
"""
)

HOST_READING = (
    HOST
    + """
import json, subprocess
run = lambda *a: subprocess.run(
    [sys.executable, "-m", "comfy_env", "status", *a], capture_output=True, text=True, timeout=60
).stdout
print(json.dumps({"default": json.loads(run("--json")), "all": json.loads(run("--all", "--json")),
                  "text": run()}))
pool.close()
"""
)


def _new_logins_possible() -> bool:
    try:
        out = subprocess.run(
            ["sh", "-c", NEW_LOGIN, "cat", "/proc/self/sessionid"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() not in ("", "4294967295")


def _in_new_login(code: str) -> list[str]:
    return ["sh", "-c", NEW_LOGIN, sys.executable, "-c", textwrap.dedent(code)]


@pytest.mark.timeout(120)
def test_status_shows_this_login_sessions_hosts_and_all_of_them_with_all() -> None:
    if not _new_logins_possible():
        pytest.skip("cannot start a login session here (needs root and audit support)")
    other = subprocess.Popen(
        _in_new_login(HOST_WAITING),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
        reader = subprocess.run(
            _in_new_login(HOST_READING), capture_output=True, text=True, timeout=90
        )
        assert reader.returncode == 0, reader.stderr[-3000:]
        seen = json.loads(reader.stdout)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
        if other.stdout is not None:
            other.stdout.close()
    default, every = seen["default"], seen["all"]
    assert default["login_session"] is not None
    # The reader is a host of its own login session; the other login's host is left out.
    mine = default["hosts"]
    assert mine and all(h["login_session"] == default["login_session"] for h in mine)
    assert other.pid not in [h["pid"] for h in default["hosts"]]
    assert default["hidden_hosts"] >= 1 and default["all"] is False
    # --all lists both, each with its own session.
    listed = {h["pid"]: h["login_session"] for h in every["hosts"]}
    assert other.pid in listed and every["hidden_hosts"] == 0
    assert listed[other.pid] not in (None, default["login_session"])
    assert "of other login sessions of this user not shown" in seen["text"]
    assert "comfy-env status --all" in seen["text"]


def test_without_a_login_session_every_host_is_shown() -> None:
    host = HostStatus(
        host_id="1-t1-n1",
        pid=1,
        start_ms=0,
        updated_at=0.0,
        argv=(),
        executable=None,
        version=None,
        envs=(),
        path="/x",
    )
    hosts = [replace(host, login_session=7), replace(host, pid=2), replace(host, login_session=8)]
    assert own_hosts(hosts, None) == hosts  # the reader has none: nothing to tell apart
    assert own_hosts(hosts, 7) == [hosts[0]]  # a host of no login is not this login's
    assert login_session() is None or login_session() == login_session(os.getpid())
