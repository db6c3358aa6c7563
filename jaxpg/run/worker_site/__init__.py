"""The folder that ``jaxpg-run`` puts first on its Python workers' ``PYTHONPATH``: its
``sitecustomize`` writes a worker's uncaught exception to its error file."""
