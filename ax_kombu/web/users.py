"""The console's users file (``AX_WEB_USERS``), written by ``ax web adduser``.

One user per line, ``NAME:ROLE:HASH`` — ``HASH`` an argon2id hash in its PHC string form
(``$argon2id$v=19$m=…,t=…,p=…$salt$hash``, from the ``argon2-cffi`` library with its
default parameters); blank lines and lines starting with ``#`` are ignored. A malformed
line, an unknown role or a name given twice makes the whole file refused, with its line
number, so a typo never silently locks a user out or lets one in.

:func:`add_user` rewrites the file atomically (a temporary file in the same directory,
mode 0600, fsync-ed, then renamed over the old one), so a reader sees the old file or the
new one, never half of one. :class:`UsersFile` reads it again when its modification time
changes: a user removed or demoted by hand loses their access at their next request.

``argon2-cffi`` is part of the ``web`` extra; it is imported only to hash or verify.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ax_kombu.exceptions import ConfigurationError
from ax_kombu.web.security import Identity, check_name, check_role

HEADER = ("# ax web users (ax web adduser NAME --role viewer|operator|admin)\n"
          "# NAME:ROLE:ARGON2 HASH\n")


@dataclass(frozen=True)
class User:
    name: str
    role: str
    hash: str


def _hasher() -> Any:
    try:
        from argon2 import PasswordHasher
    except ImportError:
        raise ConfigurationError("the console's users need argon2-cffi, which is not "
                                 "installed: pip install 'ax_kombu[web]'") from None
    return PasswordHasher()


def hash_password(password: str) -> str:
    """An argon2id hash of ``password``.

    Raises:
        ConfigurationError: the password is empty, or argon2-cffi is not installed.
    """
    if not password:
        raise ConfigurationError("the password must not be empty")
    return str(_hasher().hash(password))


def parse(text: str, where: str = "AX_WEB_USERS") -> dict[str, User]:
    """The users a file's ``text`` holds, by name.

    Raises:
        ConfigurationError: a malformed line (its number given), an unknown role, a bad
            or repeated name.
    """
    users: dict[str, User] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, role, hashed = (line.split(":", 2) + ["", ""])[:3]
        try:
            if not hashed.startswith("$argon2"):
                raise ConfigurationError("not NAME:ROLE:ARGON2 HASH")
            user = User(check_name(name), check_role(role), hashed)
            if name in users:
                raise ConfigurationError(f"user {name!r} is given twice")
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where} line {number}: {exc}") from None
        users[name] = user
    return users


def load(path: Path) -> dict[str, User]:
    """The users in the file ``path`` (none if it does not exist).

    Raises:
        ConfigurationError: the file cannot be read or is malformed (:func:`parse`).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the users file {path}: {exc}") from None
    return parse(text, str(path))


def render(users: dict[str, User]) -> str:
    return HEADER + "".join(f"{u.name}:{u.role}:{u.hash}\n" for u in users.values())


def add_user(path: Path, name: str, role: str, password: str) -> bool:
    """Add user ``name`` with ``role`` and ``password`` to the file ``path`` (created if
    missing), or replace their role and password; returns True if they were new.

    Raises:
        ConfigurationError: a bad name, an unknown role, an empty password, a malformed
            existing file (left as it was), or the file cannot be written.
    """
    check_name(name)
    check_role(role)
    users = load(path)
    created = name not in users
    users[name] = User(name, role, hash_password(password))
    write_atomically(path, render(users))
    return created


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: mode 0600, fsync-ed, renamed into place."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    except OSError as exc:
        raise ConfigurationError(f"cannot write the users file {path}: {exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class UsersFile:
    """The users of ``path``, read again when the file's modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._users: dict[str, User] = {}
        self.users()  # a malformed file refuses the console's start

    def users(self) -> dict[str, User]:
        """The current users.

        Raises:
            ConfigurationError: the file became malformed (the start-up check); a later
                read that fails keeps the users read before.
        """
        try:
            info = self.path.stat()
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        if stamp != self._stamp:
            self._users = load(self.path)
            self._stamp = stamp
        return self._users

    def identity(self, name: str) -> Identity | None:
        """The identity of user ``name`` now (None: no such user any more)."""
        try:
            user = self.users().get(name)
        except ConfigurationError:
            user = self._users.get(name)
        return None if user is None else Identity(user.name, user.role)

    def check(self, name: str, password: str) -> Identity | None:
        """The identity of ``name`` if ``password`` is theirs (argon2 verification; an
        unknown name costs one verification too, so timing does not tell names apart)."""
        hasher = _hasher()
        from argon2.exceptions import InvalidHashError, VerificationError

        user = self.users().get(name)
        try:
            hasher.verify(user.hash if user else _DECOY.hash_for(hasher), password)
        except (VerificationError, InvalidHashError):
            return None
        return None if user is None else Identity(user.name, user.role)


class _Decoy:
    """A hash of a random password, made once, verified for unknown names."""

    def __init__(self) -> None:
        self._hash: str | None = None

    def hash_for(self, hasher: Any) -> str:
        if self._hash is None:
            self._hash = str(hasher.hash(os.urandom(16).hex()))
        return self._hash


_DECOY = _Decoy()
