"""Build script: the explicit list of compiled modules and their directives.

Only the index (``_tree``, ``_lower``, ``_index``), the block hasher (``_hash``),
the structure allocator (``_alloc``), the hot parsers and encoder (``_wire`` for
query bodies, ``_encode`` for query responses, ``_ingest`` for vLLM event batches) and
the shared-memory arena and cross-process lock of the multi-process design
(``_arena``, ``_shlock``) and the ZeroMQ receive of the ingest thread (``_recv``) are
compiled. Everything else
(Falcon app, registry, ingest glue) stays plain Python on purpose.

The extensions list their ``.pyx`` sources and are cythonized by ``build_ext``
at build time (Cython is a build requirement), so ``sdist`` ships the ``.pyx``
files and never generated C.

``KVC_DEBUG=1`` turns bounds checks back on, builds with ``-O0 -g`` and
re-cythonizes everything.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

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
# -Wall (Python's own CFLAGS carry it, and -Wsign-compare, already): every warning is
# shown and ours are fixed. Nothing is silenced: the Cython 3 boilerplate of these
# modules compiles without warnings under -Wall on gcc (unused helpers are marked
# CYTHON_UNUSED; gcc ignores -Wunreachable-code, which the old flags silenced).
CFLAGS += ["-Wall"]

MODULES = [
    "_hash",
    "_alloc",
    "_tree",
    "_lower",
    "_index",
    "_wire",
    "_encode",
    "_ingest",
    "_arena",
    "_shlock",
    "_recv",
]


def _ext(name):
    return Extension(
        f"kvconductor.{name}",
        [f"kvconductor/{name}.pyx"],
        extra_compile_args=CFLAGS,
        # The C of the core lives in real headers, kvconductor/c/*.h, included as
        # "kvconductor/c/x.h" from the source root (pip and build_ext run there).
        include_dirs=["."],
        libraries=["dl"],
    )


class build_ext(_build_ext):
    """Cythonize the ``.pyx`` sources right before compiling them, on every core.

    Without ``--parallel``/``-j`` the modules are cythonized and compiled in parallel,
    one job per CPU (eleven modules; ``pip install`` and CI build them several times).
    """

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        from Cython.Build import cythonize

        # Not in finalize_options: sdist finalizes build_ext to list the sources and
        # must see the .pyx files. cythonize() returns new Extension objects; only
        # their sources (.pyx -> .c) are taken, setuptools' own state stays on ours.
        generated = {
            e.name: e.sources
            for e in cythonize(
                self.extensions,
                compiler_directives=DIRECTIVES,
                force=DEBUG or self.force,
                nthreads=self.parallel if self.parallel > 1 else 0,
            )
        }
        for ext in self.extensions:
            ext.sources = generated[ext.name]
        super().build_extensions()


setup(
    ext_modules=[_ext(m) for m in MODULES],
    cmdclass={"build_ext": build_ext},
)
