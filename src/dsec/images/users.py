"""Resolving a sandbox's default user (``SandboxSpec.user``, else the image's ``User``) against the image's files.

Owns reading an image's ``/etc/passwd`` and ``/etc/group`` for that: the files are opened with
``openat2(RESOLVE_IN_ROOT)``, so an image whose ``/etc/passwd`` is a symlink cannot make the host read one
of its own files. The rules (names, numbers, groups) are :mod:`dsec.accounts`'. Never writes anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsec.accounts import ROOT, Identity, resolve_identity
from dsec.errors import InvalidRequest, UserNotFound
from dsec.images.layers import open_in_root

__all__ = ["image_file", "resolve_user"]

_MAX_FILE = 4 << 20


def image_file(root: Path, rel: str) -> str:
    """The text of ``rel`` in the image rooted at ``root`` ("" when it is missing or unreadable)."""
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_in_root(root_fd, rel, os.O_RDONLY)
        finally:
            os.close(root_fd)
    except OSError:
        return ""
    with open(fd, "rb") as fh:
        return fh.read(_MAX_FILE).decode(errors="replace")


def resolve_user(root: Path, user: str | None) -> Identity:
    """The identity ``user`` names in the image whose root directory is ``root`` (root when None). A name the
    image lacks is the create's bad input (:class:`~dsec.errors.InvalidRequest` naming the image's files)."""
    if not user:
        return ROOT
    try:
        return resolve_identity(image_file(root, "etc/passwd"), image_file(root, "etc/group"), user)
    except UserNotFound as e:
        raise InvalidRequest(f"user {user!r} is not in the image's /etc/passwd or /etc/group ({e}): "
                             "set SandboxSpec.user or the image's USER to one it has", user=user) from e
