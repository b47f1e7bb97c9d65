"""Plumbing every room may use and that knows nothing of MARGE: atomic file writes, progress bars, the local Ray
instance, loopback checks. Imports nothing else of `marge`."""
