"""Who a command or a file operation acts as inside a sandbox: naming users and resolving them.

Owns the rules for a ``user=`` value (``name``, ``uid``, ``name:group``, ``uid:gid``, and mixes), the same
as Docker's and runc's: a name is looked up in the sandbox's ``/etc/passwd``, a number is taken as it is
(a uid missing from ``/etc/passwd`` gets gid 0 and home ``/``), a group by name in ``/etc/group``, and a
user found in ``/etc/passwd`` also gets the supplementary groups that list it. Ids must fit the 65,536 a
sandbox's user namespace maps. This module parses text it is given and never reads a file itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.errors import InvalidRequest, UserNotFound

__all__ = ["MAX_ID", "ROOT", "Identity", "parse_user", "resolve_identity"]

MAX_ID = 65535
"""The highest uid or gid a sandbox's user namespace maps."""


@dataclass(frozen=True)
class Identity:
    """A resolved user: the ids a command runs with and a file operation is checked against."""

    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()
    """Supplementary groups (without ``gid``)."""
    home: str = "/root"
    name: str | None = "root"
    """The passwd name, None for a uid that has no entry."""
    shell: str = "/bin/sh"

    @property
    def is_root(self) -> bool:
        """uid 0: the sandbox's root, whose file operations are not checked against permission bits."""
        return self.uid == 0


ROOT = Identity()


def parse_user(value: str) -> tuple[str, str | None]:
    """``(user, group)`` of a ``user=`` value; :class:`InvalidRequest` naming what is wrong with it."""
    if not isinstance(value, str) or not value or len(value) > 256 or any(c in value for c in "\0\n/ "):
        raise InvalidRequest(f"user must be a name or uid, optionally with ':group' or ':gid' (as in 'agent', "
                             f"'1000', '1000:1000'), got {value!r}", user=value)
    user, sep, group = value.partition(":")
    if not user or (sep and not group) or ":" in group:
        raise InvalidRequest(f"user must look like NAME, UID, NAME:GROUP or UID:GID, got {value!r}", user=value)
    return user, group if sep else None


def _table(text: str, fields: int) -> list[list[str]]:
    rows = (line.split(":") for line in text.splitlines() if line and not line.startswith(("#", "+", "-")))
    return [row for row in rows if len(row) >= fields]


def _number(text: str, what: str, value: str) -> int:
    number = int(text)
    if not 0 <= number <= MAX_ID:
        raise InvalidRequest(f"user {value!r}: {what} {number} is outside 0..{MAX_ID} (the ids a sandbox's user "
                             "namespace maps)", user=value)
    return number


def resolve_identity(passwd: str, group: str, value: str | None) -> Identity:
    """The identity ``value`` names in a sandbox whose ``/etc/passwd`` and ``/etc/group`` read ``passwd`` and
    ``group`` (either may be empty). ``None`` or ``""`` is root. :class:`~dsec.errors.UserNotFound` names a
    user or group that is not there."""
    if not value:
        value = "root"
    name, group_name = parse_user(value)
    users = _table(passwd, 7)
    if name.isdigit():
        uid = _number(name, "uid", value)
        entry = next((row for row in users if row[2] == name), None)
    else:
        entry = next((row for row in users if row[0] == name), None)
        if name == "root" and entry is None:
            uid = 0  # every system's uid 0, even an image without /etc/passwd
        elif entry is None or not entry[2].isdigit():
            raise UserNotFound(f"unable to find user {name}: no matching entries in passwd file", user=value)
        else:
            uid = _number(entry[2], "uid", value)
    gid = _number(entry[3], "gid", value) if entry is not None and entry[3].isdigit() else 0
    groups = _table(group, 3)
    if group_name is not None:
        if group_name.isdigit():
            gid = _number(group_name, "gid", value)
        else:
            found = next((row for row in groups if row[0] == group_name and row[2].isdigit()), None)
            if found is None:
                raise UserNotFound(f"unable to find group {group_name}: no matching entries in group file",
                                   user=value)
            gid = _number(found[2], "gid", value)
    extra: tuple[int, ...] = ()
    if entry is not None and group_name is None:
        members = (row for row in groups if len(row) >= 4 and entry[0] in row[3].split(","))
        extra = tuple(sorted({int(row[2]) for row in members if row[2].isdigit() and int(row[2]) <= MAX_ID} - {gid}))
    home = entry[5] if entry is not None and entry[5].startswith("/") else "/root" if uid == 0 else "/"
    shell = entry[6] if entry is not None and entry[6].startswith("/") else "/bin/sh"
    named = entry[0] if entry is not None else "root" if uid == 0 else None
    return Identity(uid=uid, gid=gid, groups=extra, home=home, name=named, shell=shell)
