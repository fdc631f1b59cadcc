"""The ``chimes`` command line."""
