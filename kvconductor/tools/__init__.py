"""Operator tools: ``kv-conductor top`` and ``kv-conductor explain``."""
