"""Who may use the console, and which POSTs are genuine. Standard library only, so
``ax web`` checks its address before it imports the web framework.

* **Where it listens** (:func:`check_bind`): a loopback address needs nothing; any other
  address needs ``AX_WEB_TOKEN``, or ``ax web`` refuses to start.
* **Who** (:class:`Keys`): with a token, a request carries either ``Authorization: Bearer
  <token>`` or the session cookie the login form sets (HttpOnly, SameSite=Strict), whose
  value is an HMAC of the token — the token itself never sits in a cookie. Without a
  token only loopback clients reach the console, and only under a loopback host name
  (a page of another site that rebinds its DNS name to 127.0.0.1 is refused).
* **What** (:meth:`Keys.csrf_ok`): every state change is a POST whose form carries the
  CSRF token the pages embed — an HMAC of a secret drawn when the process starts. A
  page of another origin can neither read it nor guess it, so its forged POST is
  refused (403) before anything is read or written.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from ax_kombu.exceptions import ConfigurationError

#: the host names (without port) a console without a token answers to
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
SESSION_COOKIE = "ax_session"
CSRF_FIELD = "csrf"


def is_loopback(bind: str) -> bool:
    """True for ``localhost`` and any loopback IP address (127.0.0.0/8, ::1)."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, token: str | None) -> None:
    """Raises:
    ConfigurationError: ``bind`` is not a loopback address and there is no token.
    """
    if not token and not is_loopback(bind):
        raise ConfigurationError(f"refusing to serve the console on {bind} without "
                                 "AX_WEB_TOKEN: set it, or bind 127.0.0.1")


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
