"""Isolation backends: one module per substrate behind :mod:`dsec.backends.base`."""
