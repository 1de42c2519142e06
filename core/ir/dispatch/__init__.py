"""Eager dispatch: the generated entry points (`entry_points`), the decision cache and its key
(`decision_cache`, `cache_key`), provider selection and fallback (`selection`, `fallback`),
the donation check (`donation`), what a call reports to a trace (`observe`), and the compiled
cache-hit path (`fast_lookup`, with its C++ source ``fast_lookup.cpp`` beside it)."""
