"""``ax web``: the operator's console in a browser.

Overview (live nodes and their lanes, queue depths, tasks by status, the oldest overdue
task, the last hour's lateness and start rate), tasks (search, one task with its
attempts, cancel, retry), recurring jobs (pause, resume, run now) and cluster-wide
limits (set, clear). Every page reads and writes through the same library functions as
the admin CLI (``ax status``, ``ax list``, ``ax inspect``, ``ax cancel``, ``ax retry``,
``ax jobs``, ``ax limits``), so the console and the CLI cannot disagree.

Security (:mod:`ax_kombu.web.security`, :mod:`ax_kombu.web.access`): loopback only
unless credentials are configured — ``AX_WEB_TOKEN`` (acts as admin), users of an
``AX_WEB_USERS`` file (:mod:`ax_kombu.web.users`) with their roles (viewer, operator,
admin), or a trusted proxy's ``AX_WEB_TRUSTED_HEADER`` with ``AX_WEB_ROLE_MAP``; with any
of them every page needs a caller; a POST beyond the caller's role is refused (403);
every state change is a POST with a CSRF token and is recorded in ``ax_audit`` under the
caller's name (``/audit``, :mod:`ax_kombu.store.audit`); URLs are redacted as in logs;
everything shown is escaped.

The dependencies (Starlette, Jinja2, uvicorn, python-multipart, argon2-cffi) are the ``web`` extra,
imported only by ``ax web``: ``pip install 'ax_kombu[web]'``. This module imports none.
"""
