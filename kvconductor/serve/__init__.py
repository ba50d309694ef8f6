"""The processes: settings, the command line, the composition root (``bootstrap``), the
single process, the ``--workers N`` owner (supervision), workers and their client of the
owner (``proxy``), gunicorn."""
