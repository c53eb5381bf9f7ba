"""The image's HEALTHCHECK: GET the process's ``/healthz`` and exit 0 on 200, 1 otherwise.

The URL is ``AX_HEALTH_URL`` when set (``ax web``: ``http://127.0.0.1:5555/healthz``), else
``/healthz`` on the daemon's metrics port (``AX_METRICS_PORT``; the image sets 9108). It
prints the probe's one-line answer, which ``docker inspect`` shows. Standard library only:
it runs in the image's Python without the package.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def probe_url(env: dict[str, str]) -> str | None:
    """The URL to probe, or None when the process serves no probe (metrics port 0 or unset)."""
    if env.get("AX_HEALTH_URL"):
        return env["AX_HEALTH_URL"]
    port = env.get("AX_METRICS_PORT", "").strip()
    if not port.isdigit() or int(port) == 0:
        return None
    return f"http://127.0.0.1:{int(port)}/healthz"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a pass: a console's login page must not count as healthy."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def check(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """Whether ``url`` answered 200 itself, and its first line (or why it could not be read)."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=timeout_s) as answer:
            return answer.status == 200, first_line(answer.read(512))
    except urllib.error.HTTPError as exc:  # 503 and any other status
        return False, f"{exc.code} {first_line(exc.read(512))}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"


def first_line(body: bytes) -> str:
    lines = body.decode(errors="replace").strip().splitlines()
    return lines[0] if lines else ""


def main() -> int:
    url = probe_url(dict(os.environ))
    if url is None:
        print("no probe: set AX_METRICS_PORT (a daemon) or AX_HEALTH_URL (ax web)")
        return 1
    healthy, line = check(url)
    print(line)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
