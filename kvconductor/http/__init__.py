"""The HTTP front: the Falcon resources, the query fast path, limits, OpenAPI, metrics.
Imports nothing of :mod:`kvconductor.serve`."""
