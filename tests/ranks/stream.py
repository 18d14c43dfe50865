"""Rank program: pipemlx.stream_generate on the demo model against mlx-lm's stream_generate in one process.

Spec: {"max_tokens", "eos_at"}: first a run to max_tokens, then one whose tokenizer also stops at the token
the reference produced at index ``eos_at`` (so both must end with finish_reason "stop" there).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx_lm
from mlx_lm.generate import stream_generate as mlx_stream_generate

import pipemlx
from pipemlx.demo import MODEL_DIR, default_prompt
from pipemlx.launch import init_group


def run(generate: Any, model: Any, tokenizer: Any, max_tokens: int) -> dict[str, Any]:
    responses = list(generate(model, tokenizer, default_prompt(), max_tokens=max_tokens, prefill_step_size=64))
    return {
        "text": "".join(r.text for r in responses),
        "tokens": [r.token for r in responses],
        "finish": responses[-1].finish_reason,
        "generation_tokens": responses[-1].generation_tokens,
        "prompt_tokens": responses[-1].prompt_tokens,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = init_group()
    model, tokenizer = pipemlx.load_sharded(MODEL_DIR, group)
    reference, ref_tokenizer = mlx_lm.load(str(MODEL_DIR))
    report: dict[str, Any] = {"rank": group.rank()}
    report["ref"] = run(mlx_stream_generate, reference, ref_tokenizer, spec["max_tokens"])
    report["pipe"] = run(pipemlx.stream_generate, model, tokenizer, spec["max_tokens"])
    eos = report["ref"]["tokens"][spec["eos_at"]]
    for wrapper in (tokenizer, ref_tokenizer):
        wrapper.add_eos_token(eos)
    report["ref_eos"] = run(mlx_stream_generate, reference, ref_tokenizer, spec["max_tokens"])
    report["pipe_eos"] = run(pipemlx.stream_generate, model, tokenizer, spec["max_tokens"])
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
