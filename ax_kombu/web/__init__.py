"""``ax web``: the operator's console in a browser.

Overview (live nodes and their lanes, queue depths, tasks by status, the oldest overdue
task, the last hour's lateness and start rate), tasks (search, one task with its
attempts, cancel, retry), recurring jobs (pause, resume, run now) and cluster-wide
limits (set, clear). Every page reads and writes through the same library functions as
the admin CLI (``ax status``, ``ax list``, ``ax inspect``, ``ax cancel``, ``ax retry``,
``ax jobs``, ``ax limits``), so the console and the CLI cannot disagree.

Security (:mod:`ax_kombu.web.security`): loopback only unless ``AX_WEB_TOKEN`` is set;
with it every page needs the token; every state change is a POST with a CSRF token;
URLs are redacted as in logs; everything shown is escaped.

The dependencies (Starlette, Jinja2, uvicorn, python-multipart) are the ``web`` extra,
imported only by ``ax web``: ``pip install 'ax_kombu[web]'``. This module imports none.
"""
