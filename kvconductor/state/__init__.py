"""The state of the service: the conductor (the single writer), the journal every HTTP
mutation goes through, the declared seams (``protocols``), registrations, the shared
index of ``--workers N``, dumps, snapshots and replication."""
