"""Web page logins: the cookie holds a random session id, the database only its SHA-256.

A part of ``SqlStore`` (it mixes these methods in). A stolen database therefore opens no session,
a logout deletes the row, and expired rows are purged whenever a session is created.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from services.memory.store.models import WebSessionRow
from services.memory.store.pages import as_utc, utc_now


class WebSessions:
    """Server-side web sessions (mixed into ``SqlStore``)."""

    _sessions: sessionmaker[Session]

    # -- web sessions -----------------------------------------------------------------------------

    def create_session(self, tenant: str, ttl_s: float) -> str:
        """A new web session of ``tenant``: returns its id (the cookie's value); only its hash is kept."""
        session_id = secrets.token_urlsafe(32)
        now = utc_now()
        with self._sessions.begin() as s:
            s.execute(delete(WebSessionRow).where(WebSessionRow.expires_at < now))
            s.add(
                WebSessionRow(
                    id_sha256=hashlib.sha256(session_id.encode()).hexdigest(),
                    tenant=tenant,
                    created_at=now,
                    expires_at=now + timedelta(seconds=ttl_s),
                )
            )
        return session_id

    def session_tenant(self, session_id: str) -> str | None:
        """The tenant of a live session, ``None`` for an unknown, ended or expired one."""
        if not session_id:
            return None
        with self._sessions() as s:
            row = s.get(WebSessionRow, hashlib.sha256(session_id.encode()).hexdigest())
            if row is None or as_utc(row.expires_at) <= utc_now():
                return None
            return row.tenant

    def end_session(self, session_id: str) -> None:
        """Log a web session out (nothing happens for an unknown one)."""
        with self._sessions.begin() as s:
            s.execute(
                delete(WebSessionRow).where(WebSessionRow.id_sha256 == hashlib.sha256(session_id.encode()).hexdigest())
            )
