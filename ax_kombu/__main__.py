"""``python -m ax_kombu …`` is ``ax …`` (e.g. ``python -m ax_kombu web``)."""

from ax_kombu.cli import main

main(prog_name="ax")
