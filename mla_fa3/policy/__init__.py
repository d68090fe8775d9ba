"""Choices made from measurements: ``paths`` (the names of paths and kernels), ``decode_kernel`` (+ its
measured ``decode_table`` and the bench-CSV reader ``decode_csv``), ``prefill_cost`` (the prefill path
cost model) and ``prefill_fit`` (its calibration). Pure host arithmetic. Import from the modules."""
