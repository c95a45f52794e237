"""Secrets at rest (issue 2 §3): values encrypted with a 0600 key file outside the database, the
plaintext never in the database file, its WAL/SHM, events, CLI output or error text."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys

import pytest
from qlcli import cli, js, ok

from qlagent.adapters.sqlite.store import SqliteStore
from qlagent.bootstrap import cipher_factory
from qlagent.dispatch.secrets import resolve_secrets as _resolve


def resolve_secrets(state: str, key: str, names: list[str]) -> dict[str, bytes]:
    """The materialiser's step 4 over the real store file of ``state`` and key file ``key``."""
    store = SqliteStore(os.path.join(state, "qlagent.db"), migrate=False, create_project=False)
    try:
        return _resolve(store, cipher_factory(key), store.project.project_id, names)
    finally:
        store.close()
from qlagent.core.errors import UnavailableError

SECRET = b"QLSECRET-5e1f0c9a-ddns-token-\xc3\xa9-do-not-leak"
TASKS = """
[[task]]
name = "ddns-update"
schedule = "*/10 * * * *"
network = "default_route"
shell = "/bin/sh"
script = 'printf "token length %s\\n" "${#DDNS_TOKEN}"'
secrets = { DDNS_TOKEN = "ddns_token" }
"""


def leaks(blob: bytes) -> list[str]:
    """Which encodings of the secret occur in ``blob``."""
    forms = {"raw": SECRET, "hex": SECRET.hex().encode(), "json-escaped": json.dumps(SECRET.decode()).encode()[1:-1],
             "distinctive-part": b"5e1f0c9a-ddns-token"}
    return [k for k, v in forms.items() if v in blob]


def test_leak_detector_finds_each_form():
    assert leaks(b"..." + SECRET + b"...") == ["raw", "distinctive-part"]
    assert leaks(SECRET.hex().encode()) == ["hex"]
    assert leaks(json.dumps({"v": SECRET.decode()}).encode()) == ["json-escaped", "distinctive-part"]


def test_key_file_created_by_init_is_0600_outside_the_database(state):
    key = os.path.join(state, "secret.key")
    st = os.lstat(key)
    assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_size == 32
    with open(key, "rb") as f:
        material = f.read()
    with open(os.path.join(state, "qlagent.db"), "rb") as f:
        assert material not in f.read()
    before = os.stat(key).st_mtime_ns
    ok(state, "init")                                        # re-init keeps the key
    assert os.stat(key).st_mtime_ns == before


def test_plaintext_never_reaches_disk_events_or_output(state, workdir):
    db = os.path.join(state, "qlagent.db")
    # An open reader keeps SQLite from checkpointing and deleting the WAL on the CLI's close,
    # so the -wal and -shm files the CLI wrote are there to be searched.
    holder = sqlite3.connect(db)
    holder.execute("SELECT count(*) FROM sqlite_master").fetchone()
    try:
        outputs = [ok(state, "secret", "set", "ddns_token", stdin=SECRET + b"\n")]
        f = os.path.join(workdir, "tasks.toml")
        with open(f, "w") as fh:
            fh.write(TASKS)
        outputs.append(ok(state, "task", "add", "-f", f))
        run_id = js(state, "run", "start", "ddns-update")["runId"]
        for args in (["task", "show", "ddns-update"], ["task", "ls"], ["secret", "ls"], ["run", "show", run_id],
                     ["run", "ls"]):
            outputs += [ok(state, *args), ok(state, *args, "--json")]
        outputs.append(ok(state, "secret", "set", "ddns_token", stdin=SECRET))   # overwrite: same value again
        for bad in (["secret", "set", "bad name!"], ["secret", "set", "x" * 65]):
            p = cli(state, *bad, stdin=SECRET)
            assert p.returncode == 2 and b"name" in p.stderr
            outputs.append(p)
        p = cli(state, "secret", "set", "too_long", stdin=SECRET * 4000)       # > 65536 bytes
        assert p.returncode == 2 and b"65536" in p.stderr
        outputs.append(p)
        p = cli(state, "secret", "set", "has_nul", stdin=SECRET + b"\x00" + SECRET)
        assert p.returncode == 2 and b"NUL" in p.stderr
        outputs.append(p)

        assert os.path.exists(db + "-wal") and os.path.getsize(db + "-wal") > 0
        for path in (db, db + "-wal", db + "-shm"):
            with open(path, "rb") as fh:
                assert leaks(fh.read()) == [], path
        for p in outputs:
            assert leaks(p.stdout) == [] and leaks(p.stderr) == [], p.args
        events = holder.execute("SELECT group_concat(payload_json, ' ') FROM run_events").fetchone()[0]
        assert events and leaks(events.encode()) == []
        assert "ddns_token" not in events and "DDNS_TOKEN" not in events        # SecretRefs stay out of events
        (blob,) = holder.execute("SELECT ciphertext FROM secrets WHERE name = 'ddns_token'").fetchone()
        assert leaks(bytes(blob)) == [] and len(blob) > len(SECRET)
    finally:
        holder.close()
    # the stored value decrypts to exactly what was piped in (trailing newline of `echo` dropped)
    assert resolve_secrets(state, os.path.join(state, "secret.key"), ["ddns_token"]) == {"ddns_token": SECRET}


