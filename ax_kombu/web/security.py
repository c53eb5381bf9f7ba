"""Who may use the console, and which POSTs are genuine. Standard library only, so
``ax web`` checks its address before it imports the web framework.

* **Where it listens** (:func:`check_bind`): a loopback address needs nothing; any other
  address needs ``AX_WEB_TOKEN``, or ``ax web`` refuses to start.
* **Who** (:class:`Keys`): with a token, a request carries either ``Authorization: Bearer
  <token>`` or the session cookie the login form sets (HttpOnly, SameSite=Strict), whose
  value is an HMAC of the token — the token itself never sits in a cookie. Without a
  token only loopback clients reach the console, and only under a loopback host name
  (a page of another site that rebinds its DNS name to 127.0.0.1 is refused).
* **Which role** (:class:`Identity`): ``viewer`` reads, ``operator`` also cancels,
  retries, runs now, postpones and pauses, ``admin`` also sets limits (and everything
  later added for admins). The token, and a console open to loopback without any
  credentials, act as ``admin``; users come from the ``AX_WEB_USERS`` file
  (:mod:`ax_kombu.web.users`) or a trusted proxy's header mapped by
  :func:`parse_role_map`. A POST beyond the caller's role is refused (403) before its form
  is read.
* **What** (:meth:`Keys.csrf_ok`): every state change is a POST whose form carries the
  CSRF token the pages embed — an HMAC of a secret drawn when the process starts. A
  page of another origin can neither read it nor guess it, so its forged POST is
  refused (403) before anything is read or written.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass

from ax_kombu.exceptions import ConfigurationError

#: the host names (without port) a console without a token answers to
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
SESSION_COOKIE = "ax_session"
CSRF_FIELD = "csrf"
#: the roles, weakest first: each may do what the ones before it may
ROLES = ("viewer", "operator", "admin")
#: a user name: letters, digits and ``.`` ``_`` ``@`` ``-``, at most 128 (the audit's actor)
NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")


def check_role(role: str) -> str:
    """``role`` if it is one of :data:`ROLES`.

    Raises:
        ConfigurationError: it is not.
    """
    if role not in ROLES:
        raise ConfigurationError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    return role


def check_name(name: str) -> str:
    """``name`` if it is a valid user name (:data:`NAME`).

    Raises:
        ConfigurationError: it is not.
    """
    if not NAME.fullmatch(name):
        raise ConfigurationError(f"bad user name {name!r}: 1 to 128 letters, digits, "
                                 "'.', '_', '@' or '-'")
    return name


@dataclass(frozen=True)
class Identity:
    """Who a request acts as: the audit's actor and the role its POSTs are checked against."""

    name: str
    role: str

    def may(self, role: str) -> bool:
        """True if this identity's role is ``role`` or a stronger one."""
        return ROLES.index(self.role) >= ROLES.index(role)


#: the token's identity (a login with it, or ``Authorization: Bearer``)
TOKEN_IDENTITY = Identity("token", "admin")
#: a console with no credentials at all answers loopback clients only, as this identity
LOCAL_IDENTITY = Identity("local", "admin")


def parse_role_map(text: str) -> dict[str, str]:
    """``AX_WEB_ROLE_MAP``: comma-separated ``NAME=ROLE`` pairs, ``*=ROLE`` for every name
    not listed (without it, a name not listed is refused). Spaces around items are ignored.

    Raises:
        ConfigurationError: an item without ``=``, a bad name, a name given twice, or an
            unknown role.
    """
    found: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, role = (p.strip() for p in item.partition("="))
        if not eq:
            raise ConfigurationError(f"AX_WEB_ROLE_MAP: {item!r} is not NAME=ROLE "
                                     "(e.g. alice=admin,bob=operator,*=viewer)")
        if name != "*":
            check_name(name)
        if name in found:
            raise ConfigurationError(f"AX_WEB_ROLE_MAP: {name!r} is given twice")
        try:
            found[name] = check_role(role)
        except ConfigurationError as exc:
            raise ConfigurationError(f"AX_WEB_ROLE_MAP: {exc}") from None
    return found


def role_of(role_map: dict[str, str], name: str) -> Identity | None:
    """The identity a trusted header's ``name`` maps to (None: not allowed in)."""
    role = role_map.get(name, role_map.get("*"))
    if role is None or not NAME.fullmatch(name):
        return None
    return Identity(name, role)


def is_loopback(bind: str) -> bool:
    """True for ``localhost`` and any loopback IP address (127.0.0.0/8, ::1)."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, token: str | None, *, users: bool = False) -> None:
    """``users``: a users file or a trusted header is configured (either guards the
    console as the token does).

    Raises:
        ConfigurationError: ``bind`` is not a loopback address and nothing guards it.
    """
    if not token and not users and not is_loopback(bind):
        raise ConfigurationError(f"refusing to serve the console on {bind} without "
                                 "AX_WEB_TOKEN (or AX_WEB_USERS, AX_WEB_TRUSTED_HEADER): "
                                 "set one, or bind 127.0.0.1")


def _mac(key: str, label: str) -> str:
    return hmac.new(key.encode(), label.encode(), hashlib.sha256).hexdigest()


class Keys:
    """The token (None: open to loopback clients), the session cookie's value and the
    CSRF token of one console process."""

    def __init__(self, token: str | None) -> None:
        self.token = token or None
        self.session = _mac(self.token, "ax-web-session") if self.token else ""
        self.csrf = _mac(secrets.token_hex(32), "ax-web-csrf")

    def token_ok(self, given: str) -> bool:
        """True if ``given`` is the token (compared in constant time)."""
        return self.token is not None and hmac.compare_digest(given.encode(),
                                                              self.token.encode())

    def allowed(self, cookie: str | None, authorization: str | None) -> bool:
        """True if a request with this session cookie and Authorization header may in."""
        if self.token is None:
            return True
        if cookie and hmac.compare_digest(cookie.encode(), self.session.encode()):
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(given.strip())

    def csrf_ok(self, given: object) -> bool:
        """True if a form's CSRF field is this process's token."""
        return isinstance(given, str) and hmac.compare_digest(given.encode(),
                                                              self.csrf.encode())
