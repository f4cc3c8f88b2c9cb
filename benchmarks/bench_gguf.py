"""A fine-tuned model's GGUF in llama.cpp against the merged model in transformers: tokens, logits, size.

Makes the demo's model shape (a random Llama, hidden 256, 8 layers, a byte-level BPE tokenizer fitted to the
bundled data), fine-tunes it with LoRA on that data (``--steps``), exports it with ``tiertune export --format
gguf`` in each type, and loads each file with llama.cpp (llama-cpp-python). Prints one JSON object: for every
type, the largest logit difference from transformers on the merged model (``tiertune export --format hf``),
the share of positions with the same top-1 token, how far the base model's logits are (the fine-tune the
file must carry), the file's size; and whether llama.cpp's tokenizer gave the Hugging Face ids on every
row of the data.

Run: ``python benchmarks/bench_gguf.py --dir /tmp/bg``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data" / "demo.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=8, help="Rows of the data whose logits are compared.")
    args = parser.parse_args()
    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiertune.cli.demo import make_model
    from tiertune.export.commands import export
    from tiertune.finetune.data import read_rows
    from tiertune.finetune.train import train

    texts = read_rows(DATA)["text"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-gguf-") as tmp:
        root = Path(tmp)
        base = make_model(root / "model", texts, layers=8, hidden=256, tokenizer="bpe")
        recipe = {
            "model": {"path": str(base), "dtype": "float32"},
            "data": {"path": str(DATA), "max_seq_len": 64},
            "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
            "training": {
                "output_dir": str(root / "run"),
                "max_steps": args.steps,
                "learning_rate": 3e-3,
                "per_device_train_batch_size": 16,
                "report_to": "none",
            },
            "offload": {"disk_path": str(root / "offload"), "params": "disk"},
        }
        (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        run = train(root / "recipe.yaml", progress=False)
        merged, _ = export(run.output_dir, root / "merged", "hf")
        tokenizer = AutoTokenizer.from_pretrained(merged)

        def logits(model_dir: Path, ids: list[int]) -> np.ndarray:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                return model(torch.tensor([ids])).logits[0].numpy()

        rows = [tokenizer(t)["input_ids"] for t in texts[:: max(1, len(texts) // args.rows)][: args.rows]]
        tuned = [logits(merged, ids) for ids in rows]
        original = [logits(base, ids) for ids in rows]
        result: dict = {"steps": args.steps, "loss": [run.losses[0], run.losses[-1]], "types": {}}
        for kind in ("f32", "f16", "bf16", "q8_0"):
            out, _ = export(run.output_dir, root / f"gguf-{kind}", "gguf", gguf_type=kind)
            file = out / f"model-{kind}.gguf"
            llm = llama_cpp.Llama(model_path=str(file), n_ctx=128, logits_all=True, verbose=False)
            try:
                if kind == "f32":
                    result["tokenizer_same_ids_rows"] = sum(
                        llm.tokenize(t.encode(), add_bos=True, special=True) == tokenizer(t)["input_ids"]
                        for t in texts
                    )
                    result["rows"] = len(texts)
                got = []
                for ids in rows:
                    llm.reset()
                    llm.eval(ids)
                    got.append(np.array(llm.scores[: len(ids)]))
            finally:
                llm.close()
            diff = max(float(np.abs(g - t).max()) for g, t in zip(got, tuned, strict=True))
            top1 = np.mean(
                np.concatenate([g.argmax(-1) == t.argmax(-1) for g, t in zip(got, tuned, strict=True)])
            )
            result["types"][kind] = {
                "max_abs_logit_difference": diff,
                "same_top1": float(top1),
                "fine_tune_max_abs_change": max(
                    float(np.abs(t - o).max()) for t, o in zip(tuned, original, strict=True)
                ),
                "file_bytes": file.stat().st_size,
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
