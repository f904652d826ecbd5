"""Reference negative log-likelihoods from transformers, for the ppl.py integration test.

Runs under the CPU vLLM venv's Python (it has torch and transformers; the project venv does not).
Reads {"model_dir", "sequence", "windows": [[begin, end, first], ...]} as JSON on stdin, scores
each window's input tokens in float32 and prints the per-window NLL sums as a JSON list:
the same quantity ppl.py gets from the server's prompt logprobs.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    job = json.load(sys.stdin)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], torch_dtype=torch.float32).eval()
    sequence = job["sequence"]
    sums = []
    with torch.no_grad():
        for begin, end, first in job["windows"]:
            ids = torch.tensor([sequence[begin:end]])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            # logits at position p predict token p + 1
            targets = ids[0, first - begin:]
            picked = logprobs[first - begin - 1:end - begin - 1].gather(1, targets[:, None])
            sums.append(-picked.sum().item())
    json.dump(sums, sys.stdout)


if __name__ == "__main__":
    main()
