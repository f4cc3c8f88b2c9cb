"""A stand-in for a vLLM or SGLang server in the tests (neither installs on a machine without a GPU): the endpoints
their documentation gives for loading LoRA adapters at run time and for OpenAI completions over token-id prompts,
served by transformers with each adapter loaded from the pushed directory by peft's own
``PeftModel.from_pretrained`` (a directory peft cannot load fails the push, as it would fail vLLM's).

    python tests/finetune/lora_server.py --model DIR --flavor vllm --port 8000

vLLM's: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``lora_name``, ``lora_path``; a name already
loaded is refused, an unknown one too), a completion's ``model`` the adapter's name, ``return_tokens_as_token_ids``
giving the sampled tokens as ``token_id:N``. SGLang's: ``/load_lora_adapter`` and ``/unload_lora_adapter``,
``model`` as ``base:name``, the tokens as text. Both: ``/v1/models`` lists the base first, then the adapters
loaded; the log-probabilities are of the raw logits; sampling at ``temperature`` with ``top_k`` (-1: off) and
``top_p`` from a generator seeded by ``seed``; a completion stops at the EOS token (``finish_reason: stop``).
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--flavor", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    adapters: dict[str, torch.nn.Module] = {}
    lock = threading.Lock()
    prefix = "/v1" if args.flavor == "vllm" else ""

    def complete(body: dict) -> tuple[int, dict]:
        name = body["model"]
        if args.flavor == "sglang":
            served, _, name = name.rpartition(":")
            if served != args.model:
                return 404, {"error": f"no base model {served!r}"}
        if name not in adapters:
            return 404, {"error": f"The model `{body['model']}` does not exist."}
        model = adapters[name]
        ids = torch.tensor([body["prompt"]], dtype=torch.long)
        temperature, top_k, top_p = (
            body.get("temperature", 1.0),
            body.get("top_k", -1),
            body.get("top_p", 1.0),
        )
        generator = torch.Generator().manual_seed(int(body.get("seed", 0)))
        out, logps, finish = [], [], "length"
        with torch.no_grad():
            for _ in range(body["max_tokens"]):
                logits = model(input_ids=ids).logits[0, -1].float()
                if temperature == 0:
                    token = int(logits.argmax())
                else:
                    scores = logits / temperature
                    if top_k and top_k > 0:
                        scores = scores.masked_fill(
                            scores < torch.topk(scores, top_k).values[-1], float("-inf")
                        )
                    if top_p < 1:
                        ordered, order = scores.sort(descending=True)
                        keep = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) < top_p
                        scores = torch.full_like(scores, float("-inf")).scatter(0, order[keep], ordered[keep])
                    token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
                out.append(token)
                logps.append(float(logits.log_softmax(-1)[token]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
                if token == tokenizer.eos_token_id:
                    finish = "stop"
                    break
        text_ids = out[:-1] if finish == "stop" else out
        as_ids = args.flavor == "vllm" and body.get("return_tokens_as_token_ids")
        tokens = [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in out]
        choice = {
            "index": 0,
            "text": tokenizer.decode(text_ids, skip_special_tokens=body.get("skip_special_tokens", True)),
            "finish_reason": finish,
            "logprobs": {"tokens": tokens, "token_logprobs": logps}
            if body.get("logprobs") is not None
            else None,
        }
        return 200, {"object": "text_completion", "model": body["model"], "choices": [choice]}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict | str) -> None:
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path != "/v1/models":
                return self._answer(404, {"error": "not found"})
            data = [{"id": args.model, "object": "model"}]
            data += [{"id": n, "object": "model", "parent": args.model} for n in adapters]
            return self._answer(200, {"object": "list", "data": data})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with lock:
                if self.path == f"{prefix}/load_lora_adapter":
                    name, path = body["lora_name"], body["lora_path"]
                    if name in adapters:
                        return self._answer(
                            400, {"error": f"The lora adapter '{name}' has already been loaded."}
                        )
                    try:
                        adapters[name] = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
                    except Exception as exc:
                        return self._answer(400, {"error": f"cannot load {path}: {exc}"})
                    return self._answer(200, f"Success: LoRA adapter '{name}' added successfully.")
                if self.path == f"{prefix}/unload_lora_adapter":
                    if adapters.pop(body["lora_name"], None) is None:
                        return self._answer(
                            404, {"error": f"The lora adapter '{body['lora_name']}' cannot be found."}
                        )
                    return self._answer(
                        200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
                    )
                if self.path == "/v1/completions":
                    return self._answer(*complete(body))
            return self._answer(404, {"error": "not found"})

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
