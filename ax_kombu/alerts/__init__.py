"""Per-type alerts (issue 40): "tell the coupons team when ``coupon.grant`` fails or starts
30 s late", as a signed webhook.

* :mod:`~ax_kombu.alerts.rules` — what an alert is and how it is checked
  (``ax.set_alert``): the events it watches (``failed``, ``late``), ``late_after``, the
  webhook, the signing secret (a Standard Webhooks ``whsec_`` key).
* :mod:`~ax_kombu.alerts.signing` — Standard Webhooks signatures (``webhook-id``,
  ``webhook-timestamp``, ``webhook-signature``), for alerts and callback tasks alike.
* :mod:`~ax_kombu.alerts.evaluator` — the scheduler's pass over the alerts: one
  notification when an incident opens, one when a quiet period closes it.
* :mod:`~ax_kombu.alerts.delivery` — the POSTs, retried with back-off on a thread of
  their own, so that no scheduler loop waits on a receiver.
"""
