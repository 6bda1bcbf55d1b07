"""Build hook for the optional C fast paths (everything else is pyproject.toml).

``optional=True``: where no C compiler is at hand the build goes on without them, and
``aiocache_kv.tree.hashing`` / ``aiocache_kv.tree.keycmp`` /
``aiocache_kv.tree.pathwalk`` / ``aiocache_kv.fastcheck`` /
``aiocache_kv.storage.integrity`` compute the same values in Python,
``aiocache_kv.storage.page_file`` reads page by page, and ``aiocache_kv.gcfree`` leaves the
tree's int lists tracked by the garbage collector.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiocache_kv.tree._chainhash",
            sources=["aiocache_kv/tree/_chainhash.c"],
            optional=True,
        ),
        Extension(
            "aiocache_kv.tree._keycmp",
            sources=["aiocache_kv/tree/_keycmp.c"],
            depends=["aiocache_kv/tree/_tokens.h"],  # the token helpers both share
            optional=True,
        ),
        Extension(
            "aiocache_kv.tree._pathwalk",
            sources=["aiocache_kv/tree/_pathwalk.c"],
            depends=["aiocache_kv/tree/_tokens.h"],
            optional=True,
        ),
        Extension(
            "aiocache_kv._fastcheck",
            sources=["aiocache_kv/_fastcheck.c"],
            depends=["aiocache_kv/_pagecheck.h"],
            optional=True,
        ),
        Extension(
            "aiocache_kv.storage._blocksum",
            sources=["aiocache_kv/storage/_blocksum.c"],
            # the checksum _pageio shares; the chunked copy runner
            depends=["aiocache_kv/storage/_fletcher.h", "aiocache_kv/storage/_idlerun.h"],
            optional=True,
        ),
        Extension(
            "aiocache_kv._gcfree",
            sources=["aiocache_kv/_gcfree.c"],
            optional=True,
        ),
        Extension(
            "aiocache_kv.storage._pageio",
            sources=["aiocache_kv/storage/_pageio.c"],
            depends=["aiocache_kv/storage/_fletcher.h"],  # the checksum both share
            optional=True,
        ),
    ]
)
