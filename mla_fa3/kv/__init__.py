"""KV memory: ``req_to_token`` (request rows -> token slots), ``allocator`` (pages of slots handed to
rows), ``pools`` (the per-layer latent / MHA buffers those slots index). Import from the modules."""
