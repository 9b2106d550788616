"""flatopt's version, in a module of its own so that every module can import it at the top."""

__version__ = "0.1.0"
