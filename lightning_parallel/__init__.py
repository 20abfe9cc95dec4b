"""lightning_parallel: pipeline and tensor parallelism as drop-in Lightning strategies.

Importing the package is cheap: submodules load on first use.
"""

__all__: list[str] = []
