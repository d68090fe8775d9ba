"""Benchmarks of the mla_fa3 backend on the H200 (``mla-fa3 bench decode | prefill``).

``timing`` holds the shared timing helpers (CUDA events, graph replays, L2-defeating input rotation,
the measured H200 ceilings); ``decode`` the decode sweep; ``roofline`` its roofline model and plot; ``smoke`` the
one rule about the machine (without CUDA: a one-line refusal, or with ``--device cpu`` a labelled smoke run).
Speed claims come from these scripts, never from tests.
"""
