"""CUDA graphs: ``capture`` (the metadata builder's capture buffers and their in-place replay update),
``static`` (a graph's static inputs and the padding of a live batch into them), ``runner``
(``GraphRunner``: capture a set of batch sizes, replay the one a live batch fits), ``captured``
(``CapturedGraphs``: a backend's captured steps, and the one a replay takes). Import from the modules."""
