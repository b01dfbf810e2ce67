"""Workloads: fixed-length prompts and outputs, and their perf_analyzer input-data files.

A workload is one prompt length, one output length (`ignore_eos`, so every request decodes exactly that
many tokens) and greedy or sampled decoding; or lengths drawn per request from a range, and outputs that may end
at the model's EOS. Request `i` of a workload is the same in every call (its tokens
come from the seed and `i`), and a sweep numbers its requests across levels, so no two requests of a run share
a prompt; with `shared_prefix_len` every prompt starts with the same that many tokens (a system prompt, for the
prefix cache). The same requests are written as perf_analyzer input-data JSON
(`perf_analyzer_configs/`), and `requests_from_file` reads such a file back into requests (`mstar bench
--input-data`): the tensors an entry holds and nothing more, so our harness and perf_analyzer send the same thing
(a knob an entry leaves out takes the server's default under both).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from mstar_common import wire
from mstar_common.bench.pa_files import is_int, json_type_rule
from mstar_common.engine.types import MAX_TEMPERATURE

PROMPT_ID_RANGE = (3, 400)  # ids every checkpoint here knows (the tiny tokenizer has ~400 tokens)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompt_len: int = 512
    output_len: int = 256
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling (1: off); a greedy request sends it only when set, a sampled one always
    top_k: int = 0  # 0: off
    seed: int = 0
    shared_prefix_len: int = 0  # leading tokens every prompt has in common
    prompt_len_max: int | None = None  # each prompt's length drawn from [prompt_len, prompt_len_max]
    output_len_max: int | None = None  # each request's max_tokens drawn from [output_len, output_len_max]
    ignore_eos: bool = True  # decode exactly max_tokens (False: a request may end at the model's EOS)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got {self.prompt_len} and {self.output_len}")
        for name, low in (("prompt_len_max", self.prompt_len), ("output_len_max", self.output_len)):
            high = getattr(self, name)
            if high is not None and high < low:
                raise ValueError(f"{name} must be >= {name.removesuffix('_max')} ({low}), got {high}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # (NaN fails it too: it passed `< 0`)
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (the server's range), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.shared_prefix_len <= self.prompt_len:
            raise ValueError(f"shared_prefix_len must be in [0, prompt_len={self.prompt_len}], "
                             f"got {self.shared_prefix_len}")

    def requests(self, count: int, first: int = 0) -> list[dict]:
        """Requests `first .. first + count - 1` (tensor name -> value, see mstar_common/wire.py)."""
        shared = _tokens(random.Random(f"{self.seed}:shared"), self.shared_prefix_len)
        out = []
        for index in range(first, first + count):
            rng = random.Random(f"{self.seed}:{index}")
            prompt_len = self.prompt_len if self.prompt_len_max is None else \
                random.Random(f"{self.seed}:{index}:prompt").randint(self.prompt_len, self.prompt_len_max)
            max_tokens = self.output_len if self.output_len_max is None else \
                random.Random(f"{self.seed}:{index}:output").randint(self.output_len, self.output_len_max)
            ids = shared + _tokens(rng, prompt_len - self.shared_prefix_len)
            req = {"input_ids": ids, "max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                   "temperature": self.temperature}
            # A sampled request pins both filters, "off" too: one it left unset would take the served checkpoint's
            # generation_config.json value (Qwen3: top_p 0.95, top_k 20), not the workload's.
            if self.temperature > 0 or self.top_p != 1.0:
                req["top_p"] = self.top_p
            if self.temperature > 0 or self.top_k:
                req["top_k"] = self.top_k
            out.append(req)
        return out


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(count)]


def perf_analyzer_data(requests: list[dict]) -> dict:
    """perf_analyzer `--input-data` JSON for the entry model's tensors (one entry per request)."""
    data = []
    for req in requests:
        data.append({
            "input_ids": {"content": req["input_ids"], "shape": [len(req["input_ids"])]},
            "max_tokens": [req["max_tokens"]],
            "ignore_eos": [req["ignore_eos"]],
            "temperature": [req["temperature"]],
            **{name: [req[name]] for name in ("top_p", "top_k") if name in req},
        })
    return {"data": data}


