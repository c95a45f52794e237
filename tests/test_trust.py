"""Files the agent trusts (issue 12 §3): a state dir, database (+ -wal/-shm), key file,
artifacts or runs dir, or config file that another user could write is refused by ``serve``
and every CLI command (exit 5, one line naming the path, the owner/mode found and the fix),
and listed by ``doctor``. Tests run as root: foreign ownership is uid 65534 (nobody).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from qlcli import cli, ok

FOREIGN_UID = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _paths(state: str, workdir: str) -> dict[str, tuple[str, bool]]:
    """role → (path, is_dir); files that do not exist yet are created as the agent would."""
    return {
        "state dir": (state, True),
        "database": (os.path.join(state, "qlagent.db"), False),
        "database wal": (os.path.join(state, "qlagent.db-wal"), False),
        "database shm": (os.path.join(state, "qlagent.db-shm"), False),
        "key file": (os.path.join(state, "secret.key"), False),
        "artifacts dir": (os.path.join(state, "artifacts"), True),
        "runs dir": (os.path.join(state, "runs"), True),
        "config file": (os.path.join(workdir, "qlagent.toml"), False),
    }


def _make(path: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(path, mode=0o700, exist_ok=True)
    elif not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)


def _tree_digest(root: str) -> str:
    """Names, modes, owners and contents of everything under ``root``: 'nothing written'."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            h.update(f"{p} {st.st_mode} {st.st_uid}".encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


COMMANDS = [("task", "ls"), ("run", "ls"), ("secret", "ls"), ("config", "check"), ("init",),
            ("serve", "--exit-after", "0"), ("run", "start", "nothing")]


@pytest.mark.parametrize("fault", ["world-writable", "group-writable", "foreign owner"])
@pytest.mark.parametrize("role", ["state dir", "database", "database wal", "database shm", "key file",
                                  "artifacts dir", "runs dir", "config file"])
