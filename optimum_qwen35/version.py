"""The package's version (a leaf module: what records and cards cite it from)."""

__version__ = "0.1.0.dev0"