LIST_INPUTS = (wire.INPUT_IDS, wire.STOP, wire.STOP_TOKEN_IDS)  # the entry model's inputs of dims [-1]


def load_perf_analyzer_data(path: str | Path) -> list[dict]:
    """Requests from a perf_analyzer input-data file written by `perf_analyzer_data`."""
    raw = json.loads(Path(path).read_text())
    requests = []
    for entry in raw["data"]:
        req = {}
        for name, value in entry.items():
            content = value["content"] if isinstance(value, dict) else value
            # a list input is the whole list; a knob is its one value (more are left a list, for the check below)
            req[name] = list(content) if name in LIST_INPUTS or len(content) != 1 else content[0]
        requests.append(req)
    return requests


def requests_from_file(path: str | Path) -> list[dict]:
    """The requests of a perf_analyzer input-data file (`--input-data`), checked as the entry model's config would
    have perf_analyzer check them: each needs `input_ids` (a non-empty list of token ids) and `max_tokens` (>= 1);
    every other name must be one of the text-LM entry's inputs (`FILE_INPUTS`), a knob one value of its type.
    Nothing is filled in: a knob an entry leaves out takes the server's default, as under perf_analyzer (the
    generated files state `ignore_eos` and `temperature` in every entry). Raises ValueError naming the entry and
    the field."""
    try:
        requests = load_perf_analyzer_data(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: not a perf_analyzer input-data file ({{\"data\": [...]}}): {exc!r}") from None
    if not requests:
        raise ValueError(f"{path}: data: no requests")
    for index, req in enumerate(requests):
        if unknown := [name for name in req if name not in FILE_INPUTS]:
            if unknown[0] in TEXT_PROMPT_INPUTS:
                raise ValueError(f"{path}: data[{index}].{unknown[0]}: the harness replays token-id prompts "
                                 f"(input_ids); the entry's text prompts ({', '.join(TEXT_PROMPT_INPUTS)}) are "
                                 "perf_analyzer's alone")
            raise ValueError(f"{path}: data[{index}].{unknown[0]}: not an input of the text-LM entry model "
                             f"(the ones replayed: {', '.join(FILE_INPUTS)})")
        ids, max_tokens = req.get("input_ids"), req.get("max_tokens")
        if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"{path}: data[{index}].input_ids: must be a non-empty list of token ids (ints >= 0)")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{path}: data[{index}].max_tokens: must be an integer >= 1, got {max_tokens!r}")
        if scalars := [name for name, value in req.items() if name not in LIST_INPUTS and isinstance(value, list)]:
            raise ValueError(f"{path}: data[{index}].{scalars[0]}: one value per request, got "
                             f"{len(req[scalars[0]])}")
        for name, value in req.items():
            if name in wire.SAMPLING_INPUTS and (rule := json_type_rule(wire.SAMPLING_INPUTS[name][0], value)):
                raise ValueError(f"{path}: data[{index}].{name}: {rule}, got {value!r}")
        if not all(isinstance(s, str) for s in req.get(wire.STOP, [])):
            raise ValueError(f"{path}: data[{index}].{wire.STOP}: must be a list of strings")
        if not all(is_int(i) for i in req.get(wire.STOP_TOKEN_IDS, [])):
            raise ValueError(f"{path}: data[{index}].{wire.STOP_TOKEN_IDS}: must be a list of token ids (ints)")
    return requests


FILE_INPUTS = (wire.INPUT_IDS, *wire.SAMPLING_INPUTS, wire.STOP, wire.STOP_TOKEN_IDS)  # what an entry may hold
TEXT_PROMPT_INPUTS = ("text_input", "messages", "chat_template_kwargs")  # the entry's too, not replayed here