def test_every_command_refuses_an_untrusted_path(state, workdir, role, fault):
    paths = _paths(state, workdir)
    for p, is_dir in paths.values():
        _make(p, is_dir)
    path, is_dir = paths[role]
    if fault == "world-writable":
        os.chmod(path, 0o777 if is_dir else 0o666)
    elif fault == "group-writable":
        os.chmod(path, 0o770 if is_dir else 0o660)
    else:
        os.chown(path, FOREIGN_UID, -1)
    config = paths["config file"][0]
    before = _tree_digest(state)
    for cmd in COMMANDS:
        p = cli(state, "--config", config, *cmd)
        err = p.stderr.decode()
        assert p.returncode == 5, (cmd, p.returncode, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (cmd, err)
        assert f"untrusted {role} {path}:" in lines[0], (cmd, err)
        if fault == "foreign owner":
            assert f"owned by uid {FOREIGN_UID}, not the agent's uid 0" in lines[0]
            assert f"fix: chown 0 {path}" in lines[0]
        else:
            mode = (0o777 if fault == "world-writable" else 0o770) & (0o777 if is_dir else 0o666)
            assert f"mode {mode:04o} is {'group and world' if fault == 'world-writable' else 'group'}-writable" \
                in lines[0], err
            assert f"fix: chmod go-w {path}" in lines[0]
    assert _tree_digest(state) == before            # nothing written, nothing "fixed" behind the back
    # doctor lists the same problem (and does not open the database), exit 5.
    p = cli(state, "--config", config, "doctor", "--json")
    assert p.returncode == 5
    checks = json.loads(p.stdout)["checks"]
    trust = [c for c in checks if c["name"] == "trust"]
    assert len(trust) == 1 and not trust[0]["ok"] and path in trust[0]["detail"], checks
    assert not any(c["name"] in ("schema", "integrity") for c in checks)
    # The printed fix works: after it, the same command succeeds.
    if fault == "foreign owner":
        os.chown(path, 0, -1)
    else:
        os.chmod(path, 0o700 if is_dir else 0o600)
    ok(state, "--config", config, "task", "ls")
    p = cli(state, "--config", config, "doctor", "--json")
    checks = json.loads(p.stdout)["checks"]
    assert [c["ok"] for c in checks if c["name"] == "trust"] == [True], checks


def test_a_readable_but_safe_layout_is_accepted(state, workdir):
    """0755 directories and 0644 files owned by the agent are not writable by others: accepted.
    QLAGENT_CONFIG=/dev/null (examples/run-demo) is accepted although it is 0666."""
    os.chmod(state, 0o755)
    os.chmod(os.path.join(state, "qlagent.db"), 0o644)
    ok(state, "--config", "/dev/null", "task", "ls")
    p = cli(state, "task", "ls", env={"QLAGENT_CONFIG": "/dev/null"})
    assert p.returncode == 0, p.stderr


def test_a_planted_foreign_database_is_never_opened(state, workdir):
    """Another user replaces qlagent.db (here: with a file they own): serve refuses before
    reading it, so its @boot task never runs."""
    db = os.path.join(state, "qlagent.db")
    os.chmod(state, 0o777)
    p = cli(state, "serve", "--exit-after", "0")
    assert p.returncode == 5 and f"untrusted state dir {state}" in p.stderr.decode()
    os.chmod(state, 0o700)
    os.chown(db, FOREIGN_UID, -1)
    p = cli(state, "serve", "--exit-after", "0")
    assert p.returncode == 5 and f"untrusted database {db}" in p.stderr.decode()


def test_a_non_root_agent_trusts_its_own_and_root_owned_files_only(workdir):
    """The packaged agent runs as its own user and reads the root-owned /etc/qlagent config: root
    can already act as any user, so root-owned is trusted; a third uid's file is not."""
    from qlagent.service.trust import problem
    agent_uid = FOREIGN_UID
    path = os.path.join(workdir, "qlagent.toml")
    _make(path, False)
    os.chmod(path, 0o644)
    assert problem("config file", path, euid=agent_uid) is None              # root-owned
    os.chown(path, agent_uid, -1)
    assert problem("config file", path, euid=agent_uid) is None              # its own
    os.chown(path, agent_uid - 1, -1)
    text = problem("config file", path, euid=agent_uid)
    assert f"owned by uid {agent_uid - 1}, not the agent's uid {agent_uid} or root" in text
    assert f"fix: chown {agent_uid} {path}" in text


def test_a_state_dir_reached_through_another_users_symlink_is_refused(state, workdir):
    """The symlink's owner can point it anywhere at any moment (between the check and the
    open): a path reached through it is not trusted, although its target is the agent's."""
    link = os.path.join(workdir, "link")
    os.symlink(state, link)
    os.lchown(link, FOREIGN_UID, -1)
    before = _tree_digest(state)
    p = cli(link, "task", "ls")
    err = p.stderr.decode()
    assert p.returncode == 5, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"symlink {link} is owned by uid {FOREIGN_UID}" in err
    assert _tree_digest(state) == before
    os.lchown(link, 0, -1)
    ok(link, "task", "ls")


@pytest.mark.parametrize("mode,trusted", [(0o777, False), (0o775, False), (0o1777, True), (0o755, True)])
def test_a_state_dir_whose_parent_others_can_write_is_refused_unless_sticky(state, workdir, mode, trusted):
    """Anyone who can write the parent can rename the state dir away and put their own in its
    place (unless the sticky bit, as on /tmp, keeps them to their own entries)."""
    os.chmod(workdir, mode)
    p = cli(state, "task", "ls")
    err = p.stderr.decode()
    if trusted:
        assert p.returncode == 0, err
    else:
        assert p.returncode == 5, err
        assert f"directory {workdir} mode {mode:04o} is group" in err and f"chmod go-w {workdir}" in err
    p = cli(state, "doctor", "--json")
    assert [c["ok"] for c in json.loads(p.stdout)["checks"] if c["name"] == "trust"] == [trusted]


def test_a_state_dir_inside_another_users_directory_is_refused(state, workdir):
    os.chown(workdir, FOREIGN_UID, -1)
    p = cli(state, "task", "ls")
    assert p.returncode == 5 and f"directory {workdir} is owned by uid {FOREIGN_UID}" in p.stderr.decode()
