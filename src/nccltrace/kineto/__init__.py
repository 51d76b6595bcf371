"""PyTorch-profiler (Kineto) Chrome traces: a second kernel source beside nsys exports
(:mod:`.reader`, :class:`~.reader.KinetoTrace`; the streaming scan :mod:`.scan`; conversion to an
nsys export :mod:`.to_nsys`).

Imports nothing: import the module you use, so that code stamps hash only what runs.
"""
