"""Choices made from measurements: ``paths`` (the names of paths and kernels), ``decode_kernel`` (+ its
measured ``decode_table`` and the bench-CSV reader ``decode_csv``), ``kernel_choice`` (a backend's per-step
decode kernel, the table's choice cached), ``prefill_cost`` (the prefill path
cost model) and ``prefill_fit`` (its calibration). Pure host arithmetic. Import from the modules."""
