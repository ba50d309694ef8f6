"""Build script: the explicit list of compiled modules and their directives.

Only the index (``_tree``, ``_lower``, ``_index``), the block hasher (``_hash``)
and the hot parsers (``_wire`` for query bodies, ``_ingest`` for vLLM event
batches) are compiled. Everything else (Falcon app,
registry, ingest glue) stays plain Python on purpose.

``KVC_DEBUG=1`` turns bounds checks back on, builds with ``-O0 -g`` and
re-cythonizes everything.
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KVC_DEBUG", "") not in ("", "0")

# NOTE: one place for every directive; each .pyx repeats only language_level.
DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

CFLAGS = ["-O0", "-g"] if DEBUG else ["-O3"]
CFLAGS += ["-Wno-unused-function", "-Wno-unreachable-code"]

MODULES = ["_hash", "_tree", "_lower", "_index", "_wire", "_ingest"]


def _ext(name):
    return Extension(
        f"kvconductor.{name}",
        [f"kvconductor/{name}.pyx"],
        extra_compile_args=CFLAGS,
        libraries=["dl"],
    )


setup(
    ext_modules=cythonize(
        [_ext(m) for m in MODULES],
        compiler_directives=DIRECTIVES,
        force=DEBUG,
        nthreads=0,
    ),
)
