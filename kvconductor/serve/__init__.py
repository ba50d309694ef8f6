"""The processes: settings, the command line, the single process, the ``--workers N``
owner and workers, gunicorn."""
