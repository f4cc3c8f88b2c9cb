"""A Hugging Face model as the engine needs it: its skeleton on the meta device and its decoder stack
(``model``), its weights streamed into chunks shard by shard, quantized on the way in or read in place from
the files that hold them (``model``, ``weights``: safetensors read without mmap), and the quantized cache
that keeps a base quantized on load for the next run (``quant_cache``)."""
