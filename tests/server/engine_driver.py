"""A real ``sglang.Engine`` on CPU, run as a script by ``test_server_cpu.py`` (its own process).

    python tests/server/engine_driver.py MODEL_DIR

Starts the Engine (SGLang's tokenizer in this process, its scheduler and detokenizer spawned),
generates greedily from token ids and from a text prompt, lists the Engine's child processes
(pid and process title), shuts the Engine down and prints one line ``RESULT={json}``.
The Engine must start from a ``__main__`` guard: SGLang spawns its scheduler.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: Greedy, a fixed length: the output is checked for length and reproducibility.
SAMPLING = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."


def children() -> list[dict[str, Any]]:
    """The Engine's processes: pid and title (SGLang names them with setproctitle)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            out.append({"pid": child.pid, "title": " ".join(child.cmdline())})
        except psutil.Error:  # a process that ended meanwhile
            continue
    return out


def main(model: str) -> dict[str, Any]:
    import sglang as sgl
    from transformers import AutoTokenizer

    start = time.monotonic()
    engine = sgl.Engine(
        model_path=model, load_format="dummy", device="cpu", dtype="bfloat16",
        disable_radix_cache=True, skip_server_warmup=True, grammar_backend="none",
        random_seed=0, max_total_tokens=2048, chunked_prefill_size=512, log_level="info",
        sleep_on_idle=True,  # as test_server_cpu.py's server: no polling between requests
    )
    up_s = time.monotonic() - start
    try:
        procs = children()
        by_ids = engine.generate(input_ids=PROMPT_IDS, sampling_params=SAMPLING)
        again = engine.generate(input_ids=PROMPT_IDS, sampling_params=SAMPLING)
        by_text = engine.generate(PROMPT_TEXT, SAMPLING)
        text_ids = AutoTokenizer.from_pretrained(model)(PROMPT_TEXT)["input_ids"]
        by_text_ids = engine.generate(input_ids=text_ids, sampling_params=SAMPLING)
    finally:
        engine.shutdown()
    return {
        "pid": __import__("os").getpid(), "up_s": round(up_s, 1), "children": procs,
        "ids": by_ids["output_ids"], "ids_again": again["output_ids"],
        "text": by_text["text"], "text_output_ids": by_text["output_ids"],
        "text_prompt_tokens": by_text["meta_info"]["prompt_tokens"],
        "text_ids": text_ids, "text_ids_output_ids": by_text_ids["output_ids"],
        "total_s": round(time.monotonic() - start, 1),
    }


if __name__ == "__main__":
    print("RESULT=" + json.dumps(main(sys.argv[1])), flush=True)
