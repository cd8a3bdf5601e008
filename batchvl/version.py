"""batchvl's version, declared once: the package metadata reads it from here (pyproject.toml), and every
layer may import it, as it imports nothing."""

__version__ = "0.1.0"
