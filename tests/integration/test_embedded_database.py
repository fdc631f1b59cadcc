"""The embedded PostgreSQL is Chimes' alone: another local user cannot reach it, nobody gets in without
the generated password, and data dirs made by older versions (which trusted every local connection)
are locked on their next start."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest

from chimes.store.embedded import DATABASE, SERVER_SETTINGS, EmbeddedPostgres, pg

# Run by another user with the system's Python: speaks the start of the PostgreSQL protocol over the
# socket and says how far it got. "trust" would mean a superuser session without any password.
PROBE = r"""
import socket, struct, sys
path = sys.argv[1]
try:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
except OSError as exc:
    print("refused:", type(exc).__name__)
    sys.exit(0)
params = b"user\0postgres\0database\0chimes\0\0"
sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
kind, _, code = struct.unpack("!cii", sock.recv(9))
print("trust" if kind == b"R" and code == 0 else f"asked for a password ({kind!r} {code})")
"""


@pytest.fixture
def other_user() -> Iterator[str]:
    """A second local account, removed after the test."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("cannot create a second local user to try the database with (needs root, useradd and "
                    "runuser); this suite checks it when run as root")
    name = f"chimes-probe-{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def socket_of(dsn: str) -> Path:
    return Path(parse_qs(urlsplit(dsn).query)["host"][0]) / ".s.PGSQL.5432"


def probe_as(user: str, socket_path: Path) -> str:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    done = subprocess.run(["runuser", "-u", user, "--", python, "-c", PROBE, str(socket_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def assert_only_chimes_gets_in(dsn: str, user: str) -> None:
    socket_path = socket_of(dsn)
    assert socket_path.exists()
    assert probe_as(user, socket_path) == "refused: PermissionError"
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    # Past the folder (root here), the server still wants the password.
    without_password = dsn.replace(f":{urlsplit(dsn).password}@", "@")
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(without_password)
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT current_user") == "postgres"
    finally:
        await conn.close()


@pytest.fixture
def data_dir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="chimes-test-embedded-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_another_local_user_cannot_reach_the_database(other_user: str, data_dir: Path) -> None:
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire()
    try:
        await assert_only_chimes_gets_in(dsn, other_user)
        password = urlsplit(dsn).password
        assert password and server.password_file.read_text().strip() == password
        assert stat.S_IMODE(server.password_file.stat().st_mode) == 0o600
        assert password not in (server.pgdata / "server.log").read_text()
    finally:
        server.release()


def make_trusting_data_dir(data_dir: Path) -> None:
    """A data dir as Chimes made them before passwords: trust for every local connection, an open
    socket folder, no password file."""
    server = EmbeddedPostgres(data_dir)
    server.pgdata.mkdir(mode=0o700)
    server._grant_system_user()
    pg.initdb(["--auth=trust", "--encoding=UTF8", "--locale=C", "-U", "postgres"], pgdata=server.pgdata,
              user=server._run_as, timeout=120)
    lines = [f"{key} = {value}" for key, value in SERVER_SETTINGS.items()]
    lines.append(f"unix_socket_directories = '{server.socket_dir}'")
    with (server.pgdata / "postgresql.conf").open("a") as conf:
        conf.write("\n# chimes\n" + "\n".join(lines) + "\n")
    server._start()
    subprocess.run([str(pg.POSTGRES_BIN_PATH / "createdb"), "-h", str(server.socket_dir), "-U", "postgres",
                    DATABASE], check=True, capture_output=True, timeout=60)
    server.stop()
    server.socket_dir.chmod(0o777)


async def test_a_data_dir_that_trusted_everyone_requires_the_password_after_an_upgrade(
    other_user: str, data_dir: Path,
) -> None:
    make_trusting_data_dir(data_dir)
    password_file = data_dir / "postgres.password"
    assert not password_file.exists()
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire()
    try:
        await assert_only_chimes_gets_in(dsn, other_user)
        assert "trust" not in (server.pgdata / "pg_hba.conf").read_text()
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        # Another process on the same data dir (the server already runs) gets the same password.
        assert EmbeddedPostgres(data_dir).acquire() == dsn
        EmbeddedPostgres(data_dir).release(stop_if_last=False)
    finally:
        server.release()
