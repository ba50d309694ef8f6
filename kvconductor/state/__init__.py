"""The state of the service: the conductor (the single writer), registrations, the
shared index of ``--workers N``, dumps, snapshots and replication."""
