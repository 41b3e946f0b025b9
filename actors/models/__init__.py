"""Model loading: from a name to a model and tokenizer on the GPU thread.

- ``registry``: what a name means (a path, a Hugging Face id, a GGUF file, a
  store's model, a registry model fetched once through pip) and the default model;
- ``stores``: Ollama's and LM Studio's local stores, read in place;
- ``gguf``, ``gguf_tensors``, ``gguf_tokenizer``: a GGUF file converted once into
  an mlx-lm directory (tensors, tokenizer, config) in the cache;
- ``load``: mlx-lm's ``load`` with our dtype, kernels and sharding, a draft
  model, and what a loaded model is (``ModelInfo``);
- ``default_model/``: the toy model shipped for offline use (data only).

Nothing here is an actor; the engine calls ``load`` once at start.
"""
