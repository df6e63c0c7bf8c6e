"""Imported last by the gloo ranks' fork server (``tests/multiproc.py``'s preload list), once it has imported
everything else: applies :mod:`tests.gc_policy` there, so every rank forked from it starts with the imports
frozen and the same collector thresholds. Importing it anywhere else does the same to that process."""

from tests import gc_policy

gc_policy.apply()
