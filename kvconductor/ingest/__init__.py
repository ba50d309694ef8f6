"""The event plane: the ingest thread, ZeroMQ subscribers, decoders and replay."""
