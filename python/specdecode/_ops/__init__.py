"""Implementation of :mod:`specdecode.ops`, one module per op family."""
