"""The prompt mix the benchmarks share: edit tasks, JSON, open chat (SmolLM2 chat format)."""

from __future__ import annotations

CODE = """def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise KeyError("name")
    return data
"""

PROMPTS = {
    "edit-rename": "Rename the function load_config to read_config and return the whole code:\n"
    + CODE,
    "edit-typo": "Fix the typos and return the full text unchanged otherwise:\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and the fox ran "
    "awya into the forest where it met a rabbit.",
    "json-extract": "Extract the person as JSON with keys name, age and city: "
    "Maria Lopez is a 34 year old engineer who lives in Lisbon.",
    "json-list": 'Return a JSON list of three fruits, each {"name": ..., "color": ...}.',
    "chat-capital": "What is the capital of France? Answer in two sentences.",
    "chat-story": "Write a short story about a robot who learns to paint.",
}

EDIT_KEYS = [k for k in PROMPTS if k.startswith("edit")]


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
