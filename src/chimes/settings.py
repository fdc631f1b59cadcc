"""Settings shared by every role, read once at start-up and frozen afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import platformdirs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("chimes"))


@dataclass(frozen=True, slots=True)
class Settings:
    """Where the database is and where the API listens.

    ``database_url`` of ``None`` means the embedded PostgreSQL in ``data_dir``.
    """

    database_url: str | None = None
    data_dir: Path = Path()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT

    @property
    def uses_embedded_database(self) -> bool:
        return self.database_url is None
