"""The import graph of ``kvconductor.ingest`` goes one way (docs/design.md, "Ingest").

A payload's walk is source -> tracker -> apply (bounds) -> recognize -> decoder ->
typed ops -> index; each module imports only modules below it in :data:`LAYERS`, so no
module calls back into one the payload already left. Read from the source with ``ast``
(imports inside functions count too); the package-wide rules are tests/test_layers.py's.
"""

from __future__ import annotations

import ast
import pathlib

import kvconductor.ingest

PKG = pathlib.Path(kvconductor.ingest.__file__).parent

#: Top to bottom; a module imports only modules of lower layers (never its own layer).
LAYERS: list[set[str]] = [
    {"subscriber"},  # the manager of the subscriptions' table
    {"sourcecolumns"},  # what a /metrics scrape reads of the subscriptions, column by column
    {"subscription"},  # one source: wires everything below
    {"source", "apply"},  # sockets; the applier (limits, the compiled fast path, typed ops)
    {"recognize", "replay", "storeonly", "poolguard", "pooltargets"},  # a payload's kind; the
    # replay DEALER; a store-only source's bound; engine batches on a pool's URL; where a
    # pool event's blocks land
    {"vllm", "pool"},  # the decoders
    {"tracker", "host", "replicated"},  # sequence policy; the owner's seams; --state-url
    {"liveness", "freshness"},  # down / muted / purged policy; the states behind answers
    # plain data, the poller, the cluster pool's DPs
    {
        "ops",
        "stats",
        "context",
        "thread",
        "http_events",
        "sourcemetrics",
        "poolroute",
        "sharedstore",
        "predicted",
    },
]


def _ingest_imports(path: pathlib.Path) -> set[str]:
    """The ``kvconductor.ingest`` modules ``path`` imports."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("kvconductor.ingest."):
                deps.add(node.module.split(".")[2])
            elif node.module == "kvconductor.ingest":
                deps.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvconductor.ingest."):
                    deps.add(alias.name.split(".")[2])
    return deps


def _graph() -> dict[str, set[str]]:
    return {p.stem: _ingest_imports(p) for p in PKG.glob("*.py") if p.stem != "__init__"}


def test_every_ingest_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(_graph()) == placed


def test_imports_go_down_the_layers_only():
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    wrong = [
        f"{m} (layer {rank[m]}) imports {d} (layer {rank[d]})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if rank[d] <= rank[m]
    ]
    assert wrong == []


def test_no_import_circle():
    graph = _graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        for d in sorted(graph.get(m, ())):
            visit(d, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_the_payload_walk():
    """The pure policies and the decoders import nothing that does I/O or applies; the
    applier reaches the decoders only through recognize."""
    g = _graph()
    assert g["tracker"] <= {"stats"}
    assert g["liveness"] <= {"stats"}
    assert g["replicated"] == set()
    assert g["vllm"] <= {"ops"} and g["pool"] <= {"ops"}
    assert g["recognize"] <= {"ops", "vllm", "pool"}
    top = {"subscriber", "subscription", "sourcecolumns"}
    assert not g["apply"] & {"vllm", "pool", "tracker", "source", *top}
    assert not g["source"] & {"tracker", "apply", "recognize", "vllm", "pool", *top}