def test_secret_ls_shows_names_only_and_rm(state):
    ok(state, "secret", "set", "b_token", stdin=SECRET)
    ok(state, "secret", "set", "a_token", stdin=SECRET)
    listed = js(state, "secret", "ls")["items"]
    assert [e["name"] for e in listed] == ["a_token", "b_token"]
    assert all(set(e) == {"name", "updatedAt"} for e in listed)
    ok(state, "secret", "rm", "a_token")
    assert [e["name"] for e in js(state, "secret", "ls")["items"]] == ["b_token"]
    p = cli(state, "secret", "rm", "a_token")
    assert p.returncode == 4 and b"a_token" in p.stderr and b"Traceback" not in p.stderr


def test_empty_value_is_refused(state):
    p = cli(state, "secret", "set", "empty", stdin=b"")
    assert p.returncode == 2 and b"value" in p.stderr
    assert js(state, "secret", "ls") == {"items": []}


def test_missing_or_unsafe_key_file_is_a_clear_error(state):
    key = os.path.join(state, "secret.key")

    def doctor_key_check():
        p = cli(state, "doctor", "--json")
        check = [c for c in json.loads(p.stdout)["checks"] if c["name"] == "key file"][0]
        return p.returncode, check["ok"], check["detail"]
    assert doctor_key_check()[:2] == (0, True)
    os.chmod(key, 0o644)
    rc, good, detail = doctor_key_check()
    assert (rc, good) == (5, False) and "0600" in detail
    p = cli(state, "secret", "set", "tok", stdin=SECRET)
    assert p.returncode == 5 and b"0600" in p.stderr and b"Traceback" not in p.stderr
    os.chmod(key, 0o600)
    os.rename(key, key + ".moved")
    p = cli(state, "secret", "set", "tok", stdin=SECRET)
    assert p.returncode == 5 and b"missing" in p.stderr and b"qlagent init" in p.stderr
    assert b"Traceback" not in p.stderr and leaks(p.stderr) == []
    assert js(state, "secret", "ls") == {"items": []}


def test_wrong_key_does_not_decrypt(state):
    ok(state, "secret", "set", "tok", stdin=SECRET)
    key = os.path.join(state, "secret.key")
    with open(key, "r+b") as f:
        f.write(os.urandom(32))                           # same file, other key
    with pytest.raises(UnavailableError, match="does not decrypt with this key file") as ei:
        resolve_secrets(state, key, ["tok"])
    assert leaks(str(ei.value).encode()) == []
    with pytest.raises(UnavailableError, match="'nope' is not set"):
        resolve_secrets(state, key, ["nope"])


def test_ciphertext_is_bound_to_its_name(state):
    """A row copied under another name does not decrypt (AES-GCM associated data)."""
    ok(state, "secret", "set", "tok", stdin=SECRET)
    db = os.path.join(state, "qlagent.db")
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO secrets SELECT project_id, 'copy', ciphertext, key_id, updated_at_us FROM secrets")
    with pytest.raises(UnavailableError, match="'copy' does not decrypt"):
        resolve_secrets(state, os.path.join(state, "secret.key"), ["copy"])


# --- stores written before PyNaCl (issue 14) -----------------------------------------------

