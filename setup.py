"""Build hook for the optional C fast path of the page hashes (everything else is pyproject.toml).

``optional=True``: where no C compiler is at hand the build goes on without it, and
``aiocache_kv.tree.hashing`` computes the same hashes in pure Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiocache_kv.tree._chainhash",
            sources=["aiocache_kv/tree/_chainhash.c"],
            optional=True,
        )
    ]
)
