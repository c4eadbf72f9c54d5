"""Credentials out of what is logged or shown: one definition of how a URL's password is masked."""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^/\s]*@")


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` URL in it masked.

    >>> redact("postgresql+psycopg://spade:s3cret@db:5432/spade")
    'postgresql+psycopg://spade:***@db:5432/spade'
    >>> redact("redis://:p@ss@cache:6379/0 and redis://cache:6379/0")
    'redis://:***@cache:6379/0 and redis://cache:6379/0'
    """
    return _URL_PASSWORD.sub(r"\1***@", text)
