"""Engine integrations: mla_fa3 loaded as another engine's attention backend.

``sglang/``: the SGLang plugin (``--attention-backend mla_fa3``). The only package that imports an engine;
nothing below it knows it exists. It drives the backend like any engine: metadata, plan and ops per step.
"""
