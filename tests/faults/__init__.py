"""The fault suite (see ``tests/faults/conftest.py``)."""
