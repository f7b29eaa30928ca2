"""Resolving an image's ``User`` (``name``, ``uid``, ``name:group``, ``uid:gid``) against its own files.

Owns the OCI rules for the ``User`` field: names are looked up in the image's ``/etc/passwd`` and
``/etc/group``, numbers are taken as they are (a uid missing from ``/etc/passwd`` gets gid 0 and home
``/``, as runc does). Files are opened with ``openat2(RESOLVE_IN_ROOT)``, so an image whose
``/etc/passwd`` is a symlink cannot make the host read one of its own files. Never writes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import InvalidRequest
from dsec.images.layers import open_in_root

__all__ = ["ImageUser", "resolve_user"]

_MAX_ID = 65535
_MAX_FILE = 4 << 20


@dataclass(frozen=True)
class ImageUser:
    """Who commands run as in a sandbox of the image."""

    uid: int = 0
    gid: int = 0
    home: str = "/root"


def _entries(root: Path, rel: str) -> list[list[str]]:
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_in_root(root_fd, rel, os.O_RDONLY)
        finally:
            os.close(root_fd)
    except OSError:
        return []
    with open(fd, "rb") as fh:
        text = fh.read(_MAX_FILE).decode(errors="replace")
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _number(text: str, what: str, user: str) -> int:
    value = int(text)
    if not 0 <= value <= _MAX_ID:
        raise InvalidRequest(f"image user {user!r}: {what} {value} is outside 0..{_MAX_ID} (the ids a sandbox's "
                             "user namespace maps)")
    return value


def resolve_user(root: Path, user: str | None) -> ImageUser:
    """The uid, gid and home directory of ``user`` in the image whose root directory is ``root``."""
    if not user:
        return ImageUser()
    name, _, group = user.partition(":")
    passwd = [e for e in _entries(root, "etc/passwd") if len(e) >= 6]
    if name.isdigit():
        uid = _number(name, "uid", user)
        match = next((e for e in passwd if e[2] == name), None)
    else:
        match = next((e for e in passwd if e[0] == name), None)
        if match is None or not match[2].isdigit():
            raise InvalidRequest(f"image user {name!r} is not in the image's /etc/passwd", user=user)
        uid = _number(match[2], "uid", user)
    gid = _number(match[3], "gid", user) if match is not None and match[3].isdigit() else 0
    home = match[5] if match is not None and match[5].startswith("/") else "/"
    if group:
        if group.isdigit():
            gid = _number(group, "gid", user)
        else:
            found = next((e for e in _entries(root, "etc/group") if len(e) >= 3 and e[0] == group), None)
            if found is None or not found[2].isdigit():
                raise InvalidRequest(f"image group {group!r} is not in the image's /etc/group", user=user)
            gid = _number(found[2], "gid", user)
    return ImageUser(uid=uid, gid=gid, home=home)
