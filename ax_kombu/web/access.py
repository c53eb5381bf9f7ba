"""Who a request is: the token, a user of the ``AX_WEB_USERS`` file logged in through the
form, a name a trusted reverse proxy put in ``AX_WEB_TRUSTED_HEADER``, or — with none of
these configured — the loopback client (``local``, admin).

A user's session is an opaque random id (the ``ax_session`` cookie, HttpOnly,
SameSite=Strict) that this process maps to the user's name; their role is looked up in
the users file at every request, so a user removed from the file or given a weaker role
loses that access at once. Sessions live in this process only: a restart logs users out
(the token's cookie, an HMAC of the token, survives it as before). Logging out forgets
the session.

The trusted header is believed as it comes: set it only when every request reaches the
console through a proxy that sets that header itself and drops any copy the client sent.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ax_kombu.web.security import (
    LOCAL_IDENTITY,
    TOKEN_IDENTITY,
    Identity,
    Keys,
    parse_role_map,
    role_of,
)
from ax_kombu.web.users import UsersFile

#: the most sessions kept at once; past it the oldest is forgotten (that user logs in again)
SESSIONS_MAX = 10_000


@dataclass
class Access:
    """The credentials one console process accepts, and its users' sessions."""

    keys: Keys
    users: UsersFile | None = None
    trusted_header: str | None = None
    role_map: dict[str, str] = field(default_factory=dict)
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)

    @classmethod
    def configure(cls, token: str | None, environ: Mapping[str, str]) -> Access:
        """From the token and ``AX_WEB_USERS``, ``AX_WEB_TRUSTED_HEADER`` and
        ``AX_WEB_ROLE_MAP`` in ``environ``.

        Raises:
            ConfigurationError: a malformed users file or role map, or a trusted header
                without a role map.
        """
        from ax_kombu.exceptions import ConfigurationError

        path = environ.get("AX_WEB_USERS", "").strip()
        header = environ.get("AX_WEB_TRUSTED_HEADER", "").strip() or None
        role_map = parse_role_map(environ.get("AX_WEB_ROLE_MAP", ""))
        if header and not role_map:
            raise ConfigurationError("AX_WEB_TRUSTED_HEADER needs AX_WEB_ROLE_MAP, e.g. "
                                     "alice=admin,bob=operator,*=viewer")
        return cls(Keys(token), UsersFile(Path(path)) if path else None, header, role_map)

    @property
    def guarded(self) -> bool:
        """True if anything but loopback guards the console (a token, users, a header)."""
        return bool(self.keys.token or self.users or self.trusted_header)

    def identify(self, cookie: str | None, authorization: str | None,
                 headers: Mapping[str, str]) -> Identity | None:
        """Who sends a request with this cookie, Authorization header and headers (None:
        nobody the console lets in)."""
        if not self.guarded:
            return LOCAL_IDENTITY
        if self.keys.token and self.keys.allowed(cookie, authorization):
            return TOKEN_IDENTITY
        if cookie and self.users is not None:
            name = self._session(cookie)
            if name is not None:
                return self.users.identity(name)
        if self.trusted_header:
            name = headers.get(self.trusted_header, "").strip()
            if name:
                return role_of(self.role_map, name)
        return None

    def _session(self, cookie: str) -> str | None:
        # a dict lookup: the ids are 256 random bits, not guessable by timing
        return self._sessions.get(cookie)

    def log_in(self, name: str, password: str) -> str | None:
        """A new session id for user ``name`` if ``password`` is theirs, else None."""
        if self.users is None or self.users.check(name, password) is None:
            return None
        session = secrets.token_urlsafe(32)
        self._sessions[session] = name
        while len(self._sessions) > SESSIONS_MAX:
            self._sessions.popitem(last=False)
        return session

    def log_out(self, cookie: str | None) -> None:
        """Forget the session ``cookie`` names (nothing for the token's cookie)."""
        if cookie:
            self._sessions.pop(cookie, None)
