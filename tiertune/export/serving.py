"""What serving engines need beside an export: an Ollama Modelfile for a GGUF, and what vLLM needs (or
refuses) in a PEFT adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (its default: 16)


def vllm_notes(config: dict[str, Any], base: str, adapter: Path) -> list[str]:
    """Sentences saying how vLLM serves the adapter of ``config`` (its adapter_config.json), or why it will
    refuse it and what to export instead."""
    refused = []
    if config.get("use_dora"):
        refused.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        refused.append(f"modules_to_save ({', '.join(config['modules_to_save'])})")
    if refused:
        return [
            f"vLLM does not load adapters with {' or '.join(refused)}: export the merged model instead "
            "(--format hf) and serve that"
        ]
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    rank = max(ranks)
    command = f"vllm serve {base} --enable-lora --lora-modules adapter={adapter}"
    if rank > 16:
        needed = next((r for r in VLLM_RANKS if r >= rank), None)
        if needed is None:
            return [
                f"vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}; this adapter's is {rank}: export the merged "
                "model instead (--format hf)"
            ]
        command += f" --max-lora-rank {needed}"
        return [f"vLLM: rank {rank} is above its default --max-lora-rank (16): {command}"]
    return [f"vLLM: {command}"]


def modelfile(gguf_file: str, info: dict[str, Any]) -> str:
    """An Ollama Modelfile for ``gguf_file`` (beside it): the chat template stays in the GGUF's metadata, where
    Ollama reads it (and picks its own template matching it); a model without one gets the bare prompt; the
    tokenizer's end-of-sequence tokens stop generation."""
    lines = [f"FROM ./{gguf_file}"]
    if not info.get("chat_template"):
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    for stop in info.get("stop", []):
        lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"
