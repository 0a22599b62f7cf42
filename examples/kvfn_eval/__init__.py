"""Evaluation of kvfn's policies, kept apart from the library (kvfn never imports it).

RULER-style tasks generated offline (``tasks``, ``haystack``), answer matching (``answers``),
the per-sample ``Evaluator`` (accuracy vs KV bytes, both query modes), ``report`` tables and
plots, and how every example starts a memory measurement (``memory``). ``examples/evaluate.py``
is the command line.
"""
