"""A throw-away PostgreSQL server for the tests: ``initdb`` into a temporary folder, then
``pg_ctl start`` on a free loopback port (unix socket in that folder too).

PostgreSQL refuses to run as root: as root the server runs as the user ``nobody`` (through
``runuser``).  Where no PostgreSQL server is installed, :func:`find_postgres` says why and the
tests that need one skip with that message.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from api_testlib import free_port

SUPERUSER = "postgres"


def find_postgres() -> tuple[Path | None, str]:
    """The folder of ``initdb``/``pg_ctl``, or ``None`` and why not."""
    candidates = [shutil.which("initdb"), *sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)]
    for initdb in candidates:
        if initdb and os.access(initdb, os.X_OK):
            folder = Path(initdb).parent
            if (folder / "pg_ctl").exists():
                return folder, ""
    return None, (
        "no PostgreSQL server here (initdb and pg_ctl not on PATH nor in /usr/lib/postgresql/*/bin): "
        "install it (Debian: apt-get install postgresql) to run the PostgreSQL store tests"
    )


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder: ``start()``, ``url(db)``, ``stop()``."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="pgpp"))  # short: a unix socket path is at most 107 bytes
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._run_as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, user="nobody")
            self._run_as = ["runuser", "-u", "nobody", "--"]
        self._databases = 0

    def _pg(self, tool: str, *args: str, timeout: float = 60.0) -> None:
        proc = subprocess.run(
            [*self._run_as, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{log}")

    def init(self) -> None:
        self._pg("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--no-sync",
                 "--no-instructions")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=on -c full_page_writes=off -c max_connections=200 -c shared_buffers=32MB"
        )
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start")

    def stop(self, *, mode: str = "fast") -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def remove(self) -> None:
        try:
            self.stop(mode="immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