def seal_qlsb1(key: bytes, project_id: str, name: str, plaintext: bytes) -> bytes:
    """Exactly what ``SecretBox.seal`` wrote before issue 14 (AES-256-GCM via cryptography):
    ``b"qlsb1" || nonce(12) || AESGCM(key).encrypt(nonce, plaintext, project_id NUL name)``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    nonce = os.urandom(12)
    return b"qlsb1" + nonce + AESGCM(key).encrypt(nonce, plaintext, f"{project_id}\x00{name}".encode())


def write_legacy_store(state: str, values: dict[str, bytes]) -> str:
    """Store ``values`` the way the AES-GCM version did (row layout of ``put_secret``, key_id
    of that version's SecretBox); returns the Project id."""
    from qlagent.core.canonical import sha256_hex
    with open(os.path.join(state, "secret.key"), "rb") as f:
        key = f.read()
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        pid = c.execute("SELECT project_id FROM projects WHERE name = 'default'").fetchone()[0]
        for name, value in values.items():
            c.execute("INSERT INTO secrets VALUES (?, ?, ?, ?, ?)",
                      (pid, name, seal_qlsb1(key, pid, name, value), sha256_hex(b"qlagent-key-id" + key)[:16], 1))
    return pid


def stored(state: str) -> dict[str, bytes]:
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        return {n: bytes(b) for n, b in c.execute("SELECT name, ciphertext FROM secrets")}


def test_new_ciphertext_is_versioned_xchacha20poly1305(state):
    ok(state, "secret", "set", "tok", stdin=SECRET)
    blob = stored(state)["tok"]
    assert blob[:5] == b"qlsb2" and len(blob) == 5 + 24 + len(SECRET) + 16
    from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt
    with open(os.path.join(state, "secret.key"), "rb") as f:
        key = f.read()
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        pid = c.execute("SELECT project_id FROM projects").fetchone()[0]
    assert crypto_aead_xchacha20poly1305_ietf_decrypt(blob[29:], f"{pid}\x00tok".encode(), blob[5:29], key) == SECRET


def test_init_reencrypts_a_store_written_by_the_aes_gcm_version(state):
    write_legacy_store(state, {"ddns_token": SECRET, "other": b"second value"})
    ok(state, "secret", "set", "fresh", stdin=b"already new")
    before = stored(state)
    out = ok(state, "init").stdout.decode()
    assert "2 re-encrypted" in out
    after = stored(state)
    assert {n: b[:5] for n, b in after.items()} == {"ddns_token": b"qlsb2", "other": b"qlsb2", "fresh": b"qlsb2"}
    assert after["fresh"] == before["fresh"]                   # a current row is not touched
    key = os.path.join(state, "secret.key")
    assert resolve_secrets(state, key, ["ddns_token", "other"]) == {"ddns_token": SECRET, "other": b"second value"}
    assert "re-encrypted" not in ok(state, "init").stdout.decode()    # once only
    assert stored(state) == after


def test_service_start_reencrypts_and_the_run_gets_the_value(state, workdir):
    write_legacy_store(state, {"ddns_token": SECRET})
    f = os.path.join(workdir, "tasks.toml")
    with open(f, "w") as fh:
        fh.write(TASKS.replace('network = "default_route"\n', ""))
    ok(state, "task", "add", "-f", f)
    ok(state, "serve", "--exit-after", "0.5")
    assert stored(state)["ddns_token"][:5] == b"qlsb2"
    run = js(state, "run", "start", "ddns-update", "--wait", "--timeout", "30")
    assert run["state"] == "succeeded"
    log = ok(state, "run", "logs", run["runId"]).stdout
    # the value arrived whole: its length in bytes (dash) or characters (a UTF-8 shell)
    assert log in (f"token length {len(SECRET)}\n".encode(), f"token length {len(SECRET.decode())}\n".encode())


NO_CRYPTOGRAPHY = r'''
import sys
sys.modules["cryptography"] = None          # as on a box where it is not installed
from qlagent.cli.main import main
sys.exit(main(sys.argv[1:]))
'''


def test_legacy_row_without_cryptography_is_one_clear_line_and_kept(state):
    write_legacy_store(state, {"ddns_token": SECRET})
    before = stored(state)
    p = subprocess.run([sys.executable, "-c", NO_CRYPTOGRAPHY, "--state-dir", state, "init"], capture_output=True)
    assert p.returncode == 0, p.stderr                      # init did its job; the row waits
    err = p.stderr.decode()
    assert err.count("\n") == 1 and "'ddns_token'" in err and "python3-cryptography" in err, err
    assert "Traceback" not in err and leaks(p.stderr) == []
    assert stored(state) == before
    ok(state, "init")                                       # with cryptography: migrated
    assert stored(state)["ddns_token"][:5] == b"qlsb2"


@pytest.mark.parametrize("blob", [b"qlsb2" + b"\x00" * 39, b"qlsb1" + b"\x00" * 27, b"qlsb2", b""])
def test_truncated_ciphertext_is_a_clear_error(state, blob):
    ok(state, "secret", "set", "tok", stdin=SECRET)
    db = os.path.join(state, "qlagent.db")
    with sqlite3.connect(db) as c:
        c.execute("UPDATE secrets SET ciphertext = ? WHERE name = 'tok'", (blob,))
    with pytest.raises(UnavailableError, match="'tok' is (truncated|not in a known format)"):
        resolve_secrets(state, os.path.join(state, "secret.key"), ["tok"])


def test_task_add_warns_only_about_a_secret_that_is_not_set(state, workdir):
    """Through the real store (its rows are sqlite3.Row): a stored Secret is no warning, a
    missing one is, and doctor agrees."""
    f = os.path.join(workdir, "tasks.toml")
    with open(f, "w") as fh:
        fh.write(TASKS)
    ok(state, "secret", "set", "ddns_token", stdin=SECRET)
    added = ok(state, "task", "add", "-f", f)
    assert b"warning" not in added.stderr, added.stderr
    checks = json.loads(cli(state, "doctor", "--json").stdout)["checks"]
    assert [c["ok"] for c in checks if c["name"] == "secrets"] == [True]
    with open(f, "w") as fh:
        fh.write(TASKS.replace("ddns_token", "other_token").replace('"ddns-update"', '"other-update"'))
    warned = ok(state, "task", "add", "-f", f)
    assert b"uses secret 'other_token', which is not set" in warned.stderr
