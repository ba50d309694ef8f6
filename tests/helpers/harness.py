"""An ingest thread with a SubscriptionManager over a FakeConductor, for tests that run
real subscriptions over tcp on 127.0.0.1 (tests/test_subscriber.py, tests/test_publishers.py)."""

from __future__ import annotations

import zmq

from kvconductor.ingest.host import IngestSettings
from kvconductor.ingest.subscriber import SubscriptionManager
from kvconductor.ingest.thread import IngestThread
from tests.helpers.publishers import FakeConductor, hits

BS = 4
IID = "vllm-prefill-a"


class Harness:
    def __init__(self) -> None:
        self.conductor = FakeConductor()
        self.thread = IngestThread(context=zmq.Context.instance())
        self.thread.start()
        self.mgr = self.thread.call(
            lambda: SubscriptionManager(
                self.thread, self.conductor, settings=IngestSettings(replay_timeout=5.0)
            ),
            timeout=10,
        )

    def call(self, fn, *a):
        return self.thread.call(fn, *a, timeout=10)

    def subscribe(self, ctx, replay=False):
        self.call(self.mgr.subscribe, ctx)
        if replay:
            self.call(self.mgr.request_replay, ctx)

    def source(self, iid=IID, dp=0, url=None):
        for s in self.call(self.mgr.sources):
            if s["instance_id"] == iid and s["dp_rank"] == dp and (url is None or s["url"] == url):
                return s
        return None

    def index(self, model="m", tenant="t"):
        return self.conductor.indexes.get((model, tenant))

    def hits(self, tokens, model="m", tenant="t"):
        return hits(self.index(model, tenant), tokens, BS)

    def close(self):
        try:
            self.call(self.mgr.close)
        finally:
            self.thread.stop()
