"""What differs per model: turning an mlx-lm model into one rank's stage.

- :mod:`.architectures`: the registry of per-architecture fixups (bookkeeping about the whole layer list).
- :mod:`.sharding`: ``shard_model``: keep this rank's layers, wrap the edges, attach the stage.
- :mod:`.loading`: ``load_sharded``: mlx-lm's loader, lazily, so a rank reads only its weights.
- :mod:`.hub`: a Hugging Face repo id in place of a folder: each rank fetches only the weight files it needs.
- :mod:`.parameters`: a built model's parameter bytes, for the memory-planned split.
- :mod:`.safetensors`: a model folder's parameter bytes from its safetensors headers.
"""
