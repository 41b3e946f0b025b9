"""The decode step's GPU-thread state: what ``gpu.call`` runs, never the event loop.

- ``batch``: the running batch (membership, KV, the plain pipelined step, and
  what a verify step leaves: ``settle``, ``roll_back``);
- ``joiner``: a joiner's prefill and prime (alone, or several padded together);
- ``slots``: a row's sampling state in a batch, and what a step reads from it;
- ``kv``: KV cache helpers the batch, the joiner and the prompt cache share;
- ``quantized``: quantized KV in the batch (``--kv-bits``);
- ``syncs``: a decode step's waits on the device, counted and timed by phase;
- ``warmup``: what a first request runs, run once at load;
- ``calls``: the count of GPU calls begun (the GPU actor counts, the verifier
  reads it to time steps).

The kernels the model runs with (attention, the C library, the compiled
blocks, packed products) are ``actors/kernels/``; speculative decoding is
``actors/speculation/``. The actors own these objects
and hand them to the GPU thread; nothing here imports an actor. Importers name
the module (``step.batch.Batch``): this package re-exports nothing, so taking
``kv`` does not load the batch.
"""
