"""Standard Webhooks signatures (https://www.standardwebhooks.com), made with the
``standardwebhooks`` library, for alert notifications and callback tasks.

Every signed request carries ``webhook-id`` (the message's id: the same on every retry of
one message, so a receiver can drop a repeat), ``webhook-timestamp`` (unix seconds at the
send) and ``webhook-signature`` (``v1,`` + base64 of the HMAC-SHA256 of
``id.timestamp.body``). A receiver checks them with any Standard Webhooks library::

    from standardwebhooks import Webhook
    Webhook(secret).verify(raw_body, headers)   # raises if forged, altered or stale

The key is ``whsec_`` + base64 of the key bytes. A callback secret
(``AX_CALLBACK_SECRET``) without that prefix is used as its UTF-8 bytes (receivers pass
``Webhook(secret.encode())``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from standardwebhooks import Webhook


def signer(secret: str) -> Webhook:
    """The signer of ``secret`` (``whsec_…``, or any other text as its UTF-8 bytes)."""
    return Webhook(secret if secret.startswith("whsec_") else secret.encode())


def headers(webhook: Webhook, message_id: str, body: bytes, now_s: float) -> dict[str, str]:
    """The three Standard Webhooks headers of ``body`` sent as ``message_id`` at ``now_s``."""
    at = datetime.fromtimestamp(int(now_s), tz=UTC)
    return {"webhook-id": message_id, "webhook-timestamp": str(int(now_s)),
            "webhook-signature": webhook.sign(message_id, at, body)}
