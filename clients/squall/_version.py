"""The one place Squall's version is written: packaging, `squall --version` and status read it."""

__version__ = "0.1.0"
