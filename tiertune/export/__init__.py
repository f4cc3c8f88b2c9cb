"""A run or checkpoint written out for where models are served: ``commands`` (``export``, ``merge``: a
Hugging Face model, a PEFT adapter, a GGUF or a GGUF LoRA, written beside the output and renamed into
place), ``merging`` (a LoRA adapter folded into its base tensor by tensor), ``gguf`` (llama.cpp's names,
layouts and tokenizer per architecture) and ``serving`` (Ollama's Modelfile, what vLLM needs)."""
