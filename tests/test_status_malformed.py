"""``comfy-env status`` against malformed state files: a status file nested too deep, with
infinite, NaN, overflowing or huge numbers, too large, not JSON or of the wrong shape, and a
FIFO or a directory in its place, is skipped with a note; the command never hangs.
"""

from __future__ import annotations

import json
import math
import os

import pytest


def _live_foreign_host_name() -> str:
    """A status file name of a host that is alive (pid 1 of this namespace), not this one."""
    from comfy_env._identity import pid_namespace, proc_stat

    stat_1 = proc_stat(1)
    assert stat_1 is not None
    return f"1-t{stat_1[1]}-n{pid_namespace()}.json"


def _valid_document(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "schema": 1,
        "host_id": "1-t1-n1",
        "pid": 1,
        "start_ms": 1000,
        "updated_at": 1000.0,
        "pools": [],
    }
    doc.update(over)
    return doc


MALFORMED = {
    "deeply-nested": b"[" * 200_000 + b"]" * 200_000,
    "infinity": json.dumps(_valid_document(updated_at=math.inf)).encode(),
    "nan": json.dumps(_valid_document(start_ms=math.nan)).encode(),
    "overflowing-float": json.dumps(_valid_document())
    .replace('"start_ms": 1000', '"start_ms": 1e999')
    .encode(),
    "huge-int": json.dumps(_valid_document())
    .replace('"pid": 1,', '"pid": ' + "9" * 5000 + ",")
    .encode(),
    "huge-file": b'{"pad": "' + b"x" * (5 << 20) + b'"}',
    "not-json": b"\xff\xfe garbage",
    "wrong-shape": b'{"pools": 5}',
}


@pytest.mark.parametrize("kind", [*MALFORMED, "fifo", "directory"])
def test_status_skips_malformed_state_files_with_a_note_and_never_hangs(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from comfy_env._cli import main
    from comfy_env._status import read_status, status_dir

    path = os.path.join(status_dir(), _live_foreign_host_name())
    if kind == "fifo":
        os.mkfifo(path, 0o600)  # opening it for reading would block without O_NONBLOCK
    elif kind == "directory":
        os.mkdir(path, 0o700)
    else:
        with open(path, "wb") as f:
            f.write(MALFORMED[kind])
    try:
        notes: list[str] = []
        hosts = read_status(notes=notes)
        assert all(h.pid != 1 for h in hosts)
        assert any(path in note for note in notes), notes
        assert main(["status", "--json"]) == 0
        out, err = capsys.readouterr()
        assert any(path in note for note in json.loads(out)["notes"])
        assert main(["status"]) == 0
        out, err = capsys.readouterr()
        assert "note:" in err
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
