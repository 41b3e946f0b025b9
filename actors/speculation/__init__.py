"""Speculative decoding, apart from the batch it serves (as vLLM keeps
``spec_decode/`` apart from its runner):

- ``drafters``: what a row may guess from (its own n-grams, a shared index of
  recent rows, a draft model), each slot's drafter owned by the verifier;
- ``gate``: whether a step drafts and how wide, from measured step costs and
  each kind of draft's odds;
- ``verify``: the verify step (pending tokens and drafts in one forward, the
  target's samples, what each row keeps), timing for the gate.

The batch (``step.batch``) knows speculation only as its ``Verifying``
surface; the verifier changes the batch only through ``Batch.settle`` (the
tokens a verify step leaves pending) and ``Batch.roll_back`` (the drafts a row
did not keep taken out of its KV). Everything here runs on the GPU thread.
"""
