"""mla_fa3 as an SGLang attention backend (SGLang 0.5.17; ``pip install "mla_fa3[sglang]"``).

- ``plugin.py``: every point where mla_fa3 touches SGLang, each with the SGLang file it targets; ``register`` is
  the ``sglang.srt.plugins`` entry point SGLang runs in each of its processes.
- ``adapter.py``: ``SGLangMLABackend``, SGLang's ``AttentionBackend`` over SGLang's own pools.
- ``convert.py``: SGLang's ``ForwardBatch`` -> ours, and what SGLang may send that we refuse.

Importing this package imports nothing of SGLang; its modules do.
"""
